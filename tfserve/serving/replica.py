"""One engine replica, wherever it runs: what it loads (`ReplicaSpec`), the face the front-end drives
(`Replica`: a BatchingManager's `add_requests` and `abort`), and what a replica's process or Ray actor runs
(`start_replica_engine`, on its share of the machine). Both kinds of replica (process_replica.py, ray_replicas.py)
build on this module and on nothing else of each other."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("tfserve.serving")


@dataclass
class ReplicaSpec:
    """What a replica process loads: the model, its load options and the engine's config."""

    model: str
    load_kwargs: dict[str, Any]
    config: Any
    num_replicas: int


class Replica:
    """A replica elsewhere, with the face of a BatchingManager: `add_requests` (streaming into a sink) and
    `abort`, from any thread; outputs reach their sinks on the replica's reader thread."""

    index: int

    def __init__(self) -> None:
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self.error: str | None = None
        self.stats: dict[str, float] = {}  # the replica's engine counters, as of its last report

    def add_requests(self, requests: list, stream: bool = True, sink: Callable | None = None) -> list[str]:
        """Send `requests` to the replica; their outputs go to `sink` (a dead replica fails them at once)."""
        if self.error is not None:  # a dead replica answers at once (the router avoids it, but a race may not)
            for request in requests:
                sink(failed_output(request.request_id, self.error))
            return [request.request_id for request in requests]
        for request in requests:
            self._sinks[request.request_id] = sink
        self._submit(requests)
        return [request.request_id for request in requests]

    def abort(self, request_id: str) -> None:
        """Abort a request sent to the replica."""
        raise NotImplementedError

    def wait_ready(self, timeout: float | None = None) -> None:
        """Return once the replica's engine is loaded; raise RuntimeError where it failed to start."""
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        """End the replica, within about `timeout` seconds."""
        raise NotImplementedError

    def _submit(self, requests: list) -> None:
        raise NotImplementedError

    def _dispatch(self, outputs: list) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._sinks.pop(output.request_id, None)
            if sink is not None:
                sink(output)

    def _fail_all(self, message: str) -> None:
        self.error = self.error or message
        for request_id, sink in list(self._sinks.items()):
            sink(failed_output(request_id, self.error))
        self._sinks.clear()

    def _died(self, message: str) -> None:
        """The replica is gone for good: said once in the log, its requests failed, its gauges zeroed (it runs
        nothing now); the router no longer picks it (`error` set) until `scale` starts another in its place."""
        if self.error is None:
            logger.error("%s: its requests fail and it takes no new ones (POST /admin/replicas starts another)",
                         message)
        self._fail_all(message)
        self.stats = {**self.stats, "num_running": 0, "num_waiting": 0, "kv_cache_blocks_used": 0}


def failed_output(request_id: str, message: str):
    """The last output of a request its replica could not run: finish reason "error", with `message`."""
    from tfserve.engine.request import RequestOutput

    return RequestOutput(request_id, [], [], "", finish_reason="error", error=message)


def start_replica_engine(spec: ReplicaSpec, index: int):
    """Replica `index`'s engine on its share of the cores and its GPU (`replica_device`), stepped by a started
    BatchingManager (returned)."""
    import torch

    from tfserve.engine.engine import Engine
    from tfserve.engine.manager import BatchingManager

    torch.set_num_threads(replica_threads(spec.num_replicas))
    load_kwargs = dict(spec.load_kwargs)
    load_kwargs["device"] = replica_device(load_kwargs.get("device", "auto"), index, torch.cuda.device_count())
    return BatchingManager(Engine.from_pretrained(spec.model, spec.config, **load_kwargs)).start()


def replica_device(device: str, index: int, num_gpus: int) -> str:
    """Where replica `index` loads its model: on a machine with `num_gpus` GPUs, GPU `index` mod their number
    where the device is left to tfserve (auto, cuda), so N replicas on N GPUs get one each (a Ray actor sees the
    one GPU it was given as its only one); an explicit cuda:N or cpu as given."""
    if device not in ("auto", "cuda") or num_gpus == 0:
        return device
    return f"cuda:{index % num_gpus}"


def gpus_per_actor(device: str) -> int:
    """GPUs a replica asks Ray for: one where its model goes to CUDA (cuda, cuda:N, or auto on a front-end
    that has a GPU), so that Ray places each replica on a GPU of its own; none for CPU replicas."""
    if device.startswith("cuda"):
        return 1
    if device == "auto":
        import torch

        return int(torch.cuda.is_available())
    return 0


def replica_threads(num_replicas: int) -> int:
    """Threads each replica runs torch on: the machine's cores shared among them."""
    return max(1, (os.cpu_count() or 1) // num_replicas)


def replica_stats(engine) -> dict[str, float]:
    """The counters /metrics shows for a replica (`EngineStats.replica_counters`)."""
    return engine.stats().replica_counters()
