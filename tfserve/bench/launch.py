"""`--launch`: start the server under test, wait until it answers, stop it afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

from tfserve.errors import TfserveError


def server_root(base_url: str) -> str:
    """`http://host:port/v1` -> `http://host:port`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def wait_until_ready(base_url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll `/health` (or `/v1/models`) until one answers 200."""
    root = server_root(base_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise TfserveError(f"the launched server exited with code {process.returncode} before it was ready")
        for path in ("/health", "/v1/models"):
            try:
                with urllib.request.urlopen(root + path, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
        time.sleep(0.5)
    raise TfserveError(f"{root} did not answer /health or /v1/models within {timeout_s:.0f} s")


@contextmanager
def launched(command: str | None, base_url: str, timeout_s: float = 600.0, log_path: str | None = None):
    """Run `command` (a shell command line) for the duration of the block; None: nothing to launch."""
    if not command:
        yield None
        return
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_ready(base_url, timeout_s, process)
        yield process
    finally:
        _stop(process)
        if log_path:
            log.close()


def _stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
