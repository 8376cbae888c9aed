"""The README's first command on a fresh machine: a new venv with only the core install, an empty
`TFSERVE_HOME` (so the model is pulled, converted and the CPU kernels built from nothing), until the
server answers a chat request. CI installs the dev extras for everything else; this test is what catches
a package the default path needs that only an extra brings."""

from __future__ import annotations

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


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the README command exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"no healthy server after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


class _Started:
    """The README command, started: its process, port, log."""

    def __init__(self, tmp_path: Path) -> None:
        venv = tmp_path / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        command = readme_first_command()
        self.port = README_PORT if _port_free(README_PORT) else _free_port()
        if self.port != README_PORT:
            command += f" --port {self.port}"
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("TFSERVE_", "VIRTUAL_ENV", "PYTHON", "PYENV"))}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
                   TFSERVE_HOME=str(tmp_path / "home"), PIP_DISABLE_PIP_VERSION_CHECK="1")
        self.log = tmp_path / "serve.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


_early: _Started | None = None


def start_early(tmp_path: Path) -> None:
    """Start the README command when the session starts (tests/conftest.py): its install, pull and kernel build
    take minutes, mostly on one core, and run beside the tests before this one (most of them one thread)."""
    global _early
    _early = _Started(tmp_path)


def stop_early() -> None:
    if _early is not None:
        _early.stop()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bare_install_serves_the_default_model(tmp_path):
    started = _early or _Started(tmp_path)
    proc, port, log = started.proc, started.port, started.log
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log, timeout_s=1200)
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
    assert proc.returncode == 0, log.read_text()[-4000:]
