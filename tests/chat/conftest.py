"""A live tiny server (random-weight llama, ChatML tokenizer trained in-process) for the chat client, and
helpers that drive the REPL with prompt-toolkit's pipe input and capture what rich prints.

The model and server builders are a minimal copy of tests/server/conftest.py, kept here so that chat tests
do not depend on another suite's fixtures."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import pytest
from rich.console import Console

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a tiny model that served many requests at once.",
    "héllo wörld 日本語 🎉 The capital of France is Paris. What is the weather?",
] * 5
CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_NAME = "tiny-llama"
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", unk_token="<unk>",
                                      additional_special_tokens=["<|im_start|>"])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_llama(tokenizer, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


class LiveServer:
    """The tfserve app on 127.0.0.1 (a free port), served by an event loop on a background thread."""

    def __init__(self, async_engine, **app_kwargs) -> None:
        from aiohttp import web

        from tfserve.server.app import create_app
        from tfserve.server.state import ServerState

        self.state = ServerState()
        self.state.set_engine(async_engine.engine, async_engine, MODEL_NAME)
        self.app = create_app(self.state, **app_kwargs)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            runner = web.AppRunner(self.app, shutdown_timeout=0.5)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            return runner

        self.runner = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from threads on a busy 2-core machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
    live = LiveServer(async_engine)
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


def run_keys(session, keys: str) -> str:
    """Type `keys` into the REPL (Enter is \\r; end with /exit or Ctrl-D) and return what the chat printed."""
    from prompt_toolkit.history import InMemoryHistory
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from tfserve.chat.repl import run_repl

    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        run_repl(session, input=pipe, output=DummyOutput(), history=InMemoryHistory())
    return session.console.file.getvalue()


def wait_until_idle(engine, timeout: float = 5.0) -> bool:
    """True once the engine runs nothing and every KV block is free (an abort lands a step later)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (engine.num_running == 0 and not engine.has_unfinished
                and engine.block_pool.num_free_blocks == engine.block_pool.num_blocks):
            return True
        time.sleep(0.02)
    return False
