"""`tfserve chat` through Typer's CliRunner (stdin is not a terminal there: piped mode), URL forms, and
in-process mode with the loader patched to return the tiny model."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from tiny import MODEL_NAME, build_llama
from typer.testing import CliRunner

from tfserve.chat.client import normalize_url
from tfserve.cli import app

runner = CliRunner()
GREEDY_ARGS = ["--temperature", "0", "--max-tokens", "8"]


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, ["chat", *args], input=input, env={"COLUMNS": "200"}, prog_name="tfserve")


def greedy_answer(server, text: str) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    completion = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": text}],
                                                temperature=0, max_tokens=8)
    return completion.choices[0].message.content


@pytest.mark.parametrize("url, expected", [
    ("localhost:8000", "http://localhost:8000"),
    ("127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
    ("http://localhost:8000/", "http://localhost:8000"),
    ("https://api.example.com/v1/", "https://api.example.com"),
    ("http://host:1/proxy/v1", "http://host:1/proxy"),
    ("8000", "http://localhost:8000"),
    (":8000", "http://localhost:8000"),
    ("http://127.0.0.1:8000/v1/chat/completions", "http://127.0.0.1:8000"),  # an endpoint's URL, pasted
    ("localhost:8000/v1/models/", "http://localhost:8000"),
])
def test_normalize_url(url, expected):
    assert normalize_url(url) == expected


def test_help_has_examples():
    result = invoke("--help")
    assert result.exit_code == 0
    assert "Examples" in result.output and "--max-tokens" in result.output and "TFSERVE_API_KEY" in result.output


def test_unreachable_server_is_one_line_and_exit_1():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = invoke(f"127.0.0.1:{port}", input="hello\n")
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"Error: cannot reach http://127.0.0.1:{port} — is `tfserve serve` running?"]


@pytest.mark.parametrize("url, message", [
    ("http://", "invalid URL 'http://': no host; use host:port or http(s)://host:port[/v1]"),
    ("ftp://x", "invalid URL 'ftp://x': use host:port or http(s)://host:port[/v1]"),
    ("127.0.0.1:99999", "invalid URL '127.0.0.1:99999': the port must be 1-65535"),
])
def test_a_url_that_is_no_url_is_a_usage_error_not_an_unreachable_server(url, message):
    result = invoke(url, input="hello\n")
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"Error: {message}"], result.output


def test_a_plain_web_server_is_one_line_without_its_html(plain_web_server):
    url = f"http://{plain_web_server}"
    result = invoke(url, input="hello\n")
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"Error: {url} does not answer /v1/models as an OpenAI-compatible server (404)"], result.output


def test_bad_generation_option_is_a_usage_error():
    result = invoke("localhost:1", "--top-p", "1.5")
    assert result.exit_code == 2 and "--top-p" in result.output and "must be in [0, 1]" in result.output


def test_piped_mode_prints_each_answer_as_plain_text(server):
    expected = greedy_answer(server, "hello")
    result = invoke(f"{server.url}/v1", *GREEDY_ARGS, input="hello\n\nWhat is the weather?\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(expected + "\n")
    assert "tok/s" not in result.stdout and "tfserve chat" not in result.stdout  # answers only
    assert len(result.stdout) > len(expected) + 2  # the second answer


def test_piped_mode_commands_go_to_stderr_and_errors_set_the_exit_code(server):
    result = invoke(str(server.port), *GREEDY_ARGS, input="/system Be brief.\n/set max_tokens 5000\nhello\n")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "System prompt set." in result.stderr and "Error: server error 400" in result.stderr


def test_in_process_mode_with_the_tiny_model(server, tokenizer, monkeypatch):
    import torch

    from tfserve.models import loading

    calls = []

    def load_model(spec, **options):
        calls.append((spec, options))
        return loading.LoadedModel(build_llama(tokenizer), tokenizer, "tiny-local", Path("/models/tiny-local"),
                                   "cpu", torch.float32)

    monkeypatch.setattr(loading, "load_model", load_model)
    expected = greedy_answer(server, "hello")  # the same weights behind the server
    result = invoke("-m", "tiny-local", "--dtype", "float32", *GREEDY_ARGS, input="hello\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"
    spec, options = calls[0]
    assert spec == "tiny-local" and options["dtype"] == "float32" and options["device"] == "auto"


@pytest.mark.parametrize("failing, said", [
    ("/load /nonexistent/chat.json", "Error: cannot read /nonexistent/chat.json"),
    ("/bogus", "Error: unknown command /bogus"),
    ("/set temperature 9", "Error: temperature must be in [0, 2]"),
    ("/retry", "Error: nothing to retry yet"),
])
def test_piped_mode_a_failed_command_sets_the_exit_code_and_the_rest_still_runs(server, failing, said):
    expected = greedy_answer(server, "hello")
    result = invoke(str(server.port), *GREEDY_ARGS, input=f"{failing}\nhello\n")
    assert result.exit_code == 1
    assert said in result.stderr
    assert result.stdout == expected + "\n"  # the line after it was answered


def test_piped_mode_without_failures_exits_0(server):
    result = invoke(str(server.port), *GREEDY_ARGS, input="/set temperature 0\n/system Be brief.\n//hello\n")
    assert result.exit_code == 0, result.output
