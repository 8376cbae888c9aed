"""Engine replicas: N engines, each with its own KV cache, behind one front-end (`--data-parallel-size N`).

Replica 0 is the front-end's own engine (it also validates and tokenizes every request, as with one engine); the
others run in processes of their own (process_replica.py) or as Ray actors (ray_replicas.py). The router
(router.py) sends each request to the replica most likely to hold its prefix in cache; `ReplicatedEngine` gives
all of them the face of one AsyncEngine, and scales their number at run time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from tfserve.engine.async_engine import AsyncEngine
from tfserve.serving.autoscale import Autoscaler
from tfserve.serving.process_replica import ProcessReplica
from tfserve.serving.replica import Replica, ReplicaSpec, replica_stats, replica_threads
from tfserve.serving.router import Router

logger = logging.getLogger("tfserve.serving")

DEAD = 1 << 40  # the load the router sees for a replica that died: it never wins


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
        """Scale by `policy` (serving/autoscale.py) from the requests in flight, checked every `period_s`,
        until cancelled. A replica that fails to start is logged and the ones running go on."""
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
    if ray_address is not None:  # (Ray is an optional dependency: imported only where asked for)
        from tfserve.serving.ray_replicas import RayReplica

        return RayReplica(index, spec)
    return ProcessReplica(index, spec)


def start_replicas(spec: ReplicaSpec, local: Callable[[], Any], ray_address: str | None = None) -> ReplicatedEngine:
    """Start replicas 1..N-1 (each loads the model in its process, or as a Ray actor on the cluster at
    `ray_address` ("local": a cluster of this machine), while `local()` loads replica 0's engine here), and the
    engine over all of them."""
    import torch

    if ray_address is not None:
        from tfserve.serving.ray_replicas import connect

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
