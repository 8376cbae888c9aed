"""POST /v1/chat/completions' body, typed: OpenAI's `ChatCompletionCreateParams` (and vLLM's extensions), its
messages read into what the chat template takes, its tools and `tool_choice` checked, the legacy `functions`
read as tools."""

from __future__ import annotations

from dataclasses import dataclass, field as dataclass_field
from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, field_validator, model_validator

from tfserve.server.chat_prompt import parse_tools, render_options, template_arguments
from tfserve.server.errors import bad_request
from tfserve.server.media import ImageRef, content_of
from tfserve.server.protocol import field, json_type, one_of
from tfserve.server.requests.sampling import EFFORTS, CommonFields, MaxToolCalls, SamplingRequest
from tfserve.server.tools import chat_functions
from tfserve.server.tools.tool_choice import ToolChoice

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # function: a legacy call's result


@dataclass(slots=True)
class Messages:
    """A request's messages as the chat template takes them (text parts joined, developer -> system; a content
    with image parts stays a list of HF-style parts), and the image parts' refs in order of appearance."""

    rendered: list[dict[str, Any]]
    image_refs: list[ImageRef] = dataclass_field(default_factory=list)


class ChatCompletionRequest(SamplingRequest, CommonFields):
    """A chat completion request. `messages` is the parsed `Messages`; `function_tools` the tools for the
    template (None when absent or under tool_choice "none"); `legacy` whether it gave the legacy functions."""

    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")
    PROMPT_FIELD: ClassVar[str] = "messages"

    messages: Any = Field(None, validate_default=True)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = Field(None, validate_default=True)  # a ToolChoice, parsed once
    logprobs: bool | None = None
    top_logprobs: int | None = None
    echo: bool | None = None  # vLLM's: the reply's content starts with the last (assistant) message's text
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    modalities: list[Any] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    max_tool_calls: MaxToolCalls = None
    functions: list[dict[str, Any]] | None = None  # legacy: read as `tools` too (checked by chat_functions)
    function_call: Any = None  # legacy: read as `tool_choice`

    _tools: list[dict[str, Any]] | None = PrivateAttr(None)
    _render_options: dict[str, bool] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _legacy_functions(cls, body: Any) -> Any:
        """The legacy `functions` / `function_call` read as `tools` / `tool_choice` as well (kept, so the errors
        about them name what the client sent)."""
        return chat_functions.as_tools(body)[0] if isinstance(body, dict) else body

    @field_validator("messages", mode="before")
    @classmethod
    def _parse_messages(cls, messages: Any) -> Messages:
        return parse_messages(messages)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _parse_tool_choice(cls, tool_choice: Any) -> ToolChoice:
        return ToolChoice.parse(tool_choice)

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, modalities: list[Any] | None) -> list[Any] | None:
        for i, modality in enumerate(modalities or ()):
            one_of(modality if isinstance(modality, str) else repr(modality), ("text", "audio"), f"modalities[{i}]")
        if "audio" in (modalities or ()):
            raise bad_request("audio output is not supported: this server answers in text (leave out modalities "
                              "audio and the audio parameter)", "modalities")
        return modalities

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, audio: dict[str, Any] | None) -> None:
        if audio is not None:
            raise bad_request("audio output is not supported: this server answers in text (leave out modalities "
                              "audio and the audio parameter)", "audio")

    @field_validator("verbosity")
    @classmethod
    def _check_verbosity(cls, verbosity: str | None) -> str | None:
        return one_of(verbosity, ("low", "medium", "high"), "verbosity")

    @field_validator("reasoning_effort")
    @classmethod
    def _check_effort(cls, effort: str | None) -> str | None:
        return one_of(effort, EFFORTS, "reasoning_effort")

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if not self.has_mcp_tools:  # those are the tool loop's to check (chat_mcp)
            self._tools = parse_tools({"tools": self.tools, "tool_choice": self.tool_choice}, self.legacy)
        self._render_options = render_options({"continue_final_message": self.continue_final_message,
                                               "add_generation_prompt": self.add_generation_prompt})
        return self

    @property
    def legacy(self) -> bool:
        """True when the body gave the legacy `functions` / `function_call` (calls go back in that shape)."""
        return self.functions is not None

    @property
    def parameters_fields(self) -> dict[str, str] | None:
        """Function name -> the field of its parameters where the body gave legacy functions (None: its tools)."""
        return chat_functions.parameters_fields(self.functions) if self.legacy else None

    @property
    def has_mcp_tools(self) -> bool:
        """True when `tools` holds an MCP server's: the server runs those calls, in a loop of turns."""
        return any(isinstance(t, dict) and t.get("type") == "mcp" for t in self.tools or ())

    @property
    def function_tools(self) -> list[dict[str, Any]] | None:
        """The function tools the chat template shows (None: none, or tool_choice "none")."""
        return self._tools

    @property
    def num_top_logprobs(self) -> int | None:
        """`logprobs` + `top_logprobs` -> the engine's top count (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def render_options(self) -> dict[str, bool]:
        """vLLM's `add_generation_prompt` and `continue_final_message`, as `apply_chat_template` takes them."""
        return self._render_options

    @property
    def parallel(self) -> bool:
        """Whether a reply may make more than one call (OpenAI's default: yes)."""
        return self.parallel_tool_calls is not False

    def echoed(self) -> str:
        """vLLM's chat `echo`: the last message's text when that message is the assistant's (the reply continues
        it, `continue_final_message`); else nothing."""
        last = self.messages.rendered[-1]
        if not self.echo or last["role"] != "assistant":
            return ""
        content = last["content"]
        if isinstance(content, str):
            return content
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type") == "text")

    def to_sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().to_sampling_kwargs()
        if self.num_top_logprobs is not None:
            kwargs["logprobs"] = self.num_top_logprobs
        return kwargs


def parse_messages(messages: Any) -> Messages:
    """`messages` (a body's) -> `Messages`; a 400 naming the first bad field."""
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list):
        raise bad_request(f"messages must be an array, not {json_type(messages)}", "messages")
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    result, images = [], []
    legacy_call = None  # the id of the last legacy function_call, which a function message answers
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where)
        role = field(message, "role", str, required=True, param=f"{where}.role")
        one_of(role, ROLES, f"{where}.role")
        tool_calls = field(message, "tool_calls", list, param=f"{where}.tool_calls") if role == "assistant" else None
        if role == "assistant" and not tool_calls and message.get("function_call") is not None:
            tool_calls = [chat_functions.call_of(message, i)]
            legacy_call = tool_calls[0]["id"]
        if role == "function":  # a legacy call's result: a tool message
            message = {**message, "role": "tool", "tool_call_id": legacy_call or chat_functions.call_id(i)}
            field(message, "name", str, required=True, param=f"{where}.name")
            role = "tool"
        content = message.get("content")
        if content is None and role == "assistant":  # a refusal's message: what the model said is its refusal
            content = field(message, "refusal", str, param=f"{where}.refusal")
        if content is None and not tool_calls:
            raise bad_request(f"{where}.content is required", f"{where}.content")
        if content == []:  # as OpenAI: a list of parts holds at least one
            raise bad_request(f"{where}.content must not be an empty array", f"{where}.content")
        rendered: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                    "content": "" if content is None else content_of(content, f"{where}.content",
                                                                                      images)}
        if tool_calls:
            rendered["tool_calls"] = [_template_tool_call(call, f"{where}.tool_calls[{j}]")
                                      for j, call in enumerate(tool_calls)]
        if role == "tool":
            rendered["tool_call_id"] = field(message, "tool_call_id", str, param=f"{where}.tool_call_id")
        name = field(message, "name", str, param=f"{where}.name")
        if name is not None:
            rendered["name"] = name
        result.append(rendered)
    return Messages(result, images)


def _template_tool_call(call: Any, where: str) -> dict[str, Any]:
    # chat templates expect `arguments` as a mapping (HF convention); OpenAI sends a JSON string
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad_request(f"{where} must be an object with a function", where)
    function = call["function"]
    field(call, "id", str, param=f"{where}.id")
    one_of(field(call, "type", str, param=f"{where}.type"), ("function",), f"{where}.type")
    name = field(function, "name", str, required=True, param=f"{where}.function.name")
    arguments = template_arguments(function.get("arguments") or "{}", f"{where}.function.arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}
