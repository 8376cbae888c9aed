"""Which of a server's models `tfserve chat` chats with: speech-to-text models are never offered, and a
`--model` the server does not serve is refused at start in one line that names the ones it does."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote

import pytest
from typer.testing import CliRunner

from tiny import FakeHandler, FakeHTTPServer, run_keys

from tfserve.chat.client import ChatError, RemoteBackend
from tfserve.chat.session import ChatSession
from tfserve.cli import app

MODELS = [  # a speech model first, as a server that lists what it loaded may
    {"id": "whisper-tiny.en", "object": "model", "input_modalities": ["audio"]},  # tfserve marks its speech models
    {"id": "chat-one", "object": "model", "input_modalities": ["text"]},
    {"id": "vlm-two", "object": "model", "input_modalities": ["text", "image"]},
    {"id": "whisper-1", "object": "model"},  # OpenAI's: no modalities, known by its name
]
ALIASES = {"/srv/models/chat-one": "chat-one"}  # served under another name too: GET /v1/models/{id} knows it


class ModelsServer(FakeHTTPServer):
    """Answers GET /v1/models and GET /v1/models/{id} (404 for a name it does not serve)."""

    def __init__(self) -> None:
        class Handler(FakeHandler, BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    return self.send_json(200, {"object": "list", "data": MODELS})
                name = unquote(self.path.removeprefix("/v1/models/"))  # the SDK quotes a name's slashes
                name = ALIASES.get(name, name)
                model = next((m for m in MODELS if m["id"] == name), None)
                if model is None:
                    return self.send_json(404, {"error": {"message": f"The model {name!r} does not exist",
                                                          "type": "invalid_request_error", "code": "model_not_found"}})
                return self.send_json(200, model)

        super().__init__(Handler)


@pytest.fixture
def models_server():
    server = ModelsServer()
    yield server
    server.close()


def test_speech_models_are_not_offered_for_chat(models_server, console):
    backend = RemoteBackend(models_server.url).connect()
    assert backend.model == "chat-one"  # the first chat model, not the first listed
    assert backend.list_models() == ["chat-one", "vlm-two"]
    session = ChatSession(backend, console)
    out = run_keys(session, "/models\r/exit\r")
    assert "* chat-one" in out and "  vlm-two" in out and "whisper" not in out
    out = run_keys(session, "/model whisper-1\r/exit\r")
    assert "no model 'whisper-1' here" in out and backend.model == "chat-one"


@pytest.mark.parametrize("name", ["chat-one", "vlm-two", "/srv/models/chat-one"])
def test_a_model_the_server_serves_is_taken(models_server, name):
    assert RemoteBackend(models_server.url, model=name).connect().model == name


@pytest.mark.parametrize("name, fragments", [
    ("nope", ["does not serve 'nope'", "its chat models: chat-one, vlm-two"]),
    ("whisper-tiny.en", ["'whisper-tiny.en' is a speech-to-text model", "chat models: chat-one, vlm-two"]),
    ("whisper-1", ["'whisper-1' is a speech-to-text model", "tfserve transcribe"]),
])
def test_a_model_the_server_does_not_chat_with_is_refused_at_start(models_server, name, fragments):
    with pytest.raises(ChatError) as caught:
        RemoteBackend(models_server.url, model=name).connect()
    for fragment in fragments:
        assert fragment in str(caught.value)
    result = CliRunner().invoke(app, ["chat", models_server.url, "-m", name], input="hello\n",
                                env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and fragments[0] in lines[0], result.output
