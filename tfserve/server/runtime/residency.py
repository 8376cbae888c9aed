"""Models on demand: one model resident; a request naming another model of the store (or the local HF
cache) evicts the resident one once its in-flight requests finish, then loads the new one.

Every generating request holds a lease on the resident model from `acquire` until its response is done
(the `_observe` middleware releases it), so `state.engine` never changes under a request. While a swap is
pending no new lease is granted: requests for the model being loaded wait for it and share its outcome.

With an idle timeout (`--model-timeout`), the resident model is unloaded once no request has used it for that
long; it keeps its names ("asleep"), so the next request for it (or naming no model) loads it again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from tfserve.engine.client import AsyncEngineClient, EngineClient
from tfserve.errors import TfserveError
from tfserve.server.errors import ApiError, model_not_found
from tfserve.server.runtime.model_names import is_loadable_name, refuse_speech_model
from tfserve.server.runtime.request_limits import RequestLimits, swap_too_soon
from tfserve.server.runtime.threads import in_daemon_thread

if TYPE_CHECKING:
    from tfserve.server.runtime.embedding_models import EmbeddingModels

logger = logging.getLogger("tfserve.server")

LEASE = web.RequestKey("tfserve_model_lease", str)  # request[LEASE]: the model the request holds
Loader = Callable[[str], AsyncEngineClient]  # spec -> a started engine (runs on a thread)


class ModelHost(Protocol):
    """What residency reads and swaps of the server that holds it (`ServerState`, which passes itself in: this
    module never imports it)."""

    engine: EngineClient | None  # the resident engine, None while none is
    async_engine: AsyncEngineClient | None  # what streams its requests
    model_name: str | None
    model_spec: str | None  # what reloads the resident model
    model_aliases: set[str]
    force_model: bool
    limits: RequestLimits
    embeddings: EmbeddingModels

    @property
    def is_ready(self) -> bool: ...

    def check_available(self) -> None: ...

    def resolve_model_name(self, name: str | None) -> str: ...

    def set_engine(self, async_engine: AsyncEngineClient) -> None: ...

    def clear_engine(self) -> None: ...


class ModelResidency:
    """Which model is resident, and swapping it for another on request. Lives on the event loop's thread."""

    def __init__(self, state: ModelHost, load: Loader | None = None, idle_timeout_s: float | None = None) -> None:
        self.state = state
        self.load = load  # None: serve the loaded model only (as with --force-model)
        self.idle_timeout_s = idle_timeout_s  # unload the resident model after this long unused; None: never
        self.num_leases = 0  # requests using the resident model
        self.loading: str | None = None  # the model being swapped in
        self.asleep: str | None = None  # spec of the model unloaded for idleness, loaded again when asked for
        self._swap: asyncio.Future | None = None
        self._idle: asyncio.Event | None = None  # set when num_leases is 0; made on the loop
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_load_end: float | None = None  # time.monotonic() when the last on-demand load ended

    @property
    def on_demand(self) -> bool:
        """Whether a request may name another model, loaded in the resident one's place."""
        return self.load is not None and not self.state.force_model

    # -- leases -------------------------------------------------------------------------------------------

    async def acquire(self, request: web.Request, name: str | None) -> str:
        """Lease the model a request names (None: the resident one), loading it first when it is another
        model this server can load. Returns the served model's name."""
        state = self.state
        state.check_available()
        if name is None or name not in state.model_aliases:
            state.embeddings.refuse_chat(name)  # an embedding model (or none but them) named for text: a 400
        if name is not None and name not in state.model_aliases:
            refuse_speech_model(name)
        if not self.on_demand:
            name = state.resolve_model_name(name)  # 404 for any other model unless pinned
            return self._lease(request)
        while True:
            swap, target = self._swap, self.loading
            if swap is None:
                if state.engine is not None and (name is None or name in state.model_aliases):
                    return self._lease(request)
                if self.asleep is not None and (name is None or name in state.model_aliases):
                    swap, target = self._start_swap(self.asleep), name  # wake the idle-unloaded model
                elif name is None:
                    raise ApiError(503, "no model is loaded; name one in `model` (see GET /v1/models)",
                                   code="model_not_loaded")
                else:
                    self.check_loadable(name)
                    self._check_swap_interval(name)
                    swap, target = self._start_swap(name), name
            try:
                await asyncio.shield(swap)
            except ApiError:
                if target == name:
                    raise
            state.check_available()  # draining may have begun while we waited

    def _lease(self, request: web.Request) -> str:
        self.num_leases += 1
        self._idle_event().clear()
        self._cancel_idle_timer()
        request[LEASE] = self.state.model_name
        return self.state.model_name

    def release(self, request: web.Request) -> None:
        """End the request's lease, if it holds one (called once its response is done)."""
        if request.pop(LEASE, None) is not None:
            self.num_leases -= 1
            if not self.num_leases:
                self._idle_event().set()
                self.arm_idle_timer()

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if not self.num_leases:
                self._idle.set()
        return self._idle

    # -- idle timeout -------------------------------------------------------------------------------------

    def arm_idle_timer(self) -> None:
        """(Re)start the idle countdown of the resident model, when an idle timeout is set and no request uses
        it. Called on the loop; a call with no running loop (a state built outside a server) does nothing."""
        self._cancel_idle_timer()
        if not self.idle_timeout_s or not self.on_demand or self.num_leases or self.state.engine is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._idle_timer = loop.call_later(self.idle_timeout_s, self._on_idle_timeout)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _on_idle_timeout(self) -> None:
        self._idle_timer = None
        state = self.state
        if self.num_leases or self._swap is not None or state.engine is None or not state.is_ready:
            return
        self._swap = asyncio.ensure_future(self._sleep())  # requests arriving meanwhile wait, then reload it
        self._swap.add_done_callback(self._swap_done)

    async def _sleep(self) -> None:
        state = self.state
        name, aliases = state.model_name, state.model_aliases
        logger.info("unloading %s after %.0f s without requests; the next request loads it again", name,
                    self.idle_timeout_s)
        self.asleep = state.model_spec
        await self.unload()
        state.model_name, state.model_aliases = name, aliases  # still listed and named: asleep, not gone

    # -- what can be served -------------------------------------------------------------------------------

    def check_loadable(self, name: str) -> None:
        """404 model_not_found unless `name` is a store model or a hub id in the local HF cache. A store model that
        cannot load says why; any other name gets the one generic 404, whatever lies on the server's disk."""
        from tfserve.errors import ModelNotFoundError
        from tfserve.models import store
        from tfserve.models.loading import resolve_model

        why = "names must be store models or hub ids, not paths"
        if is_loadable_name(name, chat=True):
            if store.is_store_name(name) and _is_dir(store.model_path(name)):
                problem = store.folder_problem(store.model_path(name))
                if problem is not None:  # refused before anything is evicted for it
                    raise ApiError(404, f"store model {name!r} cannot load: {problem}", param="model",
                                   code="model_not_found")
            try:
                resolved = resolve_model(name)
            except ModelNotFoundError as exc:
                why = str(exc)
            else:
                if resolved.kind in ("store", "hf_cache") or (resolved.kind == "gguf" and _kept(resolved.path)):
                    return
                why = f"a {resolved.kind} outside the store and the HF cache"
        logger.debug("model %r cannot be loaded on demand: %s", name, why)  # the operator's detail, not the client's
        raise model_not_found(name)

    def other_models(self) -> list[str]:
        """Names of the store's complete models other than the resident one (empty unless on demand)."""
        if not self.on_demand:
            return []
        from tfserve.models import store

        return [name for name in store.stored_names()
                if name not in self.state.model_aliases and store.folder_problem(store.model_path(name)) is None]

    # -- swapping -----------------------------------------------------------------------------------------

    def _check_swap_interval(self, name: str) -> None:
        """429 when the last swap ended less than --model-swap-interval ago: a client alternating two model
        names would otherwise keep the server loading (40 s a swap) and serving no one."""
        interval_s = self.state.limits.model_swap_interval_s
        if interval_s and self._last_load_end is not None:
            waited_s = time.monotonic() - self._last_load_end
            if waited_s < interval_s:
                raise swap_too_soon(name, interval_s, interval_s - waited_s)

    def _start_swap(self, name: str) -> asyncio.Future:
        self.loading = name
        self._swap = asyncio.ensure_future(self._swap_to(name))
        self._swap.add_done_callback(self._swap_done)
        return self._swap

    def _swap_done(self, swap: asyncio.Future) -> None:
        self._swap, self.loading = None, None
        if not swap.cancelled():
            swap.exception()  # retrieved here: a swap nobody waits for any more must not warn

    async def _swap_to(self, name: str) -> None:
        state = self.state
        previous = state.model_spec
        await self._idle_event().wait()
        state.check_available()  # draining began while the resident model finished its requests
        if state.engine is not None:
            logger.info("evicting %s to load %s", state.model_name, name)
            await self.unload()
        started = time.perf_counter()
        try:
            await self._load(name)
        except ApiError:  # draining
            raise
        except Exception as exc:
            logger.exception("loading %s failed", name)
            if previous is not None:
                await self._restore(previous)
            status = 503 if _is_out_of_memory(exc) else 500
            message = str(exc) if isinstance(exc, TfserveError) else f"{type(exc).__name__}: {exc}"
            raise ApiError(status, f"loading model {name!r} failed: {message}", param="model",
                           code="model_load_failed") from None
        logger.info("loaded %s in %.1f s", name, time.perf_counter() - started)

    async def _load(self, spec: str) -> None:
        try:
            async_engine = await in_daemon_thread(self.load, spec)
        finally:  # a failed load counts too: it cost as much
            self._last_load_end = time.monotonic()
        try:
            self.state.check_available()  # the server began draining while we loaded
        except ApiError:
            async_engine.stop()
            raise
        self.asleep = None
        self.state.set_engine(async_engine)
        self.state.model_aliases.add(spec)

    async def _restore(self, spec: str) -> None:
        try:
            await self._load(spec)
        except Exception:
            logger.exception("reloading %s failed too; no model is loaded", spec)

    async def unload(self) -> None:
        """Stop the resident engine (no lease is held) and free its memory."""
        state, async_engine = self.state, self.state.async_engine
        state.clear_engine()
        if async_engine is not None:
            await asyncio.to_thread(async_engine.stop)
        del async_engine
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long for the filesystem names no folder either
        return False


def _kept(path: Path) -> bool:
    """Whether a .gguf file a request named (`NAME:FILE.gguf`) lies in the store or the local HF cache: a folder
    of the server's working directory with a store model's name is no business of a client's."""
    from huggingface_hub import constants

    from tfserve.models import store

    roots = (store.models_dir(), Path(constants.HF_HUB_CACHE))
    return any(path.is_relative_to(root.expanduser().resolve()) for root in roots)


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()

