"""A streamed Response's items finish in order: each item's done events go out before the next item is added,
as OpenAI streams them (a turn's message before its call, one call before the next), and text after a call is
a message of its own. Driven with engine outputs made by hand, no model."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from tfserve.protocol.tool_formats import HERMES
from tfserve.server.api.response_output import ResponseOutput

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


@dataclass
class Output:
    delta_text: str
    finished: bool = False
    finish_reason: str | None = None
    delta_tokens: list = field(default_factory=lambda: [1])
    delta_logprobs: list | None = None


class Events:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send(self, data: dict, event: str | None = None) -> None:
        self.sent.append(data)


def turn(chunks: list[str]) -> tuple[ResponseOutput, list[dict]]:
    """One turn of `chunks` (text deltas, the last one finishing it) through a streamed ResponseOutput."""
    output = ResponseOutput("m", {}, None)
    output.sse = Events()
    output.begin_turn(HERMES, None)

    async def outputs():
        for i, text in enumerate(chunks):
            last = i == len(chunks) - 1
            yield 0, Output(text, finished=last, finish_reason="tool_calls" if last else None)

    async def main():
        await output.end_turn(await output.run_turn(outputs()))

    asyncio.run(main())
    return output, output.sse.sent


def lifecycle(events: list[dict]) -> list[tuple[str, int]]:
    return [(e["type"].removeprefix("response.output_item."), e["output_index"]) for e in events
            if e["type"] in ("response.output_item.added", "response.output_item.done")]


def test_each_item_is_done_before_the_next_is_added():
    output, events = turn(["Let me look.", "\n<tool_call>\n", '{"name": "get_weather", "arguments": ',
                           '{"city": "Paris"}}\n</tool_call>\n', CALL % "Rome"])
    assert lifecycle(events) == [("added", 0), ("done", 0), ("added", 1), ("done", 1), ("added", 2), ("done", 2)]
    message, first, second = output.items
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me look."
    assert [json.loads(c["arguments"])["city"] for c in (first, second)] == ["Paris", "Rome"]
    assert all(item["status"] == "completed" for item in output.items)
    text_done = next(i for i, e in enumerate(events) if e["type"] == "response.output_text.done")
    call_added = next(i for i, e in enumerate(events) if e["type"] == "response.output_item.added"
                      and e["item"]["type"] == "function_call")
    assert text_done < call_added
    (said,) = output.messages
    assert said["content"] == "Let me look." and len(said["tool_calls"]) == 2


def test_text_after_a_call_is_a_message_of_its_own():
    output, events = turn([CALL % "Paris", "\nDone: that is all."])
    assert [item["type"] for item in output.items] == ["function_call", "message"]
    assert lifecycle(events) == [("added", 0), ("done", 0), ("added", 1), ("done", 1)]
    assert output.items[1]["content"][0]["text"].strip() == "Done: that is all."
    assert output.messages[0]["content"].strip() == "Done: that is all."
