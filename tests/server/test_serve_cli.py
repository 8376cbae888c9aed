"""`tfserve serve`: help, flag errors, the banner, and (slow) a real process that serves and drains on SIGTERM."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tiny import MODEL_NAME, make_state

runner = CliRunner()


def invoke(*args: str):
    from tfserve.cli import app

    return runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_help_lists_the_flags_and_examples():
    result = invoke("serve", "--help")
    assert result.exit_code == 0
    for flag in ["--model", "--host", "--port", "--dtype", "--device", "--quantization", "--attn-implementation",
                 "--max-batch-tokens", "--max-num-seqs", "--kv-cache-memory", "--block-size", "--no-prefix-caching",
                 "--max-body-size", "--max-queued", "--api-key", "TFSERVE_API_KEY", "--cors-allow-origins",
                 "--drain-timeout", "--force-model", "--otel", "Examples"]:
        assert flag in result.output, flag


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/dir"], "no such file or directory"),
    (["--model", "/", "--block-size", "3"], None),
    (["--kv-cache-memory", "lots"], "not a size"),
])
def test_bad_flags_fail_in_one_line(args, message, tmp_path):
    if args[:2] == ["--model", "/"]:
        (tmp_path / "config.json").write_text("{}")
        args = ["--model", str(tmp_path), *args[2:]]
        message = "--block-size must be a power of two"
    result = invoke("serve", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_otel_without_the_extra_is_one_line(monkeypatch):
    from tfserve.server import telemetry

    monkeypatch.setattr(telemetry, "is_installed", lambda: False)
    result = invoke("serve", "--otel")
    assert result.exit_code == 1
    assert "pip install 'tfserve[otel]'" in result.output and "Traceback" not in result.output


def test_parse_size():
    from tfserve.cli.serve import parse_size

    assert parse_size("0.5", "x") == 0.5
    assert parse_size("2GiB", "x") == 2 * 2**30
    assert parse_size("512 MB", "x") == 512 * 10**6


def test_banner(async_engine, monkeypatch):
    from tfserve.cli import output
    from tfserve.cli.serve import print_banner

    capture = Console(file=io.StringIO(), width=100, force_terminal=False)
    monkeypatch.setattr(output, "console", capture)
    print_banner(make_state(async_engine), "http://127.0.0.1:8000", has_api_key=True)
    text = capture.file.getvalue()
    engine = async_engine.engine
    for part in [MODEL_NAME, "float32", "cpu", f"{engine.block_pool.num_blocks} blocks", "http://127.0.0.1:8000/v1",
                 "API key required"]:
        assert part in text, part


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_serve_process_answers_and_drains_on_sigterm(tmp_path, tokenizer):
    import httpx2
    import openai

    from tiny import build_llama

    model_dir = tmp_path / "tiny-chat"
    build_llama(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", "from tfserve.cli import main; main()", "serve", "--model", str(model_dir),
         "--port", str(port), "--kv-cache-memory", "8MiB", "--api-key", "k"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        reply = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.model == "tiny-chat" and reply.usage.completion_tokens <= 4
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "KV cache" in output and f"http://127.0.0.1:{port}/v1" in output
    assert "POST /v1/chat/completions 200" in output  # the access log


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_model_dir):
    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.engine.engine import Engine
    from tfserve.models.loading import load_model

    from tiny import LiveServer

    loaded = load_model(str(default_model_dir))
    engine = Engine(loaded.model, loaded.tokenizer, num_blocks=256)
    async_engine = AsyncEngine(engine).start()
    from tfserve.server.state import ServerState

    state = ServerState()
    state.set_engine(engine, async_engine, "smollm2-135m-instruct", default_model_dir)
    live = LiveServer(state)
    try:
        reply = live.client().chat.completions.create(
            model="smollm2-135m-instruct", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        live.close()
        async_engine.stop()
