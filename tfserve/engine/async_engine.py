"""The asyncio face of the engine, for the server: `async for out in engine.generate(prompt_ids, params)`.

The engine steps on its own thread (`BatchingManager`); each output is handed to the event loop with
`call_soon_threadsafe`. Cancelling the consumer aborts the request, which frees its blocks before the
next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tfserve.engine.engine import Engine
from tfserve.engine.manager import BatchingManager
from tfserve.engine.request import RequestOutput
from tfserve.sampling_params import SamplingParams


class AsyncEngine:
    """Shares one `Engine` between coroutines."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.manager = BatchingManager(engine)

    def start(self) -> AsyncEngine:
        self.manager.start()
        return self

    def stop(self) -> None:
        self.manager.stop()

    async def generate(self, prompt: list[int] | str, params: SamplingParams | Any | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (one per new token, the last has `finish_reason`). Raises
        `ValueError` for bad input before anything is queued."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, output)

        request_id = self.manager.add_request(prompt, request_id, params, stream=True, sink=sink)
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.manager.abort(request_id)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting
