"""The in-process chat reads a reply with the server's own parser: a reasoning model's thinking comes apart from
the answer, and calls end the reply as the server ends them. Engine outputs made by hand, no model."""

from __future__ import annotations

import queue

from tfserve.chat.backend import ReplyStats, Thinking
from tfserve.chat.local import _LocalReply
from tfserve.engine.request import RequestOutput
from tfserve.protocol.reasoning import START, THINK, Reasoning
from tfserve.protocol.reply import ReplyParser
from tfserve.protocol.tool_formats import HERMES


class Manager:
    def abort(self, request_id):
        raise AssertionError("a finished request is not aborted")


def reply_of(pieces: list[str], parser: ReplyParser, finish_reason: str = "stop") -> _LocalReply:
    outputs = queue.SimpleQueue()
    for i, piece in enumerate(pieces):
        outputs.put(RequestOutput("r", [1], list(range(i + 1)), "", delta_text=piece,
                                  finish_reason=finish_reason if i == len(pieces) - 1 else None))
    return _LocalReply(Manager(), "r", outputs, ReplyStats(num_prompt_tokens=3), parser)


def test_thinking_comes_apart_from_the_answer():
    reply = reply_of(["<think>", "Say hi.", "</think>\n\n", "Hi!"], ReplyParser(reasoning=Reasoning(THINK, START)))
    deltas = list(reply)
    assert [d for d in deltas if isinstance(d, Thinking)] == ["Say hi."]
    assert "".join(d for d in deltas if not isinstance(d, Thinking)) == "Hi!"
    assert reply.stats.finish_reason == "stop" and reply.stats.tool_calls == []
    reply.close()


def test_max_tokens_that_cut_only_the_next_calls_marker_ends_with_tool_calls():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    reply = reply_of([call, "\n<tool_"], ReplyParser(HERMES), finish_reason="length")
    assert "".join(reply) == ""  # the cut marker is markup, not text
    assert [c["function"]["name"] for c in reply.stats.tool_calls] == ["add"]
    assert reply.stats.finish_reason == "tool_calls"  # as the server says: every call shown is whole
    reply.close()
