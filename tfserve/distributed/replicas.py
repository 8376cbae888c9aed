"""Engine replicas: N engines, each with its own KV cache, behind one front-end (`--data-parallel-size N`).

Replica 0 is the front-end's own engine (it also validates and tokenizes every request, as with one engine); the
others run in processes of their own (`replica_main`), each an Engine stepped by a BatchingManager. A request
built by `Engine.make_requests` goes down a pipe to its replica (without its grammar matcher and detokenizer, which
the replica's engine makes: `Engine.attach`), and its outputs come back up the same pipe. Sends go through a thread
of each replica's, so a replica that stops reading (hung, stopped) never blocks the event loop. The router sends
a request to the replica most likely to hold its prefix in cache (the last one that served the same first blocks
of a prompt) unless that one is much busier than the least busy, and a prompt never seen goes to the least busy.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tfserve.distributed.workers import end_process, exit_reason
from tfserve.engine.async_engine import AsyncEngine

logger = logging.getLogger("tfserve.distributed")

PREFIX_BLOCKS = 4  # the first blocks of a prompt that name its prefix for routing
MAX_REMEMBERED = 65536  # prefixes the router remembers (least recently routed forgotten first)
DEAD = 1 << 40  # the load the router sees for a replica that died: it never wins
STATS_INTERVAL_S = 1.0  # how often a replica process reports its counters


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
        if self.error is not None:  # a dead replica answers at once (the router avoids it, but a race may not)
            for request in requests:
                sink(_failed(request.request_id, self.error))
            return [request.request_id for request in requests]
        for request in requests:
            self._sinks[request.request_id] = sink
        self._submit(requests)
        return [request.request_id for request in requests]

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
            sink(_failed(request_id, self.error))
        self._sinks.clear()

    def _died(self, message: str) -> None:
        """The replica is gone for good: said once in the log, its requests failed, its gauges zeroed (it runs
        nothing now); the router no longer picks it (`error` set) until `scale` starts another in its place."""
        if self.error is None:
            logger.error("%s: its requests fail and it takes no new ones (POST /admin/replicas starts another)",
                         message)
        self._fail_all(message)
        self.stats = {**self.stats, "num_running": 0, "num_waiting": 0, "kv_cache_blocks_used": 0}


class RemoteReplica(Replica):
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
        if not self._ready.wait(timeout) or self.error is not None:
            raise RuntimeError(f"replica {self.index} failed to start: {self.error or 'timed out'}")

    def _submit(self, requests: list) -> None:
        self._send(("add", requests))

    def abort(self, request_id: str) -> None:
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
                self.process.join(5)  # (reaped: its exit code, not None)
                if not self._stopping:
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


def _failed(request_id: str, message: str):
    from tfserve.engine.request import RequestOutput

    return RequestOutput(request_id, [], [], "", finish_reason="error", error=message)


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
    """The counters /metrics shows for a replica."""
    pool = engine.block_pool
    return {"num_running": engine.num_running, "num_waiting": engine.num_waiting,
            "kv_cache_blocks_used": pool.num_used_blocks, "kv_cache_blocks_total": pool.num_blocks,
            "prefix_cache_hit_rate": pool.stats.hit_rate,
            "prefix_cache_queried_tokens": pool.stats.num_queried_tokens,
            "prefix_cache_hit_tokens": pool.stats.num_hit_tokens,
            "num_preemptions": engine.scheduler.num_preemptions}


class Router:
    """Picks the replica for a prompt: the one that last served its first blocks, unless it is much busier than
    the least busy (more than `ratio` times its requests in flight plus `slack`); else the least busy (equals
    taken in turn)."""

    def __init__(self, block_size: int, slack: int = 2, ratio: float = 1.5) -> None:
        self.block_size, self.slack, self.ratio = block_size, slack, ratio
        self._last: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica
        self._turn = 0  # where the search for the least busy starts: equals take turns

    def pick(self, prompt_token_ids: list[int], loads: list[int]) -> int:
        """The replica for a prompt among len(loads) (the count may change between calls: a prefix last served
        by a replica since removed counts as unseen)."""
        keys = self._prefix_keys(prompt_token_ids)
        count = len(loads)
        order = [(self._turn + i) % count for i in range(count)]
        least = min(order, key=lambda i: loads[i])
        choice = least
        for key in reversed(keys):  # the longest prefix seen before
            holder = self._last.get(key)
            if holder is not None and holder < count:
                if loads[holder] <= loads[least] * self.ratio + self.slack:
                    choice = holder
                break
        if choice == least:
            self._turn = (least + 1) % count
        for key in keys:
            self._last[key] = choice
            self._last.move_to_end(key)
        while len(self._last) > MAX_REMEMBERED:
            self._last.popitem(last=False)
        return choice

    def _prefix_keys(self, tokens: list[int]) -> list[int]:
        """Chained hashes of the prompt's first full blocks (at least one key, for prompts under a block)."""
        size = self.block_size
        num_blocks = min(len(tokens) // size, PREFIX_BLOCKS)
        if num_blocks == 0:
            return [hash(tuple(tokens))]
        keys, key = [], 0
        for b in range(num_blocks):
            key = hash((key, tuple(tokens[b * size:(b + 1) * size])))
            keys.append(key)
        return keys


class ReplicatedEngine(AsyncEngine):
    """An AsyncEngine over `engine` (replica 0, in this process) and the remote replicas: every request is
    validated by replica 0's engine as usual, then routed. `scale(n)` adds replicas (started as the first were,
    from `spec`) or retires the last ones (no new requests, then stopped once their requests finish)."""

    def __init__(self, engine, remotes: list[Replica], spec: ReplicaSpec | None = None,
                 ray_address: str | None = None) -> None:
        super().__init__(engine)
        self.remotes = remotes
        self.spec, self.ray_address = spec, ray_address
        self.router = Router(engine.config.block_size)
        self.num_routed = [0] * (1 + len(remotes))
        self.in_flight = [0] * (1 + len(remotes))  # requests routed and not finished, on the event loop's count
        self.retiring: set[int] = set()  # replicas that take no new requests (being scaled away)
        self.starting = 0  # replicas being started by scale()
        self.policy = None  # the AutoscalePolicy autoscale() follows, while it runs
        self._scaling: asyncio.Lock | None = None

    def states(self) -> list[str]:
        """Each replica's state: ready, dead (its process or actor failed) or retiring (being scaled away)."""
        dead = [False] + [remote.error is not None for remote in self.remotes]
        return ["retiring" if index in self.retiring else "dead" if gone else "ready"
                for index, gone in enumerate(dead)]

    @property
    def loads(self) -> list[int]:
        """Requests in flight on each replica, as the router weighs them (a dead or retiring one never wins)."""
        return [n if state == "ready" else DEAD for n, state in zip(self.in_flight, self.states())]

    def describe(self) -> dict[str, Any]:
        """The replicas as `GET /admin/replicas` shows them."""
        replicas = [{"index": index, "state": state, "num_in_flight": self.in_flight[index],
                     "num_routed": self.num_routed[index]} for index, state in enumerate(self.states())]
        policy = None if self.policy is None else asdict(self.policy)
        return {"num_replicas": len(replicas), "num_starting": self.starting, "autoscale": policy,
                "replicas": replicas}

    async def scale(self, num_replicas: int, drain_timeout: float = 600.0) -> dict[str, Any]:
        """Run `num_replicas` replicas: start the missing ones (each loads the model, as at start-up; routed to
        once ready), or retire the last ones (they take no new requests and stop when theirs are done, or after
        `drain_timeout` seconds, which fails what is left). One change at a time; returns `describe()`."""
        if num_replicas < 1:
            raise ValueError("num_replicas must be at least 1 (replica 0 is the server's own engine)")
        if self.spec is None:
            raise ValueError("these replicas cannot be scaled (no start-up spec)")
        self._scaling = self._scaling or asyncio.Lock()
        async with self._scaling:
            await self._replace_dead(num_replicas)
            current = 1 + len(self.remotes)
            if num_replicas > current:
                await self._add(num_replicas - current)
            elif num_replicas < current:
                await self._retire(list(range(num_replicas, current)), drain_timeout)
        return self.describe()

    async def autoscale(self, policy, period_s: float = 1.0) -> None:
        """Scale by `policy` (distributed/autoscale.py) from the requests in flight, checked every `period_s`,
        until cancelled. A replica that fails to start is logged and the ones running go on."""
        from tfserve.distributed.autoscale import Autoscaler

        rule = Autoscaler(policy)
        loop = asyncio.get_running_loop()
        self.policy = policy
        try:
            while True:
                await asyncio.sleep(period_s)
                num_in_flight, num_replicas = sum(self.in_flight), len(self.in_flight)
                target = rule.decide(loop.time(), num_in_flight, num_replicas)
                if target is None:
                    continue
                logger.info("autoscaling: %d requests in flight, %d -> %d replicas", num_in_flight, num_replicas,
                            target)
                try:
                    await self.scale(target)
                except Exception as exc:  # (scale fails only in starting a replica)
                    logger.warning("autoscaling to %d replicas failed: %s", target, exc)
        finally:
            self.policy = None

    async def _replace_dead(self, num_replicas: int) -> None:
        """Start a replica in the place of each dead one that stays (index < `num_replicas`)."""
        for position, remote in enumerate(self.remotes):
            if remote.error is None or remote.index >= num_replicas:
                continue
            await asyncio.to_thread(remote.stop, 0)
            self.starting += 1
            try:
                self.remotes[position] = await asyncio.to_thread(self._start_remote, remote.index)
            finally:
                self.starting -= 1
            self.in_flight[remote.index] = 0
            logger.info("replica %d is serving again (a new one in the place of the dead one)", remote.index)

    async def _add(self, count: int) -> None:
        self.starting = count
        try:
            for _ in range(count):
                index = 1 + len(self.remotes)
                remote = await asyncio.to_thread(self._start_remote, index)
                self.remotes.append(remote)
                self.in_flight.append(0)
                self.num_routed.append(0)
                self.starting -= 1
                logger.info("replica %d is serving", index)
        finally:
            self.starting = 0

    def _start_remote(self, index: int) -> Replica:
        remote = new_replica(index, self.spec, self.ray_address)
        try:
            remote.wait_ready(timeout=600)
        except BaseException:
            remote.stop(timeout=0)
            raise
        return remote

    async def _retire(self, indices: list[int], drain_timeout: float) -> None:
        self.retiring.update(indices)
        try:
            deadline = asyncio.get_running_loop().time() + drain_timeout
            while any(self.in_flight[i] for i in indices) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            # stopped before they leave the lists: a replica no longer listed is one that has stopped
            for remote in self.remotes[indices[0] - 1:]:  # what still runs on them (past the timeout) fails
                remote._fail_all(f"replica {remote.index} was scaled away")
                await asyncio.to_thread(remote.stop)
                logger.info("replica %d stopped", remote.index)
            del self.remotes[indices[0] - 1:], self.in_flight[indices[0]:], self.num_routed[indices[0]:]
        finally:
            self.retiring.difference_update(indices)

    async def generate_request(self, request):
        index = self.router.pick(request.prompt_token_ids, self.loads)
        replica = self.manager if index == 0 else self.remotes[index - 1]
        self.num_routed[index] += 1
        self.in_flight[index] += 1
        try:
            async for output in self._stream(replica, request):
                yield output
        finally:
            if index < len(self.in_flight):  # (a replica retired past its drain timeout is gone from the lists)
                self.in_flight[index] -= 1

    def replica_stats(self) -> list[dict[str, float]]:
        """Each replica's counters (a remote one's as of its last report), and requests routed to it."""
        stats = [replica_stats(self.engine)] + [dict(remote.stats) for remote in self.remotes]
        for index, entry in enumerate(stats):
            entry["num_routed"] = self.num_routed[index]
            entry["num_in_flight"] = self.in_flight[index]
        return stats

    def stop(self) -> None:
        super().stop()
        for remote in self.remotes:
            remote.stop()


def new_replica(index: int, spec: ReplicaSpec, ray_address: str | None = None) -> Replica:
    """Replica `index` starting: a process of this machine, or a Ray actor where `ray_address` is given (the
    cluster already connected)."""
    if ray_address is not None:
        from tfserve.distributed.ray_replicas import RayReplica

        return RayReplica(index, spec)
    return RemoteReplica(index, spec)


def start_replicas(spec: ReplicaSpec, local: Callable[[], Any], ray_address: str | None = None) -> ReplicatedEngine:
    """Start replicas 1..N-1 (each loads the model in its process, or as a Ray actor on the cluster at
    `ray_address` ("local": a cluster of this machine), while `local()` loads replica 0's engine here), and the
    engine over all of them."""
    import torch

    if ray_address is not None:
        from tfserve.distributed.ray_replicas import connect

        connect(ray_address)
    remotes = [new_replica(index, spec, ray_address) for index in range(1, spec.num_replicas)]
    try:
        torch.set_num_threads(replica_threads(spec.num_replicas))
        engine = local()
        for remote in remotes:
            remote.wait_ready(timeout=600)
    except BaseException:
        for remote in remotes:
            remote.stop(timeout=0)
        raise
    return ReplicatedEngine(engine, remotes, spec, ray_address).start()
