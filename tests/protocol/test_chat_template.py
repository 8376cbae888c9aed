"""Chat templates that never read `tools` (SmolLM2's, the default model's) still show the model its tools: they are
described in the messages, in the Hermes format the server's tool-call parser reads."""

from __future__ import annotations

import copy

import pytest

from tfserve.protocol.chat_template import reads_tools, render_chat
from tiny import build_tokenizer

SMOLLM2_TEMPLATE = (  # the default model's own template: no `tools` anywhere
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NO_SYSTEM_TEMPLATE = (  # as Gemma 2's: a system turn is refused
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def base():
    return build_tokenizer()


def with_template(tokenizer, template):
    other = copy.copy(tokenizer)
    other.chat_template = template
    return other


def text(tokenizer, messages, tools):
    return tokenizer.decode(render_chat(tokenizer, messages, tools))


def test_a_template_without_tools_gets_them_described_in_the_system_turn(base):
    tokenizer = with_template(base, SMOLLM2_TEMPLATE)
    assert not reads_tools(tokenizer)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    plain, described = text(tokenizer, question, None), text(tokenizer, question, TOOLS)
    assert "get_weather" not in plain and "<tools>" not in plain
    assert described.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in described
    assert "<tool_call></tool_call> XML tags" in described and described.endswith("<|im_start|>assistant\n")
    with_system = text(tokenizer, [{"role": "system", "content": "Be brief."}, *question], TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")


def test_calls_and_results_in_the_history_are_written_as_the_parser_reads_them(base):
    tokenizer = with_template(base, SMOLLM2_TEMPLATE)
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    rendered = text(tokenizer, messages, TOOLS)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
            '<|im_end|>') in rendered
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
            "</tool_response><|im_end|>") in rendered  # one user turn for the round's results
    assert "<|im_start|>tool" not in rendered


def test_a_template_that_refuses_a_system_turn_gets_them_in_the_first_user_turn(base):
    tokenizer = with_template(base, NO_SYSTEM_TEMPLATE)
    rendered = text(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert rendered.startswith("<start_of_turn>user\n# Tools") and rendered.rstrip().endswith(
        "</tool_call>\n\nWeather in Paris?<end_of_turn>")


def test_a_template_that_reads_tools_renders_them_itself(base):
    assert reads_tools(base)  # the test models' template writes "Tools: [...]"
    rendered = text(base, [{"role": "user", "content": "hi"}], TOOLS)
    assert rendered.startswith("<|im_start|>system\nTools: [") and "# Tools" not in rendered
