"""A thread-safe face of the engine: a background thread steps it while other threads add, await and
abort requests (the shape of transformers' `ContinuousBatchingManager`). The thread ends when the engine has
been idle a moment and comes back with the next request (why: `tfserve.engine.threads`)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from tfserve.engine.core import Engine
from tfserve.engine.request import Request, RequestOutput
from tfserve.engine.threads import WorkThread
from tfserve.errors import EngineFailedError
from tfserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


class BatchingManager:
    """Runs an `Engine` on a background thread. Every public method is safe to call from any thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._sinks: dict[str, tuple[Sink, bool, bool]] = {}  # request id -> (sink, stream, own queue)
        self._queues: dict[str, queue.SimpleQueue] = {}
        # requests of the built-in queues that have finished and whose result nobody has read yet, oldest first
        self._unread: OrderedDict[str, None] = OrderedDict()
        self._unread_changed = threading.Condition()
        # ids a thread is reading (request_iter, get_result(id)): get_result() without an id leaves them alone
        self._claimed: set[str] = set()
        # held to check `_closed` and queue an add as one: stop() closes first, so an add either is queued before
        # the stop's abort-all runs (and is aborted by it) or raises; never queued after, to wait forever
        self._admit = threading.Lock()
        self._closed = False
        self._ids = itertools.count()
        self._worker = WorkThread("tfserve-engine", self._step, self._has_work, on_stop=self._abort_all)
        # told once, on the engine thread, when the engine fails for good (Engine.failure: a dead rank)
        self.on_failure: Callable[[str], None] | None = None
        self._failure_told = False

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> BatchingManager:
        if not self._worker.is_running:
            with self._admit:
                self._closed = False
            self._worker.start()
        return self

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the loop; requests still running are aborted. Requests added after it raise until `start()`."""
        with self._admit:
            self._closed = True
        self._worker.stop(block, timeout)

    @property
    def is_running(self) -> bool:
        return self._worker.is_running

    def __enter__(self) -> BatchingManager:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(self, input_ids: list[int] | str, request_id: str | None = None,
                    params: SamplingParams | Any | None = None, stream: bool = False,
                    sink: Sink | None = None) -> str:
        """Validate and queue one request and return its id. `stream=True` delivers every new token's output,
        else only the final one; `sink` (called on the engine thread) replaces the built-in queue. Before
        `start()` a request waits for it; after `stop()` it is a RuntimeError."""
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._sinks:
            raise ValueError(f"request_id {request_id!r} is already in use")
        requests = self.engine.make_requests(input_ids, params, request_id)
        if len(requests) != 1:
            raise ValueError("n must be 1 here; add one request per sample or use Engine.generate_batch")
        self.add_requests(requests, stream=stream, sink=sink)
        return request_id

    def add_requests(self, requests: list[Request], stream: bool = False, sink: Sink | None = None) -> list[str]:
        """Queue requests built by `Engine.make_requests` as they are (not validated again) and return their
        ids. `stream` and `sink` as for `add_request`; one sink may serve them all (outputs carry their id)."""
        with self._admit:
            if self._closed or self._worker.stopped:
                raise RuntimeError("the manager is stopped: start() it again before adding requests")
            with self._lock:
                for request in requests:
                    if request.request_id in self._sinks or request.request_id in self._queues:
                        raise ValueError(f"request_id {request.request_id!r} is already in use (running, or its "
                                         f"result not read yet)")
                for request in requests:
                    if sink is None:
                        own = self._queues[request.request_id] = queue.SimpleQueue()
                        self._sinks[request.request_id] = (own.put, stream, True)
                    else:
                        self._sinks[request.request_id] = (sink, stream, False)
            for request in requests:
                self._commands.put(("add", request))
        self._worker.wake()
        return [request.request_id for request in requests]

    def abort(self, request_id: str) -> None:
        """Finish a request now; its blocks are freed before the next step."""
        self._commands.put(("abort", request_id))
        self._worker.wake()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> RequestOutput | None:
        """The final output of `request_id`, or, without one, of a finished request whose result nobody has
        read yet and no other thread is reading (the oldest; else the next to finish). A result is kept until
        it is read. None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if request_id is None:
            with self._unread_changed:
                if not self._unread_changed.wait_for(lambda: self._first_unclaimed() is not None, timeout):
                    return None
                request_id = self._first_unclaimed()
                self._claimed.add(request_id)
        else:
            request_id = self._claim(str(request_id))
        try:
            q = self._queues[request_id]
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                output = q.get(timeout=left)
                if output.finished:
                    self._read(output.request_id)
                    return output
        except queue.Empty:
            return None
        finally:
            self._release(request_id)

    def request_id_iter(self, request_id: str) -> Iterator[RequestOutput]:
        """Yield the request's outputs as they come; ends by itself when it finishes."""
        request_id = self._claim(str(request_id))
        return self._outputs(request_id)

    request_iter = request_id_iter  # transformers' ContinuousBatchingManager's name

    def _outputs(self, request_id: str) -> Iterator[RequestOutput]:
        try:
            q = self._queues[request_id]
            while True:
                output = q.get()
                yield output
                if output.finished:
                    self._read(output.request_id)
                    return
        finally:
            self._release(request_id)

    def _first_unclaimed(self) -> str | None:
        return next((request_id for request_id in self._unread if request_id not in self._claimed), None)

    def _claim(self, request_id: str) -> str:
        """Mark `request_id` as read by this thread: KeyError for an id with no result to read, ValueError for one
        another thread reads (its outputs would be split between the two)."""
        with self._unread_changed:
            if request_id not in self._queues:
                raise KeyError(f"unknown request_id {request_id!r}")
            if request_id in self._claimed:
                raise ValueError(f"request_id {request_id!r} is being read by another thread")
            self._claimed.add(request_id)
        return request_id

    def _release(self, request_id: str) -> None:
        with self._unread_changed:
            self._claimed.discard(request_id)
            self._unread_changed.notify_all()  # a get_result() without an id may take it now

    def _read(self, request_id: str) -> None:
        """A finished result has been read: its queue and its place among the unread go."""
        self._queues.pop(request_id, None)
        with self._unread_changed:
            self._unread.pop(request_id, None)

    # -- the engine thread ---------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return not self._commands.empty() or self.engine.has_unfinished

    def _step(self) -> None:
        engine = self.engine
        self._run_commands()
        if not engine.has_unfinished:
            return
        try:
            outputs = engine.step()
        except Exception as exc:  # a bug in the step itself: fail what is running, keep serving
            logger.exception("engine step failed")
            outputs = [engine.fail(r, f"{type(exc).__name__}: {exc}") for r in list(engine.requests.values())]
        for output in outputs:
            self._deliver(output)
        if engine.failure is not None and not self._failure_told:
            self._failure_told = True
            if self.on_failure is not None:
                self.on_failure(engine.failure)

    def _abort_all(self) -> None:
        self._run_commands()
        for request_id in list(self.engine.requests):
            self._deliver(self.engine.abort(request_id))

    def _run_commands(self) -> None:
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self._add(payload)
            else:
                output = self.engine.abort(payload)
                if output is not None:
                    self._deliver(output)

    def _add(self, request: Request) -> None:
        try:
            self.engine.enqueue(request)
        except (ValueError, EngineFailedError) as exc:
            self._deliver(self.engine.fail(request, str(exc)))

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            entry = self._sinks.get(output.request_id)
            if entry is not None and output.finished:
                del self._sinks[output.request_id]
        if entry is None:
            return
        sink, stream, own_queue = entry
        if output.finished and own_queue:  # before its queue has it: a reader that takes it then marks it read
            with self._unread_changed:
                self._unread[output.request_id] = None
                self._unread_changed.notify_all()
        if stream or output.finished:
            try:
                sink(output)
            except Exception:
                logger.exception("output sink of %s failed", output.request_id)
