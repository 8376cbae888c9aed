"""Directories the test processes of one run share (pytest-xdist runs several): the stores the real models are
pulled into once, and where the bare-install test leaves its state."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


def shared_root(factory) -> Path:
    """A directory every test process of this run shares: pytest-xdist's workers each have a temp dir of their own
    below a common one."""
    root = factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@contextmanager
def pull_store(factory, name: str):
    """`$TFSERVE_HOME` set, for a pull, to `$TFSERVE_TEST_HOME` or to a store `name` that the run's test processes
    share, and held by this process alone meanwhile (another worker pulling into it waits, then finds the model)."""
    home = Path(os.environ.get("TFSERVE_TEST_HOME") or shared_root(factory) / name)
    home.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("TFSERVE_HOME")
    os.environ["TFSERVE_HOME"] = str(home)
    try:
        with open(home.parent / f".{home.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield home
    finally:
        if saved is None:
            os.environ.pop("TFSERVE_HOME", None)
        else:
            os.environ["TFSERVE_HOME"] = saved
