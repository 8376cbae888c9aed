"""A real server on a free port over a tiny random-weight llama and a ChatML tokenizer trained in-process.

The server runs on its own event loop in a background thread; tests drive it with the `openai` SDK (sync)
and `http.client` for malformed requests. One engine serves the whole session; tests that need other server
settings (API key, limits, draining) start another app over the same engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import asyncio
import json

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared `tiny` helpers
from tiny import MODEL_NAME, LiveServer, build_llama, build_tokenizer  # noqa: E402,F401  (tests import them from here)


def build_engine(tokenizer, **kwargs):
    from tfserve import Engine

    kwargs = {"block_size": 16, "num_blocks": 1024, "max_num_seqs": 64, "max_batch_tokens": 1024, **kwargs}
    return Engine(build_llama(tokenizer), tokenizer, **kwargs)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from threads on a busy 2-core machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def async_engine(tokenizer):
    from tfserve.engine.async_engine import AsyncEngine

    engine = build_engine(tokenizer)
    async_engine = AsyncEngine(engine).start()
    yield async_engine
    async_engine.stop()


@pytest.fixture(scope="session")
def engine(async_engine):
    return async_engine.engine


def make_state(async_engine, **kwargs):
    from tfserve.server.state import ServerState

    state = ServerState(**kwargs)
    state.set_engine(async_engine.engine, async_engine, MODEL_NAME, path=f"/models/{MODEL_NAME}")
    return state


@pytest.fixture(scope="session")
def server(async_engine):
    live = LiveServer(make_state(async_engine))
    yield live
    live.close()


@pytest.fixture
def start_server(async_engine):
    """`start_server(state_kwargs=..., **app_kwargs)`: another app over the shared engine, closed after the test."""
    started = []

    def start(state=None, state_kwargs: dict | None = None, **app_kwargs) -> LiveServer:
        live = LiveServer(state or make_state(async_engine, **(state_kwargs or {})), **app_kwargs)
        started.append(live)
        return live

    yield start
    for live in started:
        live.close()


def wait_for_free_blocks(engine, timeout: float = 5.0) -> bool:
    """True once every KV block is free again (aborts land a step later)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.block_pool.num_free_blocks == engine.block_pool.num_blocks and not engine.has_unfinished:
            return True
        time.sleep(0.02)
    return False


def scripted_generate(pieces: list[str], finish_reason: str = "stop", stop_token_id: int | None = 2,
                      fail_with: BaseException | None = None, error: str | None = None):
    """A stand-in for `ServerState.generate` that "generates" `pieces`, one token each (a scripted model)."""
    from tfserve.engine.request import RequestMetrics, RequestOutput

    def generate(prompt_ids, params):
        async def outputs():
            if fail_with is not None:
                raise fail_with
            tokens, text = [], ""
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                tokens.append(10 + i)
                text += piece
                yield RequestOutput(
                    request_id="scripted", prompt_token_ids=list(prompt_ids), generated_tokens=list(tokens),
                    text=text, finish_reason=finish_reason if last else None, delta_text=piece,
                    delta_tokens=[10 + i], error=error if last else None,
                    stop_reason=stop_token_id if last and finish_reason == "stop" else None,
                    metrics=RequestMetrics(arrival_time=0.0, ttft_s=0.001, e2e_s=0.002) if last else None)
                await asyncio.sleep(0)

        return outputs()

    return generate


def sse_events(raw: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" kept as a string)."""
    events = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
