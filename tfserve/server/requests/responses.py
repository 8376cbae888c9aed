"""POST /v1/responses' body, typed: OpenAI's `ResponseCreateParams`. Its fields that take part in every turn
(sampling, `max_output_tokens`, `tool_choice`, `text.format`, `truncation`) are read here once, and its `input`
items typed (input_items.py); the items' stored references are resolved, and its tools read, by
response_items.py and conversations.py."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, field_validator, model_validator

from tfserve.sampling_params import Grammar
from tfserve.server.api.conversations import conversation_id
from tfserve.server.api.response_items import as_response_format, parse_tools, text_format
from tfserve.server.errors import bad_request
from tfserve.server.protocol import INCLUDABLE, one_of
from tfserve.server.requests.input_items import InputItem, parse_items
from tfserve.server.requests.sampling import EFFORTS, CommonFields, MaxToolCalls, SamplingFields
from tfserve.server.tools.response_format import requested_grammar
from tfserve.server.tools.tool_choice import ToolChoice

_REASONING_CHOICES = {"effort": EFFORTS, "summary": ("auto", "concise", "detailed"),
                      "generate_summary": ("auto", "concise", "detailed")}


class ResponseRequest(SamplingFields, CommonFields):
    """A Responses API request. `constraint`: `text.format` as one Grammar; `num_top_logprobs`: the top tokens
    each output_text logprob shows, or None when `include` does not ask for them."""

    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ("max_output_tokens",)
    PROMPT_FIELD: ClassVar[str] = "input"

    input: Any = Field(None, validate_default=True)  # a string, or InputItems (references not yet resolved)
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None  # the id of the conversation it goes on (sent as an id, or {"id": ...})
    tools: list[Any] | None = None
    tool_choice: Any = Field(None, validate_default=True)
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    max_tokens: Any = None  # chat's, not this API's: ignored
    max_tool_calls: MaxToolCalls = None
    truncation: str | None = None
    include: list[Any] | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = None
    background: bool | None = None
    prompt: Any = None  # a template stored on OpenAI's side: nothing here to apply
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as on chat

    _constraint: tuple[Grammar, str] | None = PrivateAttr(None)
    _text_format: dict[str, Any] = PrivateAttr(default_factory=dict)

    @field_validator("input", mode="before")
    @classmethod
    def _parse_input(cls, items: Any) -> str | list[InputItem]:
        return parse_items(items, "input")

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, tool_choice: Any) -> ToolChoice:
        return ToolChoice.parse(tool_choice)

    @field_validator("conversation", mode="before")
    @classmethod
    def _conversation_id(cls, conversation: Any) -> str | None:
        return conversation_id(conversation)

    @field_validator("truncation")
    @classmethod
    def _check_truncation(cls, truncation: str | None) -> str | None:
        if truncation not in (None, "auto", "disabled"):
            raise bad_request("truncation must be auto or disabled", "truncation")
        return truncation

    @field_validator("include")
    @classmethod
    def _check_include(cls, include: list[Any] | None) -> list[Any] | None:
        for i, name in enumerate(include or ()):
            if not isinstance(name, str):
                raise bad_request(f"include[{i}] must be a string", f"include[{i}]")
            one_of(name, INCLUDABLE, f"include[{i}]")
        return include

    @field_validator("reasoning")
    @classmethod
    def _check_reasoning(cls, reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (reasoning or {}).items():
            if key not in _REASONING_CHOICES:
                raise bad_request(f"reasoning.{key} is not a field of reasoning", f"reasoning.{key}")
            one_of(value, _REASONING_CHOICES[key], f"reasoning.{key}")
        return reasoning

    @field_validator("prompt")
    @classmethod
    def _no_prompt(cls, prompt: Any) -> None:
        if prompt is not None:
            raise bad_request("prompt (a stored prompt template) is not supported: send the instructions and input "
                              "themselves", "prompt")

    @model_validator(mode="after")
    def _response_checks(self) -> ResponseRequest:
        if self.conversation is not None and self.previous_response_id is not None:
            raise bad_request("conversation and previous_response_id cannot be used together: a conversation "
                              "holds its own history", "conversation")
        parse_tools({"tools": self.tools, "tool_choice": self.tool_choice})  # the mcp ones: mcp_tools.split_tools
        self._text_format = text_format({"text": self.text})
        constraint = requested_grammar({"response_format": as_response_format(self._text_format)})
        self._constraint = constraint and (constraint[0], "text.format")
        return self

    @property
    def constraint(self) -> tuple[Grammar, str] | None:
        """`text.format` as a Grammar, named "text.format" (None: free text)."""
        return self._constraint

    @property
    def text_format(self) -> dict[str, Any]:
        """`text.format` as checked ({"type": "text"} when absent), as the Response echoes it."""
        return self._text_format

    @property
    def num_top_logprobs(self) -> int | None:
        """How many top tokens each output_text logprob shows (`top_logprobs`, 0 by default), or None when
        `include` does not ask for `message.output_text.logprobs`."""
        return (self.top_logprobs or 0) if "message.output_text.logprobs" in (self.include or ()) else None

    @property
    def truncate(self) -> bool:
        """The Responses API's truncation "auto": a conversation past the context drops its oldest turns."""
        return self.truncation == "auto"

    @property
    def parallel(self) -> bool:
        """Whether a reply may make more than one call (OpenAI's default: yes)."""
        return self.parallel_tool_calls is not False

    @property
    def stored(self) -> bool:
        """Whether the response is kept for `previous_response_id` (OpenAI's default: yes)."""
        return self.store is not False
