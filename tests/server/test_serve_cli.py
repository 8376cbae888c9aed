"""`tfserve serve`: help, flag errors, the banner, and (slow) a real process that serves and drains on SIGTERM."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from mcp_servers import toy_stdio_config
from rich.console import Console
from typer.testing import CliRunner

from tiny import MODEL_NAME, build_engine, build_llama, free_port, make_state, wait_healthy

runner = CliRunner()


def invoke(*args: str):
    from tfserve.cli import app

    return runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.fixture(autouse=True)
def _restore_logging():
    """`serve` points the tfserve logger at CliRunner's streams; later tests must not log into closed ones."""
    import logging

    logger = logging.getLogger("tfserve")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_help_lists_the_flags_and_examples():
    result = invoke("serve", "--help")
    assert result.exit_code == 0
    for flag in ["--model", "--host", "--port", "--dtype", "--device", "--quantization", "--attn-implementation",
                 "--max-batch-tokens", "--max-num-seqs", "--kv-cache-memory", "--block-size", "--no-prefix-caching",
                 "--max-body-size", "--max-queued", "--api-key", "TFSERVE_API_KEY", "--cors-allow-origins",
                 "--drain-timeout", "--force-model", "--otel", "--model-timeout", "--default-seed", "--enable-cors",
                 "--reasoning", "--chat-template-kwargs", "--generation-config", "--num-blocks",
                 "--continuous-batching", "--cb-block-size", "--cb-num-blocks", "--cb-max-batch-tokens",
                 "--cb-max-memory-percent", "--compile", "transformers serve", "Examples"]:
        assert flag in result.output, flag


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/dir"], "no such file or directory"),
    (["--model", "/", "--block-size", "3"], None),
    (["--kv-cache-memory", "lots"], "not a size"),
    (["--mcp-config", "/no/such.json"], "--mcp-config: /no/such.json: cannot read the MCP config"),
])
def test_bad_flags_fail_in_one_line(args, message, tmp_path):
    if args[:2] == ["--model", "/"]:
        (tmp_path / "config.json").write_text("{}")
        args = ["--model", str(tmp_path), *args[2:]]
        message = "must be a power of two (got 3)"
    result = invoke("serve", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_otel_without_the_extra_is_one_line(monkeypatch):
    from tfserve.server.runtime import telemetry

    monkeypatch.setattr(telemetry, "is_installed", lambda: False)
    result = invoke("serve", "--otel")
    assert result.exit_code == 1
    assert "pip install 'tfserve[otel]'" in result.output and "Traceback" not in result.output


def test_parse_size():
    from tfserve.cli.serve_flags import parse_size

    assert parse_size("0.5", "x") == 0.5
    assert parse_size("2GiB", "x") == 2 * 2**30
    assert parse_size("512 MB", "x") == 512 * 10**6


def test_banner(async_engine, monkeypatch):
    from tfserve.cli import output
    from tfserve.cli.serve_banner import print_banner

    capture = Console(file=io.StringIO(), width=100, force_terminal=False)
    monkeypatch.setattr(output, "console", capture)
    print_banner(make_state(async_engine), "http://127.0.0.1:8000", has_api_key=True)
    text = capture.file.getvalue()
    engine = async_engine.engine
    for part in [MODEL_NAME, "float32", "cpu", f"{engine.block_pool.num_blocks} blocks", "http://127.0.0.1:8000/v1",
                 "API key required"]:
        assert part in text, part
    assert "paged" in text and "Weights" not in text
    assert "Speculative" not in text and "CUDA graphs" not in text  # graphs: on a CUDA device only
    ops = engine.runner.cpu_ops  # the attention that runs: the kernels' where they are, not "SDPA" regardless
    assert (f"paged, CPU kernel ({ops.isa})" if ops is not None else "SDPA over the KV blocks") in text


def test_banner_names_the_matrix_units_once_per_unit(async_engine, monkeypatch):
    from tfserve.cli import output
    from tfserve.cli.serve_banner import print_banner

    engine = async_engine.engine
    int8 = "AVX512-VNNI int8 dot products (decode rows), AVX-512 float32 FMA (prompt rows)"
    monkeypatch.setattr(engine, "matmul_units", {"Q6_K": int8, "bfloat16": "AVX512-BF16 dot products", "Q4_K": int8},
                        raising=False)
    capture = Console(file=io.StringIO(), width=140, force_terminal=False)
    monkeypatch.setattr(output, "console", capture)
    print_banner(make_state(async_engine), "http://127.0.0.1:8000", has_api_key=False)
    text = capture.file.getvalue()
    assert f"Matrix units  Q4_K/Q6_K: {int8}" in text and "bfloat16: AVX512-BF16 dot products" in text
    assert text.count("Matrix units") == 1


@pytest.mark.parametrize("quantization, says", [("bfloat16", "bfloat16 (bfloat16 products, float32 sums)"),
                                                 ("Q4_1/bfloat16", "Q4_1/bfloat16 (compute float32)")])
def test_banner_says_bfloat16_products_only_for_bfloat16_weights(async_engine, monkeypatch, quantization, says):
    from tfserve.cli import output
    from tfserve.cli.serve_banner import print_banner

    engine = async_engine.engine
    monkeypatch.setattr(engine, "quantization", quantization)
    monkeypatch.setattr(engine, "matmul_units", {"bfloat16": "AVX512-BF16 dot products"}, raising=False)
    capture = Console(file=io.StringIO(), width=140, force_terminal=False)
    monkeypatch.setattr(output, "console", capture)
    print_banner(make_state(async_engine), "http://127.0.0.1:8000", has_api_key=False)
    assert f"Weights       {says}" in capture.file.getvalue()


def test_banner_names_the_kv_caches_type_and_its_kernel(tokenizer, monkeypatch):
    """bfloat16 weights on the kernels keep a bfloat16 KV cache, which the paged CPU kernel reads: the banner
    says both."""
    from tfserve import Engine
    from tfserve.cli import output
    from tfserve.cli.serve_banner import print_banner
    from tfserve.engine.async_engine import AsyncEngine

    engine = Engine(build_llama(tokenizer), tokenizer, num_blocks=64, weights="bfloat16")
    if engine.runner.cpu_ops is None:
        pytest.skip("CPU kernels unavailable here")
    capture = Console(file=io.StringIO(), width=140, force_terminal=False)
    monkeypatch.setattr(output, "console", capture)
    print_banner(make_state(AsyncEngine(engine)), "http://127.0.0.1:8000", has_api_key=False)
    text = capture.file.getvalue()
    assert "64 blocks x" in text and "(bfloat16)" in text and f"paged, CPU kernel ({engine.runner.cpu_ops.isa})" in text


def test_banner_counts_the_replicas(tokenizer, monkeypatch):
    from tfserve.cli import output
    from tfserve.cli.serve_banner import print_banner
    from tfserve.serving.replica import Replica
    from tfserve.serving.replicas import ReplicatedEngine

    engine = build_engine(tokenizer, num_blocks=64)
    capture = Console(file=io.StringIO(), width=120, force_terminal=False)
    monkeypatch.setattr(output, "console", capture)
    print_banner(make_state(ReplicatedEngine(engine, [Replica(), Replica()])), "http://127.0.0.1:8000", False)
    assert "Replicas" in capture.file.getvalue() and "3 (replica 0 here, the others processes" in capture.file.getvalue()


def test_banner_names_the_draft_model(tokenizer, monkeypatch):
    from tfserve import Engine
    from tfserve.cli import output
    from tfserve.cli.serve_banner import print_banner
    from tfserve.engine.async_engine import AsyncEngine

    llama = build_llama(tokenizer)
    engine = Engine(llama, tokenizer, num_blocks=64, speculative="draft", speculative_model="tiny-draft",
                    num_speculative_tokens=3, draft_model=llama)
    capture = Console(file=io.StringIO(), width=120, force_terminal=False)
    monkeypatch.setattr(output, "console", capture)
    print_banner(make_state(AsyncEngine(engine)), "http://127.0.0.1:8000", has_api_key=False)
    assert "draft tiny-draft (float32), up to 3 tokens a step" in capture.file.getvalue()


def test_banner_states_the_quantization(async_engine, monkeypatch):
    from tfserve.cli import output
    from tfserve.cli.serve_banner import print_banner

    capture = Console(file=io.StringIO(), width=100, force_terminal=False)
    monkeypatch.setattr(output, "console", capture)
    monkeypatch.setattr(async_engine.engine, "quantization", "bnb-4bit", raising=False)
    print_banner(make_state(async_engine), "http://127.0.0.1:8000", has_api_key=False)
    assert "bnb-4bit (compute float32)" in capture.file.getvalue()


def test_chat_template_kwargs_reach_the_template(start_server, tokenizer, monkeypatch):
    """Server defaults (--chat-template-kwargs / --reasoning) under the request's own chat_template_kwargs,
    for chat completions and responses; a non-object is a 400 naming the field."""
    from tfserve.server.api import chat
    from tfserve.server.tools import tool_loop

    seen = []
    real_render = chat.render_chat

    async def render(tok, messages, tools, template_kwargs=None, **options):
        seen.append(template_kwargs)
        return await real_render(tok, messages, tools, template_kwargs, **options)

    monkeypatch.setattr(chat, "render_chat", render)
    monkeypatch.setattr(tool_loop, "render_chat", render)
    live = start_server(state_kwargs={"chat_template_kwargs": {"enable_thinking": False, "style": "terse"}})
    client = live.client()
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=1)
    assert seen == [{"enable_thinking": True, "style": "terse"}, {"enable_thinking": False, "style": "terse"}]
    status, _, body = live.request("POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"


def test_render_chat_passes_template_variables():
    import asyncio

    from tfserve.server import chat_prompt

    def render_chat(*args):
        return asyncio.run(chat_prompt.render_chat(*args))

    class Recorder:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, **kwargs):
            self.kwargs = kwargs
            return {"input_ids": [1, 2]}

    tokenizer = Recorder()
    assert render_chat(tokenizer, [{"role": "user", "content": "hi"}], None, {"enable_thinking": False}) == [1, 2]
    assert tokenizer.kwargs["enable_thinking"] is False
    # what rendering needs stays ours: a request cannot turn tokenizing or the generation prompt off
    render_chat(tokenizer, [], None, {"tokenize": False, "add_generation_prompt": False, "chat_template": "x"})
    assert tokenizer.kwargs["tokenize"] and tokenizer.kwargs["add_generation_prompt"]
    assert tokenizer.kwargs["chat_template"] is None


def test_default_seed_makes_unseeded_sampling_repeatable(tokenizer):
    """--default-seed seeds torch's global generator, which unseeded requests sample from."""
    import torch

    from tfserve import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):  # two "server starts"
        engine = build_engine(tokenizer, num_blocks=64)
        torch.manual_seed(1234)
        runs.append([o.generated_tokens for o in engine.generate_batch(["hello world", "the quick"], params).values()])
    assert runs[0] == runs[1]


def test_model_timeout_unloads_the_idle_model_and_the_next_request_loads_it(tokenizer, tmp_path, tfserve_home):
    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.server.runtime.state import ServerState
    from tiny import LiveServer, build_engine

    loads = []

    def load(spec):
        loads.append(spec)
        engine = build_engine(tokenizer, num_blocks=64)
        engine.model_name, engine.model_path = MODEL_NAME, str(tmp_path / MODEL_NAME)
        return AsyncEngine(engine).start()

    state = ServerState(load=load, model_timeout_s=0.3)
    state.set_engine(load(str(tmp_path / MODEL_NAME)))
    live = LiveServer(state)
    try:
        client = live.client()
        assert client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2).model == MODEL_NAME
        for _ in range(100):
            if state.engine is None and state.model_name is not None:  # unloaded, and its names kept
                break
            time.sleep(0.05)
        assert state.engine is None and state.models.asleep is not None
        status, _, body = live.request("GET", "/health")
        assert status == 200 and body["model"] == MODEL_NAME  # asleep is healthy: the next request loads it
        assert [m.id for m in client.models.list()] == [MODEL_NAME]
        for model in (None, MODEL_NAME):  # no model named, then by name: both wake it
            reply = live.request("POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **({"model": model} if model else {})})
            assert reply[0] == 200, reply
        assert len(loads) == 2 and state.engine is not None
    finally:
        live.close()
        state.stop()


@pytest.mark.slow
def test_serve_process_answers_and_drains_on_sigterm(tmp_path, tokenizer):
    import openai

    from tiny import build_llama

    model_dir = tmp_path / "tiny-chat"
    build_llama(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    pid_file = tmp_path / "mcp.pid"  # the stdio MCP server writes its pid: started with the server, gone after
    stdio = toy_stdio_config()
    mcp_config = tmp_path / "mcp.json"
    mcp_config.write_text(json.dumps({"mcpServers": {"toy": {**stdio, "args": [*stdio["args"], "--pid-file",
                                                                               str(pid_file)]}}}))
    process = subprocess.Popen(
        [sys.executable, "-c", "from tfserve.cli import main; main()", "serve", "--model", str(model_dir),
         "--port", str(port), "--kv-cache-memory", "8MiB", "--api-key", "k", "--mcp-config", str(mcp_config)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, [process])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        reply = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.model == "tiny-chat" and reply.usage.completion_tokens <= 4
        (mcp_pid,) = map(int, pid_file.read_text().split())  # started before any request named it
        response = client.responses.create(model="tiny-chat", input="Pick.", max_output_tokens=30, tools=[
            {"type": "mcp", "server_label": "toy", "allowed_tools": ["pick"], "require_approval": "never"}],
            tool_choice={"type": "mcp", "server_label": "toy", "name": "pick"})
        assert response.output[1].type == "mcp_call" and response.output[1].output.startswith("picked ")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "KV cache" in output and f"http://127.0.0.1:{port}/v1" in output
    assert "POST /v1/chat/completions 200" in output  # the access log
    _wait_gone(mcp_pid)  # the stdio MCP server stopped with the server


def _wait_gone(pid: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still runs")


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_model_dir):
    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.engine.engine import Engine
    from tfserve.models.loading import load_model

    from tiny import LiveServer

    loaded = load_model(str(default_model_dir))
    engine = Engine(loaded.model, loaded.tokenizer, num_blocks=256)
    async_engine = AsyncEngine(engine).start()
    from tfserve.server.runtime.state import ServerState

    state = ServerState()
    state.set_engine(async_engine, "smollm2-135m-instruct", default_model_dir)
    live = LiveServer(state)
    try:
        reply = live.client().chat.completions.create(
            model="smollm2-135m-instruct", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        live.close()
        async_engine.stop()


def test_media_flags_reach_the_server(monkeypatch, tmp_path):
    from tfserve.server import run
    from tfserve.server.runtime.state import STATE

    seen = {}

    async def serve(app, host, port, **kwargs):
        seen["media"] = app[STATE].media_options

    monkeypatch.setattr(run, "serve", serve)
    result = invoke("serve", "--allowed-media-domains", "Example.com", "--allowed-media-domains", "cdn.example.com",
                    "--allowed-local-media-path", str(tmp_path), "--limit-mm-per-prompt", '{"image": 4}',
                    "--max-image-size", "1MiB", "--max-image-pixels", "1000000", "--media-fetch-timeout", "2.5")
    assert result.exit_code == 0, result.output
    media = seen["media"]
    assert media.allowed_domains == ("example.com", "cdn.example.com")
    assert media.allowed_local_path == tmp_path.resolve()
    assert (media.max_images, media.max_image_bytes, media.max_image_pixels, media.fetch_timeout_s) == (
        4, 2**20, 1_000_000, 2.5)
    invoke("serve", "--limit-mm-per-prompt", "7")
    assert seen["media"].max_images == 7 and seen["media"].allowed_domains == ()


@pytest.mark.parametrize("flag", ["--max-model-len", "--max_model_len"])
def test_max_model_len_reaches_the_engine(monkeypatch, flag):
    """vLLM's flag, which a user caps the context with (only --num-blocks did, shrinking every sequence's room)."""
    from tfserve.cli import loading, serve
    from tfserve.server import run

    seen = {}
    make = loading.engine_config_from_flags
    monkeypatch.setattr(serve, "engine_config_from_flags", lambda kwargs: seen.setdefault("config", make(kwargs)))

    async def quiet(app, host, port, **kwargs):
        pass

    monkeypatch.setattr(run, "serve", quiet)
    result = invoke("serve", flag, "512")
    assert result.exit_code == 0, result.output
    assert seen["config"].max_model_len == 512


@pytest.mark.parametrize("args,message", [
    (["--limit-mm-per-prompt", '{"video": 1}'], "not a count of images"),
    (["--limit-mm-per-prompt", "0"], "not a count of images"),
    (["--max-image-size", "0.5"], "--max-image-size must be > 0"),
    (["--allowed-local-media-path", "/no/such/dir"],
     "--allowed-local-media-path must be a directory (got /no/such/dir)"),
])
def test_bad_media_flags_fail_in_one_line(args, message):
    result = invoke("serve", *args)
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_server_stopped_while_its_model_loads_says_it_never_served(monkeypatch):
    """Ctrl-C during the load: `run.serve` answers False, and `tfserve serve` exits 130, not 0 (a success). The
    load that ends after the loop closed hands its result to no one, quietly (it raised in its thread)."""
    import asyncio
    import threading
    import time

    from tiny import free_port

    from tfserve.engine.threads import abandoned_torch_work
    from tfserve.server import run
    from tfserve.server.app import create_app
    from tfserve.server.runtime.state import ServerState

    released = threading.Event()

    async def main():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        return await run.serve(create_app(ServerState()), "127.0.0.1", free_port(), load=lambda: released.wait(10),
                               stop_event=stop, drain_timeout=1)

    try:
        assert asyncio.run(main()) is False
    finally:
        released.set()
    deadline = time.monotonic() + 10
    while abandoned_torch_work() and time.monotonic() < deadline:  # the load ends, after its loop
        time.sleep(0.05)
    assert not abandoned_torch_work()

    async def stopped_while_loading(app, host, port, **kwargs):
        return False

    monkeypatch.setattr(run, "serve", stopped_while_loading)
    result = invoke("serve")
    assert result.exit_code == 130 and "Stopped before the model was loaded" in result.output
