"""`--launch`: start the server under test, wait until it answers, stop it afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager

from tfserve.errors import TfserveError

TAIL_LINES = 20  # of a launched server's output, shown when it dies before it is ready


def server_root(base_url: str) -> str:
    """`http://host:port/v1` -> `http://host:port`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def wait_until_ready(base_url: str, timeout_s: float, process: subprocess.Popen | None = None, log=None) -> None:
    """Poll until `/health` answers 200; a server without `/health` (404) is ready once `/v1/models` is. Where
    the launched `process` dies or never answers, the last lines of its output (`log`, the file it writes to)
    are printed first: they say why (a misspelt model, a port in use), which the exit code alone does not."""
    root = server_root(base_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            shown = _show_tail(log)
            raise TfserveError(f"the launched server exited with code {process.returncode} before it was ready"
                               + (" (its last output is above)" if shown else " (it printed nothing)"))
        status = _status(root + "/health")
        if status == 200 or (status == 404 and _status(root + "/v1/models") == 200):
            return
        time.sleep(0.1)
    shown = _show_tail(log)
    raise TfserveError(f"{root} did not answer /health or /v1/models within {timeout_s:.0f} s"
                       + (" (the launched server's last output is above)" if shown else ""))


def output_tail(log, num_lines: int = TAIL_LINES) -> list[str]:
    """The last `num_lines` lines written to the binary file `log` (None: none), read from its last 64 KiB."""
    if log is None:
        return []
    try:  # pread: the server writes through the same file offset, which a seek here would move
        size = os.fstat(log.fileno()).st_size
        text = os.pread(log.fileno(), 65536, max(0, size - 65536)).decode("utf-8", "replace")
    except (OSError, ValueError):
        return []
    return [line.rstrip() for line in text.splitlines() if line.strip()][-num_lines:]


def _show_tail(log) -> bool:
    """Print the launched server's last lines to stderr, indented under a heading; whether there were any."""
    lines = output_tail(log)
    if lines:
        print("The launched server's last output:", *(f"    {line}" for line in lines), sep="\n", file=sys.stderr)
    return bool(lines)


def check_reachable(base_url: str, launch_hint: bool = True, loading_timeout_s: float = 600.0) -> None:
    """One readable line when nothing answers at `base_url` (any HTTP status counts as an answer); it suggests
    --launch where the command has it. A server whose /health says 503 (tfserve, vLLM, llama.cpp while their
    model loads) is waited for, up to `loading_timeout_s`: every request sent meanwhile would fail."""
    root = server_root(base_url)
    status = _status(root + "/health")
    if status is None:
        hint = " (or pass --launch)" if launch_hint else ""
        raise TfserveError(f"cannot reach {root} — is the server running?{hint}")
    if status != 503:
        return
    print(f"{root} is loading its model; waiting for it (up to {loading_timeout_s:.0f} s)", file=sys.stderr)
    deadline = time.monotonic() + loading_timeout_s
    while status == 503 and time.monotonic() < deadline:
        time.sleep(0.5)
        status = _status(root + "/health")
    if status == 503:
        raise TfserveError(f"{root} was still loading its model after {loading_timeout_s:.0f} s")
    if status is None:
        raise TfserveError(f"{root} stopped answering while its model loaded")


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError as exc:
        from tfserve.chat.client import tls_problem

        parts = urllib.parse.urlsplit(url)
        tls = tls_problem(exc, f"{parts.scheme}://{parts.netloc}")
        if tls is not None:  # something answers, in plain HTTP (or with an untrusted certificate): no use waiting
            raise TfserveError(tls) from None
        return None
    except (OSError, ValueError):
        return None


@contextmanager
def launched(command: str | None, base_url: str, timeout_s: float = 600.0, log_path: str | None = None):
    """Run `command` (a shell command line) for the duration of the block; None: nothing to launch. Its output
    goes to `log_path`, else to a temporary file, removed afterwards: either way its last lines are shown if it
    dies before it is ready. The process yielded has `ready_s`: seconds from its start until it answered."""
    if not command:
        yield None
        return
    root = server_root(base_url)
    if _status(root + "/health") is not None:  # else the run would measure that server, whatever ours did
        raise TfserveError(f"something already answers at {root}: stop it, or give --url the address the "
                           "--launch command listens on")
    log = open(log_path, "a+b") if log_path else tempfile.TemporaryFile()
    try:
        process = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            started = time.monotonic()
            wait_until_ready(base_url, timeout_s, process, log)
            process.ready_s = time.monotonic() - started
            yield process
        finally:
            _stop(process)
    finally:
        log.close()


def _stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the launched command's whole process group and wait until every process of it is gone (the shell
    exits at once; the server it started may still be draining and answering), SIGKILL past `grace_s`: the next
    launch must not find the last one still listening."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline, killed = time.monotonic() + grace_s, False
    while _group_alive(process):
        if time.monotonic() > deadline:
            if killed:  # (a zombie no one reaps keeps its group: give up waiting)
                break
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline, killed = time.monotonic() + 5.0, True
        time.sleep(0.05)
    process.wait()


def _group_alive(process: subprocess.Popen) -> bool:
    process.poll()  # reap the shell itself once it exits
    try:
        os.killpg(process.pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` and every process under it (a shell's server, a server's workers), from
    /proc; 0 where it cannot be read."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                fields = file.read().rpartition(")")[2].split()
            with open(f"/proc/{entry}/statm") as file:
                rss[int(entry)] = int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += rss.get(current, 0)
        todo.extend(children.get(current, ()))
    return total
