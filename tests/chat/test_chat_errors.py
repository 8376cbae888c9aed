"""Cancelling a reply (the server aborts it), server error bodies, a connection lost mid-reply, API keys:
each is one line and the chat goes on."""

from __future__ import annotations

import re
import socket
import threading
from http.server import BaseHTTPRequestHandler

import pytest
from tiny import MODEL_NAME, FakeHandler, FakeHTTPServer, LiveServer, run_keys, wait_until_idle

from tfserve.chat.backend import ChatError, ConnectionLost, ServerError
from tfserve.chat.client import RemoteBackend
from tfserve.chat.conversation import Settings
from tfserve.chat.local import LocalBackend
from tfserve.chat.session import ChatSession

LONG = Settings(temperature=1.0, seed=1, max_tokens=400)  # this seed runs ~390 tokens before EOS


def interrupt_after_first_delta(backend):
    """Make the next replies raise KeyboardInterrupt (what Ctrl-C does) once their first text arrived."""
    stream = backend.stream

    def interrupted(messages, settings):
        reply = stream(messages, settings)

        class Interrupted:
            stats = reply.stats

            def __iter__(self):
                for delta in reply:
                    yield delta
                    raise KeyboardInterrupt

            def close(self):
                reply.close()

        return Interrupted()

    backend.stream = interrupted


@pytest.fixture
def aborts(engine, monkeypatch):
    """Request ids the engine really aborted (still running when the abort came)."""
    aborted = []
    abort = engine.abort

    def spy(request_id):
        output = abort(request_id)
        if output is not None:
            aborted.append(request_id)
        return output

    monkeypatch.setattr(engine, "abort", spy)
    return aborted


@pytest.mark.parametrize("where", ["server", "in-process"])
def test_ctrl_c_cancels_the_reply_and_the_engine_aborts_it(where, backend, async_engine, engine, console, aborts):
    if where == "in-process":
        backend = LocalBackend(async_engine.manager, MODEL_NAME)
    session = ChatSession(backend, console, settings=LONG)
    interrupt_after_first_delta(backend)
    out = run_keys(session, "Tell me a long story.\r/exit\r")
    assert "[cancelled]" in out
    user, partial = session.conversation.turns
    assert partial["role"] == "assistant" and partial["content"]  # what arrived is kept
    assert wait_until_idle(engine), "the cancelled request is still running"
    assert len(aborts) == 1
    assert session.stats.num_cancelled == 1

    del backend.stream  # Ctrl-C no more: the engine still answers
    session.settings = Settings(temperature=0.0, max_tokens=8)
    assert session.ask("hello") and session.last_turn.num_tokens == 8


def test_server_error_body_in_red_then_retry(session, server):
    out = run_keys(session, "/set max_tokens 5000\rhello\r/set max_tokens 8\r/retry\r/exit\r")
    assert "Error: server error 400: This model's maximum context length" in out and "5000" in out
    assert "Traceback" not in out
    # the failed message was not kept in the conversation; /retry sent it again
    assert [t["role"] for t in session.conversation.turns] == ["user", "assistant"]
    assert session.stats.num_errors == 1 and session.stats.num_replies == 1


def test_unknown_model_is_a_server_error(server, console):
    backend = RemoteBackend(server.url, model="nope")
    session = ChatSession(backend, console)
    assert not session.ask("hello")
    assert "Error: server error 404: The model 'nope' does not exist" in console.file.getvalue()


class HalfServer:
    """Answers /v1/chat/completions with one SSE chunk, then drops the connection."""

    CHUNK = ('data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", '
             '"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]}\n\n')

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length")), b"0"))
                while len(body) < length:
                    body += conn.recv(65536)
                data = self.CHUNK.encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def close(self) -> None:
        self.sock.close()


def chat_with(server: HalfServer, console, keys: str) -> tuple[ChatSession, str]:
    """A session against `server` (closed after) that types `keys`: the session and what it printed."""
    try:
        session = ChatSession(RemoteBackend(server.url, model="m"), console)
        return session, run_keys(session, keys)
    finally:
        server.close()


def test_connection_lost_mid_reply_is_one_line_and_the_chat_goes_on(console):
    session, out = chat_with(HalfServer(), console, "hello\r/settings\r/exit\r")
    assert "Error: connection lost in the middle of the reply" in out
    assert "Hel" in out and session.conversation.turns[-1] == {"role": "assistant", "content": "Hel"}
    assert "temperature" in out  # /settings ran after the error


class StreamThenDrop(HalfServer):
    """Streams 60 one-token chunks, then drops the connection."""

    CHUNK = HalfServer.CHUNK * 60


def test_a_failed_reply_counts_the_tokens_it_streamed(console):
    session, out = chat_with(StreamThenDrop(), console, "hello\r/stats\r/exit\r")
    assert "Error: connection lost in the middle of the reply" in out
    assert re.search(r"replies\s+0 \(0 cancelled, 1 failed\)", out), out
    assert re.search(r"^tokens generated\s+60 *$", out, re.M), out  # what streamed was generated, failure or not


def test_server_gone_mid_session(console):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    session = ChatSession(RemoteBackend(f"127.0.0.1:{port}", model="m"), console)
    assert not session.ask("hello")
    assert f"Error: cannot reach http://127.0.0.1:{port} — is `tfserve serve` running?" in console.file.getvalue()
    assert session.unanswered == "hello" and session.conversation.turns == []


@pytest.fixture
def keyed_server(async_engine, monkeypatch):
    """A live server that wants the key "sekrit"; no key in the environment."""
    monkeypatch.delenv("TFSERVE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    live = LiveServer.for_engine(async_engine, api_key="sekrit")
    yield live
    live.close()


def test_api_key_from_the_environment(keyed_server, monkeypatch):
    live = keyed_server
    with pytest.raises(ServerError, match=re.escape(f"{live.url} refused the API key (401): pass --api-key")):
        RemoteBackend(live.url).connect()
    monkeypatch.setenv("OPENAI_API_KEY", "sekrit")
    assert RemoteBackend(live.url).connect().model == MODEL_NAME
    monkeypatch.setenv("TFSERVE_API_KEY", "wrong")  # TFSERVE_API_KEY first
    with pytest.raises(ServerError, match=re.escape(f"{live.url} refused the API key given with $TFSERVE_API_KEY "
                                                    "(401)")):
        RemoteBackend(live.url).connect()
    assert RemoteBackend(live.url, api_key="sekrit").connect().model == MODEL_NAME


@pytest.mark.parametrize("args, env, said", [
    (["--api-key", "wrong"], {}, "refused the API key given with --api-key (401)"),
    ([], {"OPENAI_API_KEY": "wrong"}, "refused the API key given with $OPENAI_API_KEY (401)"),
    ([], {}, "refused the API key (401): pass --api-key"),
])
def test_a_refused_key_says_where_it_came_from(keyed_server, args, env, said):
    from typer.testing import CliRunner

    from tfserve.cli import app

    result = CliRunner().invoke(app, ["chat", keyed_server.url, *args], input="hello\n",
                                env={"COLUMNS": "200", **env})
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"Error: {keyed_server.url} {said}"], result.output


def test_connect_to_nothing_raises_connection_lost():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionLost, match=f"cannot reach http://127.0.0.1:{port} — is `tfserve serve` running"):
        RemoteBackend(f"http://127.0.0.1:{port}/v1/").connect()


@pytest.mark.parametrize("url, why", [
    ("localhost:abc", "use host:port or http(s)://host:port[/v1]"), ("http://[::1", "use host:port"),
    ("ftp://x", "use host:port"), ("http://", "no host"), ("127.0.0.1:99999", "the port must be 1-65535"),
    ("0", "the port must be 1-65535"),
])
def test_a_url_that_is_no_url_is_a_usage_error(url, why):
    from tfserve.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(f"invalid URL {url!r}: {why}")):
        RemoteBackend(url)


class PlainWebServer(FakeHTTPServer):
    """No OpenAI API: 404 as an HTML page (python -m http.server), or with no body at all."""

    PAGE = (b'<!DOCTYPE HTML>\n<html lang="en">\n<head><title>Error response</title></head>\n<body>\n'
            b"<h1>Error response</h1>\n<p>Error code: 404</p>\n<p>Message: File not found.</p>\n</body></html>\n")

    def __init__(self, body: bytes = PAGE) -> None:
        class Handler(FakeHandler, BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send(404, "text/html", body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send(404, "text/html", body)

        super().__init__(Handler)


@pytest.mark.parametrize("body", [PlainWebServer.PAGE, b""])
def test_a_server_that_answers_in_html_is_one_readable_line(console, body):
    web = PlainWebServer(body)
    try:
        with pytest.raises(ServerError) as caught:  # at start: what the CLI prints
            RemoteBackend(web.url).connect()
        assert str(caught.value) == f"{web.url} does not answer /v1/models as an OpenAI-compatible server (404)"
        session = ChatSession(RemoteBackend(web.url, model="m").connect(), console)  # a named model: chat tries
        assert not session.ask("hello")
    finally:
        web.close()
    out = " ".join(console.file.getvalue().split())
    assert ("Error: server error 404 (Not Found) from POST /v1/chat/completions: is this an OpenAI-compatible "
            "server?") in out
    assert "<" not in out and "Error code" not in out


def test_a_web_page_for_every_path_is_one_line():
    class Handler(FakeHandler, BaseHTTPRequestHandler):  # a single-page app: 200 and its HTML for any path
        def do_GET(self) -> None:
            self.send(200, "text/html", b"<!DOCTYPE html><html><body>app</body></html>")

    web = FakeHTTPServer(Handler)
    try:
        with pytest.raises(ChatError, match=re.escape(f"{web.url}'s /v1/models is not an OpenAI model list")):
            RemoteBackend(web.url).connect()
    finally:
        web.close()


def test_a_json_error_message_is_kept():
    import httpx2
    import openai

    from tfserve.chat.client import describe

    request = httpx2.Request("POST", "http://h/v1/chat/completions")
    for body, said in [({"error": {"message": "overloaded, try later"}}, "overloaded, try later"),
                       ({"detail": "Not Found"}, "Not Found"), ("upstream timed out", "upstream timed out")]:
        response = httpx2.Response(503, request=request, json=body if isinstance(body, dict) else None,
                                   text=body if isinstance(body, str) else None)
        error = describe(openai.APIStatusError("Error code: 503", response=response, body=body))
        assert str(error) == f"server error 503: {said}" and error.detail == said
    bare = describe(openai.APIStatusError("Error code: 502", response=httpx2.Response(502, request=request),
                                          body=None))
    assert str(bare) == "server error 502 (Bad Gateway) from POST /v1/chat/completions"


def test_max_tokens_zero_is_refused_at_once():
    with pytest.raises(ValueError, match="max_tokens"):
        Settings(max_tokens=0)
    assert Settings(max_tokens=None).max_tokens is None  # unset: the default cap


def test_https_to_a_plain_http_server_says_to_use_http(plain_web_server):
    from typer.testing import CliRunner

    from tfserve.cli import app

    said = f"https://{plain_web_server} does not speak HTTPS (its answer is plain HTTP): use http://{plain_web_server}"
    with pytest.raises(ConnectionLost, match=re.escape(said)):
        RemoteBackend(f"https://{plain_web_server}").connect()
    url = f"https://{plain_web_server}"
    for command in (["chat", url], ["bench", "serve", "--url", url]):
        result = CliRunner().invoke(app, command, input="hello\n", env={"COLUMNS": "200"})
        assert result.exit_code == 1
        assert [line for line in result.output.splitlines() if line.strip()] == [f"Error: {said}"], result.output


def test_error_lines_wrap_between_words_on_a_terminal(monkeypatch):
    """A terminal wraps them at word boundaries (left to the terminal, a long line breaks mid-word); a pipe or a
    file still gets one line."""
    import io

    from rich.console import Console

    from tfserve.chat.backend import ContextFull
    from tfserve.cli import output

    message = str(ContextFull(8192))
    words = set(f"Error: {message}".split())

    def terminal() -> Console:
        return Console(file=io.StringIO(), width=30, force_terminal=True, color_system=None)

    session = ChatSession(None, terminal())
    session.error(message)
    monkeypatch.setattr(output, "err_console", terminal())
    output.error(message)
    for out in (session.console.file.getvalue(), output.err_console.file.getvalue()):
        lines = out.splitlines()
        assert len(lines) > 3 and all(len(line) <= 30 for line in lines), out
        assert all(word in words for line in lines for word in line.split()), out  # no word cut in two
    piped = ChatSession(None, Console(file=io.StringIO(), width=30, force_terminal=False))
    piped.error(message)
    assert piped.console.file.getvalue() == f"Error: {message}\n"
