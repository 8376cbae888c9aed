"""`tfserve chat` against Ollama's and TGI's APIs: the live tiny server's /api/* and /info routes with
`--protocol`, and `--protocol auto` finding them behind a proxy that hides what the other APIs answer."""

from __future__ import annotations

import http.client
from http.server import BaseHTTPRequestHandler

import pytest
from tiny import MODEL_NAME, FakeHTTPServer, FakeHandler
from typer.testing import CliRunner

from tfserve.chat.conversation import Settings
from tfserve.cli import app

runner = CliRunner()
GREEDY_ARGS = ["--temperature", "0", "--max-tokens", "8"]


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, ["chat", *args], input=input, env={"COLUMNS": "200"}, prog_name="tfserve")


def greedy_answer(server, text: str) -> str:
    completion = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=8)
    return completion.choices[0].message.content


@pytest.mark.parametrize("protocol", ["ollama", "tgi"])
def test_piped_chat_over_each_protocol_gets_the_same_answer(server, protocol):
    expected = greedy_answer(server, "hello")
    result = invoke(server.url, "--protocol", protocol, *GREEDY_ARGS, input="hello\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"


def test_ollama_backend_streams_and_counts(server):
    from tfserve.chat.ollama_client import OllamaBackend

    backend = OllamaBackend(server.url).connect()
    assert backend.model == MODEL_NAME and backend.list_models()[0] == MODEL_NAME
    reply = backend.stream([{"role": "user", "content": "hello"}], Settings(temperature=0, max_tokens=8))
    text = "".join(reply)
    assert text == greedy_answer(server, "hello")
    assert reply.stats.finish_reason in ("stop", "length") and reply.stats.num_completion_tokens >= 1
    backend.close()


def _proxy(server, hidden: tuple[str, ...]) -> FakeHTTPServer:
    """A proxy to `server` that answers 404 for the paths starting with `hidden`."""

    class Proxy(FakeHandler, BaseHTTPRequestHandler):
        def do_GET(self):
            self.forward()

        def do_POST(self):
            self.forward()

        def forward(self):
            if self.path.startswith(hidden):
                return self.send_json(404, {"error": "not found"})
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request(self.command, self.path, body=body or None,
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            self.send(response.status, response.getheader("Content-Type", ""), response.read())
            conn.close()

    return FakeHTTPServer(Proxy)


@pytest.mark.parametrize("hidden, found", [(("/v1/",), "ollama"), (("/v1/models", "/api/"), "tgi")])
def test_auto_finds_the_api_the_server_speaks(server, hidden, found):
    from tfserve.chat.protocols import connect_remote

    proxy = _proxy(server, hidden)
    try:
        backend = connect_remote(proxy.url)
        assert type(backend).__name__ == {"ollama": "OllamaBackend", "tgi": "TgiBackend"}[found]
        assert backend.model == MODEL_NAME
        result = invoke(proxy.url, *GREEDY_ARGS, input="hello\n")
        assert result.exit_code == 0, result.output
        assert result.stdout == greedy_answer(server, "hello") + "\n"
        backend.close()
    finally:
        proxy.close()
