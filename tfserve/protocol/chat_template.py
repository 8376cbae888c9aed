"""Chat messages -> prompt token ids through the model's chat template: the one renderer behind the server's
chat endpoints and the in-process chat. Errors are `ChatTemplateError`s (a ValueError) for the caller to
word: the server answers 400, the chat prints one line."""

from __future__ import annotations

import json
from typing import Any

from tfserve.errors import ChatTemplateError

__all__ = ["RENDER_ARGUMENTS", "ChatTemplateError", "describe_tools", "has_chat_template", "reads_tools",
           "render_chat"]

# arguments of `apply_chat_template` (and the template's own `messages`): never template variables
RENDER_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer carries a chat template (base models often have none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[dict], tools: list | None = None,
                template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> list[int]:
    """The prompt's token ids: `messages` (and `tools`) through the model's chat template, ending with the
    assistant's generation prompt (unless `add_generation_prompt` is False), or with `continue_final_message`
    the last message left open for the model to continue (an assistant prefill; transformers' argument, which
    leaves out the generation prompt). `template_kwargs` become template variables; they cannot change how the
    prompt is rendered to ids (a caller should reject RENDER_ARGUMENTS among them)."""
    from jinja2 import TemplateError

    if not has_chat_template(tokenizer):
        raise ChatTemplateError("the model has no chat template")
    if tools and not reads_tools(tokenizer):  # the model would never see them: described in its messages
        try:
            return render_chat(tokenizer, describe_tools(messages, tools), None, template_kwargs,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message)
        except ChatTemplateError:  # a template without a system turn: the tools open the first user message
            return render_chat(tokenizer, describe_tools(messages, tools, system=False), None, template_kwargs,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message)
    kwargs = {**(template_kwargs or {}), "tools": tools,
              "add_generation_prompt": add_generation_prompt and not continue_final_message,
              "continue_final_message": continue_final_message, "tokenize": True, "return_dict": True,
              "return_tensors": None, "chat_template": None}
    try:
        rendered = tokenizer.apply_chat_template(messages, **kwargs)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def reads_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders `tools` (SmolLM2's, like many, never reads them)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    return "tools" in template


# Qwen 2.5's words for its Hermes tool format (what the server's parser reads from a template that names none)
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML \
tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def describe_tools(messages: list[dict], tools: list, system: bool = True) -> list[dict]:
    """`messages` for a template that ignores `tools`: the tools described in the system message (or, with
    `system` False, at the start of the first user message), the assistant's calls written as `<tool_call>`
    blocks and the tools' results as `<tool_response>` blocks in a user turn, as Qwen 2.5's template writes them."""
    block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    result: list[dict] = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if message.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps(_call(call), ensure_ascii=False) + "\n</tool_call>"
                              for call in message["tool_calls"])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = _joined(content, calls)
        elif role == "tool":
            response = f"<tool_response>\n{_text(content)}\n</tool_response>"
            if result and result[-1].get("role") == "user" and _text(result[-1].get("content")).endswith(
                    "</tool_response>"):  # one user turn holds the results of one round of calls
                result[-1] = {**result[-1], "content": _joined(result[-1]["content"], response)}
                continue
            message = {"role": "user", "content": response}
        result.append(message)
    if system and result and result[0].get("role") == "system":
        result[0] = {**result[0], "content": _joined(result[0].get("content"), block, "\n\n")}
    elif system:
        result.insert(0, {"role": "system", "content": block})
    else:
        first = next((i for i, m in enumerate(result) if m.get("role") == "user"), None)
        if first is None:
            result.insert(0, {"role": "user", "content": block})
        else:
            result[first] = {**result[first], "content": _joined(block, result[first].get("content"), "\n\n")}
    return result


def _call(call: dict) -> dict:
    """{"name", "arguments"} of an OpenAI-style call (arguments a mapping, or its JSON text)."""
    function = call.get("function", call)
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"name": function.get("name"), "arguments": arguments}


def _text(content: Any) -> str:
    """A message's content as text (its text parts, where it is a list of parts)."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def _joined(first: Any, second: Any, separator: str = "\n") -> Any:
    """`first` then `second`: text joined, or a list of parts with the text added as a part."""
    if isinstance(first, list):
        return [*first, {"type": "text", "text": separator + _text(second)}]
    if isinstance(second, list):
        return [{"type": "text", "text": _text(first) + separator}, *second]
    first, second = _text(first), _text(second)
    return first + separator + second if first and second else first or second
