"""Online benchmark: streaming requests against any OpenAI-compatible server through the openai SDK."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tfserve.bench.metrics import RequestRecord


@dataclass(slots=True)
class OnlineConfig:
    """One online run."""

    base_url: str  # ends in /v1
    model: str
    max_tokens: int = 128
    concurrency: int | None = 32  # requests in flight at most; None: no cap
    request_rate: float | None = None  # Poisson arrivals per second; None: all at once (under the cap)
    endpoint: str = "chat"  # chat | completions
    api_key: str = "EMPTY"
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    seed: int = 0
    image_url: str | None = None  # an image (a data URL) sent with chat requests, before the prompt's text
    image_fraction: float = 1.0  # the share of requests that carry it, spread evenly over the run

    def with_image(self, index: int) -> bool:
        """Whether request `index` carries the image: `image_fraction` of them, evenly spaced."""
        if self.image_url is None:
            return False
        return int((index + 1) * self.image_fraction) > int(index * self.image_fraction)


async def run_online(config: OnlineConfig, prompts: list[str],
                     on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Send every prompt once; returns the records (in prompt order) and the run's wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=config.base_url, api_key=config.api_key, timeout=config.timeout_s,
                                max_retries=0)
    limit = asyncio.Semaphore(config.concurrency or len(prompts) or 1)
    extra_body = dict(config.extra_body)
    if config.ignore_eos:
        extra_body["ignore_eos"] = True
    rng = random.Random(config.seed)

    async def one(index: int, prompt: str) -> RequestRecord:
        async with limit:
            record = await _stream_one(client, config, prompt, extra_body, config.with_image(index))
        if on_done is not None:
            on_done(record)
        return record

    start = time.perf_counter()
    tasks = []
    for index, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(one(index, prompt)))
        if config.request_rate:
            await asyncio.sleep(rng.expovariate(config.request_rate))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    await client.close()
    return list(records), duration


async def _stream_one(client, config: OnlineConfig, prompt: str, extra_body: dict,
                      with_image: bool = False) -> RequestRecord:
    record = RequestRecord(ok=False)
    start = time.perf_counter()
    num_chunks = 0
    try:
        common = dict(model=config.model, max_tokens=config.max_tokens, temperature=0.0, stream=True,
                      stream_options={"include_usage": True}, extra_body=extra_body or None)
        if config.endpoint == "chat":
            content: str | list = prompt
            if with_image:
                content = [{"type": "image_url", "image_url": {"url": config.image_url}}, {"type": "text", "text": prompt}]
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": content}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            now = time.perf_counter() - start
            if chunk.usage is not None:
                record.prompt_tokens = chunk.usage.prompt_tokens or 0
                record.output_tokens = chunk.usage.completion_tokens or 0
            for choice in chunk.choices:
                text = choice.delta.content if config.endpoint == "chat" else choice.text
                if text:
                    if record.ttft_s is None:
                        record.ttft_s = now
                    record.token_times_s.append(now)
                    num_chunks += 1
        record.e2e_s = time.perf_counter() - start
        if not record.output_tokens:  # no usage from the server: one token per content chunk
            record.output_tokens = num_chunks
        record.ok = num_chunks > 0 or record.output_tokens > 0
        if not record.ok:
            record.error = "empty response"
    except Exception as exc:  # every failure is counted, never raised: the run goes on
        record.error = _describe(exc)
    return record


def _describe(exc: Exception) -> str:
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    status = getattr(exc, "status_code", None)
    return f"{status} {message}" if status else f"{type(exc).__name__}: {message}"
