"""Which threads run torch, and for how long.

torch's CPU ops and our kernels run their parallel loops on OpenMP, and libgomp keeps a pool of worker
threads for every thread that ever ran a parallel loop, until that thread ends. While the pools hold more
threads than the machine has cores, libgomp stops spinning between parallel loops: each loop then sleeps and
wakes its workers, which made a decode step twice as slow on 2 cores (SmolLM2: 150 -> 78 tokens/s). So
torch work that is not a step (loading a model, audio features, image processing) runs on a thread that ends
(`run_in_fresh_thread`), and each batcher steps on a `WorkThread`, which ends when it has been idle a moment:
an idle chat engine does not slow a busy transcriber, nor a finished transcription the chat engine.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger("tfserve.engine")

LINGER_S = 0.2  # an idle WorkThread waits this long for more work before it ends


def run_in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a new thread that ends with it (so do its OpenMP workers); its result or
    exception comes back here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # raised again on the caller's thread
            box["error"] = exc

    start_daemon(target, "tfserve-work").join()
    if "error" in box:
        raise box["error"]
    return box["result"]


_unfinished: set[threading.Thread] = set()  # start_daemon's threads whose work has not returned
_unfinished_lock = threading.Lock()


def start_daemon(target: Callable[[], None], name: str) -> threading.Thread:
    """Start `target` on a daemon thread, counted as unfinished until it returns (`abandoned_torch_work`)."""
    def run() -> None:
        try:
            target()
        finally:
            with _unfinished_lock:
                _unfinished.discard(thread)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _unfinished_lock:
        _unfinished.add(thread)
    thread.start()
    return thread


def abandoned_torch_work() -> bool:
    """Whether work of `start_daemon`'s threads still runs that nobody waits for any more (a model load the user
    interrupted; counted by the work's own end: a join that Ctrl-C interrupts marks a running thread as not
    alive). The process must then end without the interpreter's teardown: a daemon thread inside a torch op
    while it runs aborts the process ("terminate called without an active exception", exit 134)."""
    current = threading.current_thread()
    with _unfinished_lock:
        return any(thread is not current for thread in _unfinished)


_started: weakref.WeakSet[WorkThread] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At exit, stop every work thread and wait for its step: a daemon thread still inside a torch op while the
    interpreter tears down aborts the process ("terminate called without an active exception")."""
    for work in list(_started):
        work.stop(block=True, timeout=30)


class WorkThread:
    """Calls `step()` on a thread of its own while `has_work()`; `wake()` (from any thread) says there is new
    work and starts the thread again if it has ended. After `stop()`, `on_stop()` runs once: on the thread if
    it is running, else on the caller."""

    def __init__(self, name: str, step: Callable[[], None], has_work: Callable[[], bool],
                 on_stop: Callable[[], None] | None = None, linger_s: float = LINGER_S) -> None:
        self.name = name
        self._step, self._has_work, self._on_stop = step, has_work, on_stop
        self._linger_s = linger_s
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._woken = False  # wake() since the thread last looked: it does not end before another look
        self._started = False
        self._stopped = False
        self.num_starts = 0  # threads started, for tests and metrics

    @property
    def is_running(self) -> bool:
        """Started and not stopped (its thread may be resting: it comes back on the next `wake()`)."""
        return self._started and not self._stopped

    @property
    def stopped(self) -> bool:
        """`stop()` was called (and `start()` not since)."""
        return self._stopped

    @property
    def is_alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> WorkThread:
        with self._cond:
            self._started, self._stopped = True, False
        _started.add(self)
        self.wake()
        return self

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            if self._started and not self._stopped and self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.num_starts += 1
                self._thread.start()
            self._cond.notify()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
            self._cond.notify()
        if thread is None:
            if self._on_stop is not None:
                self._on_stop()
        elif block and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        try:
            stopped = self._loop()
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None
        if stopped and self._on_stop is not None:
            self._on_stop()

    def _loop(self) -> bool:
        """Step while there is work; True when stopped, False when idle for `linger_s`."""
        idle_since: float | None = None
        while True:
            with self._cond:
                if self._stopped:
                    return True
                busy = self._woken or self._has_work()
                self._woken = False
                if not busy:
                    now = time.monotonic()
                    idle_since = idle_since or now
                    if now - idle_since >= self._linger_s:
                        self._thread = None  # under the lock: a wake() from here on starts a new thread
                        return False
                    self._cond.wait(self._linger_s)
                    continue
            idle_since = None
            try:
                self._step()
            except Exception:  # the owner's step fails its own work; this thread goes on with the rest
                logger.exception("%s: step failed", self.name)
