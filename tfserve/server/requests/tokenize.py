"""vLLM's POST /tokenize and POST /detokenize bodies, typed."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from tfserve.server.chat_prompt import parse_tools, render_options
from tfserve.server.errors import bad_request
from tfserve.server.requests.base import RequestModel
from tfserve.server.requests.chat import Messages, parse_messages
from tfserve.server.tools.tool_choice import ToolChoice


class TokenizeRequest(RequestModel):
    """`prompt` or chat `messages` (rendered as /v1/chat/completions renders them, with its template fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: Any = None  # Messages, once parsed
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template's own)
    return_token_strs: bool | None = None

    _tools: list[dict[str, Any]] | None = PrivateAttr(None)
    _render_options: dict[str, bool] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if ("prompt" in self.model_fields_set) == ("messages" in self.model_fields_set):
            raise bad_request("send either prompt or messages", "prompt")
        if "prompt" in self.model_fields_set and self.prompt is None:
            raise bad_request("prompt is required", "prompt")
        if "messages" in self.model_fields_set:
            self.messages = parse_messages(self.messages)
            self.tool_choice = ToolChoice.parse(self.tool_choice)
            self._tools = parse_tools({"tools": self.tools, "tool_choice": self.tool_choice})
            self._render_options = render_options({"add_generation_prompt": self.add_generation_prompt,
                                                   "continue_final_message": self.continue_final_message})
        return self

    @property
    def function_tools(self) -> list[dict[str, Any]] | None:
        """The function tools the chat template shows (None: none, or tool_choice "none")."""
        return self._tools

    @property
    def render_options(self) -> dict[str, bool]:
        """vLLM's `add_generation_prompt` and `continue_final_message`, as `apply_chat_template` takes them."""
        return self._render_options

    @property
    def chat(self) -> Messages | None:
        """The parsed messages, or None for a prompt."""
        return self.messages if isinstance(self.messages, Messages) else None


class DetokenizeRequest(RequestModel):
    """`tokens` -> their text (each id checked against the vocabulary by the handler)."""

    model: str | None = None
    tokens: list[Any] = Field(None, validate_default=True)

    @model_validator(mode="after")
    def _required(self) -> DetokenizeRequest:
        if self.tokens is None:
            raise bad_request("tokens is required", "tokens")
        return self
