"""Tiny things the server and chat tests share: a ChatML tokenizer trained in-process, a random-weight
llama sized to it, a real tfserve app on a free port served from a background thread, a scripted model,
and helpers to read SSE bodies, drive the chat REPL and wait for the engine to go idle.

(The conftests of tests/server and tests/chat put `tests/` on sys.path and import this as `tiny`.)"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from threads on a busy 2-core machine (conftests import this fixture)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a tiny model that served many requests at once.",
    "héllo wörld 日本語 🎉 The capital of France is Paris. What is the weather?",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
] * 5
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_NAME = "tiny-llama"


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
    """An app on 127.0.0.1 (free port) served by an event loop on a background thread."""

    def __init__(self, state, **app_kwargs) -> None:
        from aiohttp import web

        from tfserve.server.app import create_app, json_errors

        self.state = state
        self.app = create_app(state, **app_kwargs)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            runner = web.AppRunner(self.app, shutdown_timeout=0.5)
            await runner.setup()
            json_errors(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            return runner

        self.runner = self.call(start())
        self.port = self.runner.addresses[0][1]
        self.base_url = self.url = f"http://127.0.0.1:{self.port}"

    @classmethod
    def for_engine(cls, async_engine, **app_kwargs) -> LiveServer:
        """A server whose state holds `async_engine` as the model `MODEL_NAME`."""
        return cls(make_state(async_engine), **app_kwargs)

    def call(self, coro, timeout: float = 60):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, api_key: str = "x", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def request(self, method: str, path: str, body=None, headers: dict | None = None):
        """A raw request -> (status, headers, body parsed as JSON when it is JSON, else text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read().decode()
        conn.close()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            data = raw
        return response.status, dict(response.getheaders()), data

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.call(self.state.close_mcp())  # stdio MCP servers it started stop with it
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def build_engine(tokenizer, **kwargs):
    from tfserve import Engine

    kwargs = {"block_size": 16, "num_blocks": 1024, "max_num_seqs": 64, "max_batch_tokens": 1024, **kwargs}
    return Engine(build_llama(tokenizer), tokenizer, **kwargs)


def make_state(async_engine, **kwargs):
    from tfserve.server.runtime.state import ServerState

    state = ServerState(**kwargs)
    state.set_engine(async_engine, MODEL_NAME, path=f"/models/{MODEL_NAME}")
    return state


GREEDY = {"temperature": 0.0, "max_tokens": 8}


def scripted_generate(pieces: list[str], finish_reason: str = "stop", stop_token_id: int | None = 2,
                      fail_with: BaseException | None = None, error: str | None = None):
    """A stand-in for `ServerState.generate` that "generates" `pieces`, one token each (a scripted model)."""
    from tfserve.engine.request import RequestMetrics, RequestOutput

    def generate(request):
        prompt_ids = request.prompt_token_ids

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


def run_engine(engine, items: list) -> list:
    """Add every (prompt, params) — or (prompt, params, mm) for a prompt with images — and step until all finish;
    final outputs in order (children of n > 1 flat). Every KV block is free again at the end."""
    ids = []
    for prompt, params, *mm in items:
        if mm:
            requests = engine.make_requests(prompt, params, mm=mm[0])
            for request in requests:
                engine.enqueue(request)
            ids.extend(request.request_id for request in requests)
        else:
            ids.extend(engine.add_request(prompt, params))
    results = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return [results[i] for i in ids]


class FakeHandler:
    """Mixed into a `BaseHTTPRequestHandler` of a fake server: no request log, and `send`/`send_json`."""

    def log_message(self, *args) -> None:
        pass

    def send(self, status: int, kind: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_json(self, status: int, body: dict) -> None:
        self.send(status, "application/json", json.dumps(body).encode())


class FakeHTTPServer:
    """`handler` (a BaseHTTPRequestHandler class) served on a free local port from a daemon thread."""

    def __init__(self, handler) -> None:
        from http.server import ThreadingHTTPServer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(port: int, processes: list, timeout: float = 120.0) -> None:
    """Wait until the server on `port` answers /health with 200, failing (with their output) if any of the
    `processes` it runs in exits first."""
    import httpx2

    deadline = time.monotonic() + timeout
    while True:
        for process in processes:
            assert process.poll() is None, process.stdout.read()
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.3)


class ServeProcess:
    """`tfserve serve ARGS --port P` in a process of its own, waited for until healthy (`with` kills what is left)."""

    def __init__(self, args: list[str], env: dict, timeout: float = 120.0, port: int | None = None) -> None:
        import subprocess
        import sys

        self.port = port or free_port()
        self.process = subprocess.Popen([sys.executable, "-m", "tfserve", "serve", *args, "--port", str(self.port)],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_healthy(self.port, [self.process], timeout)
        except BaseException:
            self.process.kill()
            raise

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def client(self, api_key: str = "none"):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0, timeout=60)

    def get(self, path: str) -> str:
        import httpx2

        return httpx2.get(f"http://127.0.0.1:{self.port}{path}", timeout=10).text

    def stop(self, timeout: float = 60.0) -> str:
        """Ctrl+C, and the process's whole output once it has exited."""
        import signal

        self.process.send_signal(signal.SIGINT)
        output, _ = self.process.communicate(timeout=timeout)
        return output


def slow_masks(monkeypatch, seconds: float) -> None:
    """Every grammar mask busy for `seconds` of the thread's CPU time first (the budget counts CPU time, not
    wall): a hostile grammar's mask, where a tiny vocabulary masks in microseconds."""
    import time

    from tfserve.engine.structured import StructuredOutputs

    class Slow:
        def __init__(self, matcher):
            self.matcher = matcher

        def unsafe_compute_mask_ptr(self, *args):
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass
            return self.matcher.unsafe_compute_mask_ptr(*args)

        def __getattr__(self, name):
            return getattr(self.matcher, name)

    make = StructuredOutputs.matcher
    monkeypatch.setattr(StructuredOutputs, "matcher", lambda self, grammar: Slow(make(self, grammar)))


def save_model(path, architecture: str, *, heads: int, kv_heads: int, vocab: int, tie: bool, seed: int = 0):
    """A tiny random model and a tokenizer, saved where other processes (worker ranks, replicas) can load them."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_class = getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(
        architecture, architecture.replace("ForCausalLM", "Config")))
    config = config_class(vocab_size=vocab, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=96 // heads,
                          max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          tie_word_embeddings=tie)
    model = getattr(transformers, architecture)(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
