"""A conversation that fills the model's context: one line that says so and what to do, the message that got no
answer kept for /retry (never a silent "1 token" footer), and a reply the context cut short kept with a note."""

from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler

import pytest
from tiny import MODEL_NAME, FakeHandler, FakeHTTPServer, run_keys
from typer.testing import CliRunner

from tfserve.chat.client import RemoteBackend
from tfserve.chat.conversation import Conversation, Settings
from tfserve.chat.local import LocalBackend
from tfserve.chat.session import ChatSession
from tfserve.cli import app

FULL = ("the conversation fills the model's {}-token context, so your message got no answer: /clear, or /save and "
        "start over")


class NearlyFullServer(FakeHTTPServer):
    """A server whose 8192-token context the conversation nearly fills, as the audit saw it: the default cap
    (max_tokens 1024) is refused as OpenAI and tfserve refuse it; without max_tokens the reply is what the context
    leaves, `pieces` then "length"."""

    def __init__(self, pieces: list[str], num_prompt_tokens: int = 8191) -> None:
        self.requests: list[dict] = []
        requests = self.requests

        class Handler(FakeHandler, BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_json(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                requests.append(body)
                if "max_tokens" in body:
                    return self.send_json(400, {"error": {
                        "message": f"This model's maximum context length is 8192 tokens. However, you requested "
                                   f"{num_prompt_tokens + body['max_tokens']} tokens ({num_prompt_tokens} in the "
                                   f"prompt, {body['max_tokens']} in max_tokens): lower max_tokens or shorten the "
                                   "prompt",
                        "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}})
                events = [{"index": 0, "delta": {"content": piece},
                           "finish_reason": "length" if i == len(pieces) - 1 else None}
                          for i, piece in enumerate(pieces)]
                chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [event]}
                          for event in events]
                chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
                               "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": len(pieces),
                                         "total_tokens": num_prompt_tokens + len(pieces)}})
                data = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
                self.send(200, "text/event-stream", data.encode())

        super().__init__(Handler)


@pytest.fixture
def nearly_full():
    servers = []

    def start(pieces: list[str]) -> NearlyFullServer:
        servers.append(NearlyFullServer(pieces))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_a_reply_of_nothing_because_the_context_is_full_says_so_and_keeps_the_message(nearly_full, console, tmp_path):
    server = nearly_full([""])  # one token, no text: what a nearly full context gave
    session = ChatSession(RemoteBackend(server.url).connect(), console)
    session.conversation = Conversation(turns=[{"role": "user", "content": "long"},
                                               {"role": "assistant", "content": "story"}])
    out = run_keys(session, f"and then?\r/stats\r/save {tmp_path / 'chat.json'}\r/exit\r")
    assert "max_tokens" in server.requests[0] and "max_tokens" not in server.requests[1]  # the context was asked
    assert f"Error: {FULL.format(8192)}" in out
    assert not re.search(r"^1 token\b", out, re.M)  # no footer of a reply that is none
    assert session.unanswered == "and then?"  # not lost: /retry sends it again
    assert [turn["content"] for turn in session.conversation.turns] == ["long", "story"]
    assert session.stats.num_errors == 1 and session.stats.num_replies == 0
    assert re.search(r"tokens generated\s+1\b", out)  # the token it made still counts
    assert "Saved 2 messages" in out


def test_a_reply_the_context_cut_short_is_kept_with_a_note(nearly_full, console):
    server = nearly_full(["It", " was", " a"])
    session = ChatSession(RemoteBackend(server.url).connect(), console)
    assert session.ask("and then?")
    out = console.file.getvalue()
    assert session.conversation.turns[-1] == {"role": "assistant", "content": "It was a"}
    assert "3 tokens" in out
    assert ("The reply stopped where the model's 8192-token context ends: /clear, or /save and start over, before "
            "the next message.") in out
    assert session.stats.num_errors == 0


def test_a_reply_capped_by_max_tokens_has_no_such_note(session):
    assert session.ask("hello")  # the tiny server, max_tokens 8: cut by "length", but not the context's doing
    assert "8 tokens" in session.console.file.getvalue()
    assert "The reply stopped" not in session.console.file.getvalue()


@pytest.mark.parametrize("where", ["server", "in-process"])
def test_a_conversation_longer_than_the_context_is_one_line_and_clear_starts_over(where, backend, async_engine,
                                                                                  console):
    if where == "in-process":
        backend = LocalBackend(async_engine.manager, MODEL_NAME)
    session = ChatSession(backend, console, settings=Settings(temperature=0.0))  # max_tokens left to the context
    session.conversation.add("user", "hello world " * 300)  # ~600 tokens; the tiny model's context is 512
    session.conversation.add("assistant", "ok")
    out = run_keys(session, "one more\r/clear\rone more\r/exit\r")
    assert f"Error: {FULL.format(512)}" in out and "Traceback" not in out
    assert session.stats.num_errors == 1 and session.stats.num_replies == 1  # after /clear it answered
    assert [turn["role"] for turn in session.conversation.turns] == ["user", "assistant"]


def test_piped_chat_with_a_full_context_exits_1(nearly_full):
    server = nearly_full([""])
    result = CliRunner().invoke(app, ["chat", server.url], input="hello\n", env={"COLUMNS": "300"})
    assert result.exit_code == 1
    assert FULL.format(8192) in result.stderr and result.stdout == ""
