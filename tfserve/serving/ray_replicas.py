"""Engine replicas as Ray actors (`tfserve serve --data-parallel-size N --ray [ADDRESS]`): Ray places each on a
node of the cluster with the CPUs it declares; the front-end sends it built requests and long-polls its outputs.

    ray start --head                     # the first machine
    ray start --address HEAD_IP:6379     # each other machine
    tfserve serve -dp 4 --ray auto       # on the head: replica 0 here, 3 actors wherever Ray has room
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import ray

from tfserve.serving.replica import (Replica, ReplicaSpec, gpus_per_actor, replica_stats, replica_threads,
                                    start_replica_engine)

logger = logging.getLogger("tfserve.serving")

POLL_S = 0.2  # a poll returns as soon as outputs are there, else after this


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ("auto": the one `ray start` runs here; "local": start one here). Call
    it on a thread that lives as long as the cluster is needed: Ray's local processes end with the thread that
    started them."""
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)


class ReplicaActor:
    """The Ray actor: an engine stepped by its BatchingManager; outputs wait in a queue for `poll`."""

    def __init__(self, spec: ReplicaSpec, index: int) -> None:
        self.manager = start_replica_engine(spec, index)
        self.engine = self.manager.engine
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()

    def ready(self) -> bool:
        """True once the engine is loaded (Ray runs no method before `__init__` has returned)."""
        return True

    def add(self, requests: list) -> None:
        """Run built requests (pickled without matcher and detokenizer: this engine makes them)."""
        self.manager.add_requests([self.engine.attach(request) for request in requests], stream=True,
                                  sink=self.outputs.put)

    def abort(self, request_id: str) -> None:
        """Abort a request this actor runs."""
        self.manager.abort(request_id)

    def poll(self, timeout: float) -> tuple[list, dict[str, float]]:
        """The outputs since the last poll (waiting up to `timeout` for the first), and the engine's counters."""
        outputs = []
        try:
            outputs.append(self.outputs.get(timeout=timeout))
            while True:
                outputs.append(self.outputs.get_nowait())
        except queue.Empty:
            pass
        return outputs, replica_stats(self.engine)

    def shutdown(self) -> None:
        """Stop the engine's manager and the engine."""
        self.manager.stop()
        self.engine.close()  # its ranks, where its model is split


class RayReplica(Replica):
    """A replica as a Ray actor, with the face of ProcessReplica."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        super().__init__()
        self.index = index
        actor_class = ray.remote(ReplicaActor).options(num_cpus=replica_threads(spec.num_replicas),
                                                       num_gpus=gpus_per_actor(spec.load_kwargs.get("device", "auto")),
                                                       max_concurrency=4, name=f"tfserve-replica{index}")
        self.actor: Any = actor_class.remote(spec, index)
        self._stopped = threading.Event()
        self._reader: threading.Thread | None = None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Return once the actor has loaded its engine; raise RuntimeError where it failed or Ray cannot place it."""
        try:
            ray.get(self.actor.ready.remote(), timeout=timeout)
        except Exception as exc:  # the actor failed to build its engine, or Ray could not place it
            raise RuntimeError(f"replica {self.index} failed to start on Ray: {exc}") from None
        self._reader = threading.Thread(target=self._read, name=f"tfserve-replica{self.index}-reader", daemon=True)
        self._reader.start()

    def _submit(self, requests: list) -> None:
        self.actor.add.remote(requests)

    def abort(self, request_id: str) -> None:
        """Abort a request sent to this actor."""
        self.actor.abort.remote(request_id)

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the actor's engine down (within `timeout`) and end the actor."""
        self._stopped.set()
        try:
            ray.get(self.actor.shutdown.remote(), timeout=timeout)
        except Exception:  # already gone
            pass
        ray.kill(self.actor)

    def _read(self) -> None:
        while not self._stopped.is_set():
            try:
                outputs, self.stats = ray.get(self.actor.poll.remote(POLL_S))
            except Exception as exc:  # the actor died (its node left, it ran out of memory)
                if not self._stopped.is_set():
                    self._fail_all(f"replica {self.index} (a Ray actor) failed: {exc}")
                return
            self._dispatch(outputs)
