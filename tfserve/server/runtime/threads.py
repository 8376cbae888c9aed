"""Work the event loop hands to a thread of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tfserve.engine.threads import start_daemon


async def in_daemon_thread(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` on a daemon thread of its own, which ends with it: a signal during a long model load can still
    end the process, and torch work there leaves no OpenMP workers behind (`tfserve.engine.threads`)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as error:  # handed to the loop, raised there
            result, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop has closed (the server stopped during a load): no one waits for it
            pass

    start_daemon(target, "tfserve-load")
    return await future
