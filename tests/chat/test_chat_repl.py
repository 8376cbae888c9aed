"""The REPL against a live tiny server: typed keys in through prompt-toolkit's pipe input, what rich prints
captured as text. Every slash command, multiline input, Ctrl-C / Ctrl-D at the prompt, history."""

from __future__ import annotations

import json
import re

from tiny import MODEL_NAME, run_keys

from tfserve.chat.backend import ReplyStats
from tfserve.chat.conversation import Settings
from tfserve.chat.session import ChatSession


def test_streamed_answer_appears_with_footer(session):
    out = run_keys(session, "hello\r/exit\r")
    assert "tfserve chat" in out and MODEL_NAME in out and "/help" in out  # the banner
    user, assistant = session.conversation.turns
    assert user == {"role": "user", "content": "hello"} and assistant["role"] == "assistant"
    assert assistant["content"]
    for word in re.findall(r"[A-Za-z]{3,}", assistant["content"]):
        assert word in out
    assert re.search(r"8 tokens · [0-9.]+ tok/s · TTFT \d+ ms", out), out


class ScriptedBackend:
    """A backend that streams fixed pieces: rendering tests need no model."""

    label = "scripted"

    def __init__(self, pieces: list[str]) -> None:
        self.model, self.pieces, self.sent = "scripted", pieces, []

    def list_models(self) -> list[str]:
        return ["scripted"]

    def stream(self, messages, settings):
        self.sent.append(messages)
        pieces = self.pieces

        class Reply:
            stats = ReplyStats(num_prompt_tokens=3, num_completion_tokens=len(pieces), finish_reason="stop")

            def __iter__(self):
                return iter(pieces)

            def close(self):
                pass

        return Reply()

    def close(self) -> None:
        pass


def test_reply_is_rendered_as_markdown(console):
    pieces = ["# Title\n\n", "Some **bold** text.\n\n", "```python\n", "print(1)\n", "```\n"]
    session = ChatSession(ScriptedBackend(pieces), console)
    out = run_keys(session, "show me\r/exit\r")
    assert "Title" in out and "bold" in out and "print(1)" in out
    assert "```" not in out and "**" not in out
    assert "5 tokens" in out


def test_esc_enter_adds_a_line_and_enter_sends(console):
    backend = ScriptedBackend(["ok"])
    session = ChatSession(backend, console)
    run_keys(session, "line one\x1b\rline two\r/exit\r")
    assert backend.sent == [[{"role": "user", "content": "line one\nline two"}]]


def test_ctrl_c_at_prompt_clears_the_line_and_ctrl_d_exits(console, tfserve_home):
    backend = ScriptedBackend(["ok"])
    session = ChatSession(backend, console)
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from tfserve.chat.repl import run_repl

    with create_pipe_input() as pipe:
        pipe.send_text("never sent\x03kept\r\x04")
        run_repl(session, input=pipe, output=DummyOutput())  # the real FileHistory in $TFSERVE_HOME
    assert backend.sent == [[{"role": "user", "content": "kept"}]]
    history = (tfserve_home / "chat_history").read_text()
    assert "+kept" in history and "never sent" not in history


def test_help_lists_every_command(session):
    from tfserve.chat.commands import COMMANDS

    out = run_keys(session, "/help\r/quit\r")
    for name in COMMANDS:
        assert name in out
    assert "Esc-Enter" in out


def test_unknown_command_sends_nothing(session, server):
    before = server.state.metrics.requests.labels("/v1/chat/completions", "200")._value.get()
    out = run_keys(session, "/nonsense here\r/exit\r")
    assert "unknown command /nonsense" in out and "/help" in out
    assert session.conversation.turns == []
    assert server.state.metrics.requests.labels("/v1/chat/completions", "200")._value.get() == before


def test_double_slash_sends_a_message_starting_with_slash(console):
    backend = ScriptedBackend(["ok"])
    run_keys(ChatSession(backend, console), "//etc/hosts?\r/exit\r")
    assert backend.sent[0][-1]["content"] == "/etc/hosts?"


def test_set_and_settings(session):
    out = run_keys(session, "/set temperature 0.5\r/set seed 7\r/set seed none\r/set top_p 2\r/set bogus 1\r"
                            "/set max_tokens many\r/set temperature\r/set temperature 3\r/settings\r/exit\r")
    assert session.settings == Settings(temperature=0.5, max_tokens=8)
    assert "temperature = 0.5" in out and "seed = 7" in out and "seed = None" in out
    assert "Error: top_p must be in [0, 1]" in out
    assert "Error: temperature must be in [0, 2]" in out  # what servers take: past it every message would fail
    assert "Error: unknown setting 'bogus'" in out
    keys = re.search(r"unknown setting 'bogus'; one of (.*)", out).group(1)
    assert "approve" in keys and "tool_choice" in keys  # every key /set takes, as `/set` alone lists them
    assert "Error: max_tokens must be an integer (got 'many')" in out
    assert "Error: usage: /set KEY VALUE" in out
    settings_table = out[out.rindex("model"):]
    assert MODEL_NAME in settings_table and re.search(r"temperature\s+0.5", settings_table)
    assert re.search(r"seed\s+default", settings_table)


def test_system_prompt_is_sent_and_survives_clear(console):
    backend = ScriptedBackend(["ok"])
    session = ChatSession(backend, console)
    out = run_keys(session, "/system Be brief.\rhi\r/clear\ragain\r/system\rthird\r/exit\r")
    system = {"role": "system", "content": "Be brief."}
    assert backend.sent[0] == [system, {"role": "user", "content": "hi"}]
    assert backend.sent[1] == [system, {"role": "user", "content": "again"}]  # /clear kept the system prompt
    assert backend.sent[2][0]["role"] == "user" and len(backend.sent[2]) == 3  # /system alone removed it
    assert "System prompt set." in out and "New conversation." in out and "System prompt removed." in out


def test_retry_regenerates_the_last_answer(session):
    session.settings = Settings(temperature=1.0, max_tokens=8)
    out = run_keys(session, "/retry\rhello\r/retry\r/exit\r")
    assert "Error: nothing to retry yet" in out
    assert [turn["role"] for turn in session.conversation.turns] == ["user", "assistant"]
    assert session.stats.num_replies == 2 and out.count("TTFT") == 2


def test_models_and_model(session):
    out = run_keys(session, "/models\r/model\r/model nope\r/model tiny-llama\r/exit\r")
    assert f"* {MODEL_NAME}" in out
    assert "Error: no model 'nope' here; /models lists them" in out
    assert f"Model: {MODEL_NAME}" in out and session.backend.model == MODEL_NAME


def test_stats(session):
    out = run_keys(session, "hello\r/stats\r/exit\r")
    assert "replies" in out and "1 (0 cancelled, 0 failed)" in out
    assert re.search(r"tokens generated\s+8", out)
    assert re.search(r"context\s+\d+ tokens", out) and "median" in out and "tok/s" in out


def test_save_and_load_round_trip(session, tmp_path):
    path = tmp_path / "talk.json"
    out = run_keys(session, f"/system Be brief.\rhello\r/save {path}\r/clear\r/set temperature 1\r"
                            f"/load {path}\r/exit\r")
    assert "Saved 2 messages" in out and "Loaded 2 messages" in out
    data = json.loads(path.read_text())
    assert data["model"] == MODEL_NAME and data["settings"]["max_tokens"] == 8
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    assert session.conversation.messages() == data["messages"]
    assert session.settings == Settings(temperature=0.0, max_tokens=8)  # the file's settings, not /set's

    out = run_keys(session, "and again\r/exit\r")
    assert [t["role"] for t in session.conversation.turns] == ["user", "assistant", "user", "assistant"]


def test_load_errors_are_one_line(session, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    out = run_keys(session, f"/load {tmp_path / 'missing.json'}\r/load {bad}\r/load {binary}\r/save\r/load\r"
                            "/exit\r")
    assert "Error: cannot read" in out and "No such file" in out
    assert f"Error: {bad} is not JSON" in out
    assert f"Error: {binary} is not UTF-8 text" in out
    assert "Error: usage: /save FILE" in out and "Error: usage: /load FILE" in out


def test_completion_of_commands_and_arguments():
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document

    from tfserve.chat.repl import SlashCompleter

    completer = SlashCompleter([MODEL_NAME])

    def complete(text: str) -> list[str]:
        return [c.text for c in completer.get_completions(Document(text), CompleteEvent(completion_requested=True))]

    assert complete("/sa") == ["/save"]
    assert set(complete("/s")) == {"/system", "/set", "/settings", "/save", "/stats"}
    assert complete("/set te") == ["temperature"]
    assert complete("/model ti") == [MODEL_NAME]
    assert complete("hello /sa") == [] and complete("sa") == []


def test_a_reasoning_models_thinking_is_shown_apart_and_not_kept(console):
    from tfserve.chat.backend import Thinking

    pieces = [Thinking("Let me think"), Thinking(" about it."), "The answer ", "is 42."]
    session = ChatSession(ScriptedBackend(pieces), console)
    out = run_keys(session, "question\r/exit\r")
    assert "Let me think about it." in out and "The answer is 42." in out
    assert out.index("Let me think") < out.index("The answer")
    assert session.conversation.turns[-1] == {"role": "assistant", "content": "The answer is 42."}


def test_reasoning_content_deltas_become_thinking():
    from types import SimpleNamespace

    from tfserve.chat.backend import Thinking
    from tfserve.chat.client import _RemoteReply

    def chunk(finish=None, **delta):
        return SimpleNamespace(usage=None, choices=[SimpleNamespace(finish_reason=finish,
                                                                    delta=SimpleNamespace(**{"content": None, **delta}))])

    stream = [chunk(reasoning_content="hmm"), chunk(reasoning="vllm-style"), chunk(content="ok", finish="stop")]
    deltas = list(_RemoteReply(stream))
    assert deltas == ["hmm", "vllm-style", "ok"]
    assert [type(d) for d in deltas] == [Thinking, Thinking, str]
