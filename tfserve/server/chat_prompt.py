"""What a chat request's prompt is made of, shared by chat completions, responses and the server-side tool loop:
the client's function `tools`, the template variables, and the prompt ids through the model's chat template
(with images: through the engine's processor)."""

from __future__ import annotations

import functools
import json
from typing import Any

from tfserve.protocol import chat_template
from tfserve.protocol.chat_template import RENDER_ARGUMENTS, ChatTemplateError, has_chat_template
from tfserve.server.errors import bad_request
from tfserve.server.media import no_images, takes_images
from tfserve.server.protocol import check_name, check_schema, field
from tfserve.server.runtime.threads import in_daemon_thread
from tfserve.server.tools.tool_choice import tool_choice_of


def parse_tools(body: dict[str, Any], legacy: bool = False) -> list[dict[str, Any]] | None:
    """`tools` for the chat template, or None when absent or `tool_choice` is "none". `legacy`: the tools are the
    legacy `functions` (chat_functions.as_tools), named as such in a 400 (`functions[0].name`)."""
    tools = field(body, "tools", list)
    tool_choice = tool_choice_of(body)
    if not tools:
        refuse_tool_choice_without_tools(body)
        return None
    names = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "mcp":  # run by the server (chat_mcp checks them)
            continue
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools[{i}]")
        names.append(check_function(tool["function"], f"functions[{i}]" if legacy else f"tools[{i}].function"))
    check_function_names(names)
    return None if tool_choice.mode == "none" else tools


def check_function(function: dict[str, Any], where: str) -> tuple[str, str]:
    """400 for a function tool's fields as OpenAI checks them (chat's `function`, the Responses API's flat
    tool): a name, a string description, a bool `strict`, and `parameters` that are an object's schema (a
    call's arguments are a JSON object: a string schema made them no JSON at all). Returns (name, its field)."""
    name = field(function, "name", str, required=True, param=f"{where}.name")
    field(function, "description", str, param=f"{where}.description")
    field(function, "strict", bool, param=f"{where}.strict")
    parameters = field(function, "parameters", dict, param=f"{where}.parameters")
    check_schema(parameters, f"{where}.parameters")
    kind = (parameters or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise bad_request(f"{where}.parameters must be the schema of an object, a call's arguments (got type "
                          f"{kind!r})", f"{where}.parameters")
    return name, f"{where}.name"


def check_function_names(names: list[tuple[str, str]]) -> None:
    """400 for a function name OpenAI refuses (1 to 64 letters, digits, _ or -) or one given twice; `names`:
    (name, its field) of the request's function tools."""
    seen = set()
    for name, where in names:
        check_name(name, where)
        if name in seen:
            raise bad_request(f"{where}: the function {name!r} is defined twice; tool names must be unique", where)
        seen.add(name)


def refuse_tool_choice_without_tools(body: dict[str, Any], mcp: bool = False) -> None:
    """400 for a `tool_choice` that asks for a call ("required", a named function) with no tools to call (as
    OpenAI: it is only allowed when tools are specified), once its shape is checked. An `mcp` choice with mcp
    tools is theirs to check."""
    tool_choice = tool_choice_of(body)
    if not tool_choice.asks_for_call or (mcp and (tool_choice.sent == "required" or tool_choice.mcp is not None
                                                   or tool_choice.allowed is not None)):
        return
    raise bad_request("tool_choice asks for a tool call but the request has no tools: it is only allowed when "
                      "tools are specified", "tool_choice")


def template_arguments(arguments: Any, where: str) -> Any:
    """A past tool call's `arguments` (field `where`) as chat templates take them: the object its JSON string
    holds (HF's convention), else the string as sent, which OpenAI takes back too (a call that max_tokens cut
    short, a model's malformed JSON): the template writes it as the model wrote it."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise bad_request(f"{where} must be a string, not {type(arguments).__name__}", where)
    try:
        value = json.loads(arguments or "{}")
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


def template_kwargs(state: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Extra chat template variables: the server's defaults (--chat-template-kwargs, --reasoning) updated by the
    request's `chat_template_kwargs` object (e.g. {"enable_thinking": false})."""
    requested = field(body, "chat_template_kwargs", dict, {})
    reserved = sorted(RENDER_ARGUMENTS.intersection(requested))
    if reserved:  # e.g. padding + max_length would pad the prompt to any length
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: it holds template variables, "
                          "not arguments of apply_chat_template", f"chat_template_kwargs.{reserved[0]}")
    return {**state.chat_template_kwargs, **requested}


def render_options(body: dict[str, Any]) -> dict[str, bool]:
    """vLLM's `add_generation_prompt` and `continue_final_message` (transformers' arguments): the latter leaves
    the last message open for the model to continue (an assistant prefill) and so turns the generation prompt
    off unless the client turns it on too, which is a 400."""
    continue_final_message = field(body, "continue_final_message", bool, False)
    add_generation_prompt = field(body, "add_generation_prompt", bool, not continue_final_message)
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message cannot be true with add_generation_prompt true: the final "
                          "message is continued, no new one is started", "continue_final_message")
    return {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}


# Text up to this size renders and tokenizes in about a millisecond, on the event loop; a longer prompt (up to
# the body limit: megabytes, seconds of work) goes to a thread, so other requests and streams go on meanwhile.
INLINE_PROMPT_CHARS = 32_000


def text_chars(messages: list[dict]) -> int:
    """Characters of the messages' contents (a list of parts counted as written)."""
    return sum(len(str(message.get("content") or "")) for message in messages)


async def render_chat(tokenizer: Any, messages: list[dict], tools: list | None,
                      template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, param: str = "messages") -> list[int]:
    """The prompt's token ids through the model's chat template (`tfserve.protocol.chat_template`); a model
    without one, or a template that rejects the messages, is the client's 400 naming `param` (the body field
    the messages came from)."""
    if not has_chat_template(tokenizer):
        raise bad_request("the served model has no chat template; use /v1/completions, or give the server one "
                          "(tfserve serve --chat-template FILE)", param)

    def render(kwargs: dict[str, Any] | None = template_kwargs) -> list[int]:
        return chat_template.render_chat(tokenizer, messages, tools, kwargs,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message)

    def render_or_400() -> list[int]:
        try:
            return render()
        except ChatTemplateError as exc:
            raise bad_request(str(exc), _culprit(render, template_kwargs, param)) from None

    if text_chars(messages) < INLINE_PROMPT_CHARS:
        return render_or_400()
    return await in_daemon_thread(render_or_400)


def _culprit(render: Any, template_kwargs: dict[str, Any] | None, param: str) -> str:
    """The field a template error is about: `chat_template_kwargs` (its key, when one alone is to blame) where
    the messages render without them, else the messages' field."""
    if not template_kwargs:
        return param
    try:
        render({})
    except ChatTemplateError:
        return param
    for key in template_kwargs:
        try:
            render({key: template_kwargs[key]})
        except ChatTemplateError:
            return f"chat_template_kwargs.{key}"
    return "chat_template_kwargs"


async def render_multimodal(state: Any, messages: list[dict], images: list, tools: list | None,
                            template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, param: str = "messages") -> tuple[list[int], Any]:
    """`render_chat` for a conversation with images (`messages` hold `{"type": "image"}` parts, `images` the
    MediaImages in the same order): the engine's `render_multimodal` makes the prompt ids and what its vision
    side needs (`mm`, for `admit`), in a thread of its own (a processor resizes and normalises pixels). A model
    without a processor, a template or processor that rejects the request: a 400."""
    engine = state.engine
    if not takes_images(engine):
        raise no_images(state.model_name, images[0].where)
    try:
        # on a thread that ends: processors run torch, whose OpenMP workers would outlive a pooled thread
        return await in_daemon_thread(functools.partial(
            engine.render_multimodal, messages, images, tools=tools, template_kwargs=template_kwargs,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message))
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param) from None
    except ValueError as exc:  # e.g. more images than the model takes, a shape its processor refuses: the images'
        message = str(exc)
        if not message.startswith(images[0].where):  # the processor's own words name no part: say which
            message = f"{images[0].where}: {message}"
        raise bad_request(message, images[0].where) from None
