"""Run the app until SIGINT/SIGTERM, then drain: refuse new requests (503), let in-flight ones finish for
up to `drain_timeout` seconds (a second signal cuts the wait short), abort the rest, and return (the CLI
exits 0)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from tfserve.server.app import json_errors
from tfserve.server.runtime.connections import quiet_accept_errors
from tfserve.server.runtime.state import READY, STATE, ServerState
from tfserve.server.runtime.threads import in_daemon_thread

if TYPE_CHECKING:
    from tfserve.engine.async_engine import AsyncEngine

logger = logging.getLogger("tfserve.server")


async def serve(app: web.Application, host: str, port: int, *, drain_timeout: float = 30.0,
                load: Callable[[], AsyncEngine] | None = None, on_ready: Callable[[], None] | None = None,
                stop_event: asyncio.Event | None = None, autoscale=None) -> bool:
    """Serve `app` on host:port. `load()` (run on a thread while /health answers 503) returns the
    started engine to serve; `on_ready()` runs once the model serves (the CLI's banner). `autoscale`: an
    AutoscalePolicy the engine's replicas follow while it serves. False when stopped before the model served."""
    state: ServerState = app[STATE]
    stop, hurry = stop_event or asyncio.Event(), asyncio.Event()
    state.request_stop = stop.set  # the engine failed for good: stop serving

    def on_signal() -> None:  # the first drains, a second stops waiting for the requests in flight
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    quiet_accept_errors(loop)  # out of open files: one line every few seconds, not a traceback per accept()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread, or not a Unix loop
            pass
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    json_errors(runner)
    mcp_started = asyncio.ensure_future(state.start_mcp())  # alongside the model's loading
    scaling = None
    try:
        await web.TCPSite(runner, host, port).start()
        if load is not None and not await _load(state, load, stop):
            return False
        if autoscale is not None:
            scaling = asyncio.ensure_future(state.async_engine.autoscale(autoscale))
        if on_ready is not None:
            on_ready()
        await stop.wait()
        await drain(state, drain_timeout, hurry)
        return True
    finally:
        if scaling is not None:
            scaling.cancel()
        state.stop()
        await runner.cleanup()
        mcp_started.cancel()
        await asyncio.gather(mcp_started, return_exceptions=True)
        await state.close_mcp()
        if state.telemetry is not None:
            state.telemetry.shutdown()


async def _load(state: ServerState, load: Callable[[], AsyncEngine], stop: asyncio.Event) -> bool:
    loading = asyncio.ensure_future(in_daemon_thread(load))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loading, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not loading.done():
        loading.cancel()
        return False
    engine = loading.result()
    if engine is not None:
        state.set_engine(engine)
    elif state.embeddings.alone:  # `--model` named an encoder: its embedding model serves, no chat model
        state.status = READY
    return True


async def drain(state: ServerState, timeout: float, hurry: asyncio.Event | None = None) -> int:
    """Stop accepting and wait for in-flight /v1 requests, at most `timeout` s or until `hurry` is set; abort
    what is left (its clients get a 503 or a stream error). Returns how many requests were still in flight at
    the deadline."""
    hurry = hurry or asyncio.Event()
    state.begin_drain()
    logger.info("draining: %d request(s) in flight, waiting up to %.0f s (Ctrl+C again to stop now)",
                state.num_active, timeout)
    deadline = time.monotonic() + timeout
    while state.num_active and time.monotonic() < deadline and not hurry.is_set():
        await asyncio.sleep(0.05)
    left = state.num_active
    if left:
        logger.warning("%s: aborting %d request(s) still in flight",
                       "stopping now" if hurry.is_set() else "drain timeout", left)
        state.stop()
        for _ in range(40):  # give their handlers a moment to answer
            if not state.num_active:
                break
            await asyncio.sleep(0.05)
    logger.info("drained; stopping")
    return left
