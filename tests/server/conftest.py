"""A real server on a free port over a tiny random-weight llama and a ChatML tokenizer trained in-process.

The server runs on its own event loop in a background thread; tests drive it with the `openai` SDK (sync)
and `http.client` for malformed requests. One engine serves the whole session; tests that need other server
settings (API key, limits, draining) start another app over the same engine.
"""

from __future__ import annotations


import pytest

from tiny import LiveServer, build_engine, build_tokenizer, make_state
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)


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


