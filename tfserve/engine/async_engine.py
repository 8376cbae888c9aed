"""The asyncio face of the engine, for the server: `async for out in engine.generate(prompt_ids, params)`, or
`engine.generate_request(request)` for a request already built (and validated) by `Engine.make_requests`.

The engine steps on its own thread (`BatchingManager`); each output is handed to the event loop with
`call_soon_threadsafe`. Cancelling the consumer aborts the request, which frees its blocks before the
next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from tfserve.engine.core import Engine
from tfserve.engine.manager import BatchingManager
from tfserve.engine.request import Request, RequestOutput
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
        self.engine.close()  # a tensor-parallel engine's worker ranks

    async def generate(self, prompt: list[int] | str, params: SamplingParams | Any | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (one per new token, the last has `finish_reason`). Raises
        `ValueError` for bad input (or `n` other than 1) before anything is queued."""
        requests = self.engine.make_requests(prompt, params, request_id)
        if len(requests) != 1:
            raise ValueError("n must be 1 here; stream each of Engine.make_requests' requests with generate_request")
        async with aclosing(self.generate_request(requests[0])) as outputs:  # closed at once when left early
            async for output in outputs:
                yield output

    async def generate_request(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of a request built by `Engine.make_requests`, queued as it is (not validated
        again). Leaving the iteration before the last output aborts it and frees its KV blocks."""
        async for output in self._stream(self.manager, request):
            yield output

    async def _stream(self, manager, request: Request) -> AsyncIterator[RequestOutput]:
        """`request`'s outputs from `manager` (this engine's, or a replica's: tfserve.serving.replicas)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, output)

        (request_id,) = manager.add_requests([request], stream=True, sink=sink)
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                manager.abort(request_id)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting
