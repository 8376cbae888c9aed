"""A live tiny server (random-weight llama, ChatML tokenizer trained in-process) for the chat client, and
helpers that drive the REPL with prompt-toolkit's pipe input and capture what rich prints.

The model and server builders come from tests/tiny.py, shared with the server tests."""

from __future__ import annotations


import io

import pytest
from rich.console import Console

from tiny import GREEDY, LiveServer, build_llama, build_tokenizer
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)



@pytest.fixture(autouse=True)
def _home(tfserve_home):
    """Chat history goes to a fresh $TFSERVE_HOME."""
    return tfserve_home


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def async_engine(tokenizer):
    from tfserve import Engine
    from tfserve.engine.async_engine import AsyncEngine

    engine = Engine(build_llama(tokenizer), tokenizer, block_size=16, num_blocks=256, max_batch_tokens=1024)
    async_engine = AsyncEngine(engine).start()
    yield async_engine
    async_engine.stop()


@pytest.fixture(scope="session")
def engine(async_engine):
    return async_engine.engine


@pytest.fixture(scope="session")
def server(async_engine):
    live = LiveServer.for_engine(async_engine)
    yield live
    live.close()


@pytest.fixture
def console() -> Console:
    """What the chat prints, as text: `console.file.getvalue()`."""
    return Console(file=io.StringIO(), width=80, force_terminal=False)


@pytest.fixture
def backend(server):
    from tfserve.chat.client import RemoteBackend

    remote = RemoteBackend(server.url).connect()
    yield remote
    remote.close()


@pytest.fixture
def session(backend, console):
    from tfserve.chat.conversation import Settings
    from tfserve.chat.session import ChatSession

    return ChatSession(backend, console, settings=Settings(**GREEDY))


