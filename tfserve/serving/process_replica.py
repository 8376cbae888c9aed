"""A replica in a process of its own on this machine (`--data-parallel-size N`): an Engine stepped by a
BatchingManager (`replica_main`). A request built by `Engine.make_requests` goes down a pipe to it (without its
grammar matcher and detokenizer, which the replica's engine makes: `Engine.attach`), and its outputs come back
up the same pipe. Sends go through a thread of each replica's, so a replica that stops reading (hung, stopped)
never blocks the event loop."""

from __future__ import annotations

import multiprocessing
import queue
import sys
import threading

from tfserve.engine.parallel.workers import end_process, exit_reason
from tfserve.serving.replica import Replica, ReplicaSpec, replica_stats, start_replica_engine

STATS_INTERVAL_S = 1.0  # how often a replica process reports its counters


class ProcessReplica(Replica):
    """An engine in a process of its own on this machine, fed down a pipe."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        super().__init__()
        context = multiprocessing.get_context("spawn")
        self.index = index
        self._conn, child = context.Pipe()
        # (a replica whose model is split starts its ranks' processes itself, which a daemonic one may not)
        self.process = context.Process(target=replica_main, args=(spec, child, index), name=f"tfserve-replica{index}",
                                       daemon=getattr(spec.config, "tensor_parallel_size", 1) == 1)
        self.process.start()
        child.close()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # what the sender thread writes down the pipe
        self._stopping = False  # stop() asked for its end: not a death to report
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"tfserve-replica{index}-reader", daemon=True)
        self._reader.start()
        threading.Thread(target=self._send_loop, name=f"tfserve-replica{index}-sender", daemon=True).start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Return once the process has loaded its engine; raise RuntimeError where it failed or took too long."""
        if not self._ready.wait(timeout) or self.error is not None:
            raise RuntimeError(f"replica {self.index} failed to start: {self.error or 'timed out'}")

    def _submit(self, requests: list) -> None:
        self._send(("add", requests))

    def abort(self, request_id: str) -> None:
        """Abort a request sent to this replica."""
        self._send(("abort", request_id))

    def stop(self, timeout: float = 20.0) -> None:
        """Ask the replica to stop; past `timeout` (longer than its own wait for its ranks) it is ended."""
        self._stopping = True
        self._send(("stop", None))
        end_process(self.process, timeout)

    def _send(self, message: tuple) -> None:
        """Queue `message` for the pipe: it never blocks the caller (the event loop), whatever the replica does."""
        self._outbox.put(message)

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):  # the process ended: the reader tells
                return
            if message[0] == "stop":
                return

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):  # the process ended: what it was running fails
                if not self._stopping:  # (stop() reaps it: two threads waiting on one child lose its exit code)
                    self.process.join(5)  # (reaped: its exit code, not None)
                    self._died(f"replica {self.index} exited ({exit_reason(self.process.exitcode)})")
                self._fail_all(f"replica {self.index} stopped")
                self._ready.set()
                return
            if kind == "out":
                self._dispatch(payload)
            elif kind == "stats":
                self.stats = payload
            elif kind == "ready":
                self._ready.set()
            elif kind == "error":  # failed to start, or its engine failed for good (a dead tensor-parallel rank)
                if self._ready.is_set():
                    self._died(payload)
                self.error = payload
                self._ready.set()


def replica_main(spec: ReplicaSpec, conn, index: int) -> None:
    """A replica process: an engine and its manager; requests and aborts come down `conn`, outputs go up it."""
    try:
        _serve_replica(spec, conn, index)
    except KeyboardInterrupt:
        sys.exit(1)
    except Exception as exc:  # said once to the front-end, which reports it
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)


def _serve_replica(spec: ReplicaSpec, conn, index: int) -> None:
    manager = start_replica_engine(spec, index)
    engine = manager.engine
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    # the engine failed for good (a dead tensor-parallel rank): the front-end marks this replica dead at once
    manager.on_failure = lambda failure: send(("error", f"replica {index}: the engine failed: {failure}"))

    def sink(output) -> None:
        send(("out", [output]))

    send(("ready", None))
    send(("stats", replica_stats(engine)))
    stopped = threading.Event()

    def report() -> None:  # the counters, live for /metrics (len() reads: safe beside the engine thread)
        while not stopped.wait(STATS_INTERVAL_S):
            send(("stats", replica_stats(engine)))

    threading.Thread(target=report, name="tfserve-replica-stats", daemon=True).start()
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:
                break
            if kind == "add":  # (a request pickled without its matcher and detokenizer: this engine makes them)
                manager.add_requests([engine.attach(request) for request in payload], stream=True, sink=sink)
            elif kind == "abort":
                manager.abort(payload)
            else:
                break
    finally:
        stopped.set()
        manager.stop()
        engine.close()  # its ranks, where its model is split
