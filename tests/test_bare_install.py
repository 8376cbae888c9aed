"""The README's first command on a fresh machine: a new venv with only the core install, an empty
`TFSERVE_HOME` (so the model is pulled, converted and the CPU kernels built from nothing), until the
server answers a chat request. CI installs the dev extras for everything else; this test is what catches
a package the default path needs that only an extra brings."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_PORT = 8000  # where the README's command listens


def readme_first_command() -> str:
    """The first bash block of the README's "Set up" section."""
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1]
    return re.search(r"```bash\n(.+?)\n```", setup, re.DOTALL).group(1).strip()


def test_readme_first_command_installs_and_serves():
    assert readme_first_command() == "pip install -e . && tfserve serve"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, started: "_Started", timeout_s: float) -> None:
    log = started.log
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if started.exit_code() is not None:
            pytest.fail(f"the README command exited {started.exit_code()}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"no healthy server after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


class _Started:
    """The README command, started (by this process, or by another test process of the run): its process group,
    port, log, and the file its exit code goes to."""

    def __init__(self, pid: int, port: int, log: Path, rc: Path, process: subprocess.Popen | None = None) -> None:
        self.pid, self.port, self.log, self.rc, self.process = pid, port, log, rc, process

    @classmethod
    def start(cls, tmp_path: Path) -> "_Started":
        venv = tmp_path / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        command = readme_first_command()
        port = README_PORT if _port_free(README_PORT) else _free_port()
        if port != README_PORT:
            command += f" --port {port}"
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("TFSERVE_", "VIRTUAL_ENV", "PYTHON", "PYENV", "PYTEST_"))}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
                   TFSERVE_HOME=str(tmp_path / "home"), PIP_DISABLE_PIP_VERSION_CHECK="1")
        log, rc = tmp_path / "serve.log", tmp_path / "exit-code"
        with open(log, "wb") as out:
            # the command runs under a Python that outlives its Ctrl+C (a handler, which exec does not pass on) and
            # writes its exit code, for whichever test process asks (bash's own `$?` reads 130 after a Ctrl+C)
            process = subprocess.Popen([sys.executable, "-c", _WRAPPER, command, str(rc)], cwd=ROOT, env=env,
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(process.pid, port, log, rc, process)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"pid": self.pid, "port": self.port, "log": str(self.log), "rc": str(self.rc)}))

    @classmethod
    def load(cls, path: Path) -> "_Started":
        state = json.loads(path.read_text())
        return cls(state["pid"], state["port"], Path(state["log"]), Path(state["rc"]))

    def exit_code(self) -> int | None:
        """The command's exit code once it has ended, else None."""
        if self.process is not None:
            self.process.poll()
        return int(self.rc.read_text()) if self.rc.is_file() and self.rc.read_text().strip() else None

    def stop(self) -> None:
        """Ctrl+C to the command's processes (SIGKILL to the group after a minute); waits until it has ended. Not
        to bash itself: whether a bash that got the Ctrl+C too reports the server's own exit code or dies of the
        signal varies, and the server's code is the one checked."""
        deadline = time.monotonic() + 60
        for sig in (signal.SIGINT, signal.SIGKILL):
            try:
                if sig == signal.SIGINT:  # the group's leader is the wrapper (below), which waits for bash
                    for pid in _group(self.pid, skip=(self.pid,), skip_names=("bash",)):
                        os.kill(pid, sig)
                else:
                    os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            while time.monotonic() < deadline and self.exit_code() is None and _group_alive(self.pid):
                time.sleep(0.2)
            if self.exit_code() is not None or not _group_alive(self.pid):
                break
            deadline = time.monotonic() + 10
        if self.process is not None:
            self.process.wait()


def _group(pgid: int, skip: tuple[int, ...] = (), skip_names: tuple[str, ...] = ()) -> list[int]:
    """The running processes of the group (not zombies waiting for another test process to reap them), but the
    pids in `skip` and the programs named in `skip_names`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()  # state, ppid, pgrp
        pid = int(stat.parent.name)
        if int(fields[2]) == pgid and fields[0] != "Z" and pid not in skip and name not in skip_names:
            pids.append(pid)
    return pids


def _group_alive(pgid: int) -> bool:
    return bool(_group(pgid))


_WRAPPER = ("import signal, subprocess, sys; signal.signal(signal.SIGINT, lambda *_: None); "
            "code = subprocess.call(['bash', '-c', sys.argv[1]]); open(sys.argv[2], 'w').write(str(code))")
_early: _Started | None = None
STATE_FILE = "bare-install.json"


def start_early(tmp_path: Path, shared: Path) -> None:
    """Start the README command when the session starts (tests/conftest.py): its install, pull and kernel build
    take minutes, mostly on one core, and run beside the tests before this one. With pytest-xdist the first worker
    starts it and leaves its state in `shared`, for whichever worker runs the test."""
    global _early
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    _early = _Started.start(tmp_path)
    _early.save(shared / STATE_FILE)


def stop_early(shared: Path) -> None:
    """Stop the README command, if the test has not, once every test process is done with it: in pytest-xdist's
    controller after its workers have ended (a worker ends when its own tests are done, maybe while another runs
    this test against the server; and a second Ctrl+C that lands while the server's Python finalizes kills it by
    the signal, not exit 0), or in the one process of a run without workers."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    started = _early or (_Started.load(shared / STATE_FILE) if (shared / STATE_FILE).is_file() else None)
    if started is not None:
        started.stop()


def _started(tmp_path: Path, shared: Path) -> _Started:
    if _early is not None:
        return _early
    if (shared / STATE_FILE).is_file():
        return _Started.load(shared / STATE_FILE)
    return _Started.start(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bare_install_serves_the_default_model(tmp_path, shared_dir):
    started = _started(tmp_path, shared_dir)
    port, log = started.port, started.log
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, started, timeout_s=1200)
        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        # greedy: a sampled answer (the model's recommended temperature 0.2) depends on the CPU's float rounding,
        # and on some CPUs rambles to the end of the context instead of answering
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", answer  # the model's own end, not a runaway
        assert "Paris" in answer, answer
        text = log.read_text()
        # a log (not a terminal) shows each stage as a line of its own
        for stage in ("Downloading", "Verifying", "Converting", "Building tfserve's CPU kernels", "Loading"):
            assert stage in text, text[-4000:]
    finally:
        started.stop()
    assert started.exit_code() == 0, log.read_text()[-4000:]
