"""Ollama's /api/chat and /api/generate bodies, typed, with their `options`: the sampling options under Ollama's
names (`num_predict`, `repeat_penalty`) with the ranges of the one table; an option that would change the output
and is not honoured is a 400, never dropped."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, field_validator, model_validator

from tfserve.sampling_params import Grammar
from tfserve.server.chat_prompt import parse_tools
from tfserve.server.errors import bad_request
from tfserve.server.protocol import field
from tfserve.server.requests.base import RequestModel
from tfserve.server.requests.chat import Messages, parse_messages
from tfserve.server.requests.sampling import SamplingFields
from tfserve.server.tools.response_format import requested_grammar
from tfserve.server.tools.tool_choice import ToolChoice

HONOURED = frozenset({"num_predict", "temperature", "top_p", "top_k", "seed", "stop", "repeat_penalty", "min_p",
                      "presence_penalty", "frequency_penalty", "repeat_last_n"})
# how the model runs, not what it writes (num_ctx: the served context is the model's own)
IGNORED = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "low_vram", "f16_kv", "use_mmap",
                     "use_mlock", "vocab_only", "numa", "num_keep", "logits_all", "embedding_only"})
# would change the output: accepted only at the value that leaves it as ours is (Ollama's defaults)
NEUTRAL = {"typical_p": (1.0,), "tfs_z": (1.0,), "mirostat": (0,), "penalize_newline": (True, False)}


class OllamaOptions(SamplingFields):
    """`options` of /api/chat and /api/generate. `num_predict` -1 or -2 (until the context is full) is no limit."""

    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ("num_predict",)

    num_predict: int | None = None
    repetition_penalty: float | None = Field(None, alias="repeat_penalty")
    repeat_last_n: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, options: Any) -> Any:
        """Only the options this server honours reach the fields; the others are ignored or refused here."""
        if not isinstance(options, dict):
            return options
        for name, value in options.items():
            if value is None or name in HONOURED or name in IGNORED:
                continue
            if name not in NEUTRAL:
                raise bad_request(f"options.{name} is not an option this server takes", f"options.{name}")
            if not any(value is v or (isinstance(value, bool) == isinstance(v, bool) and value == v)
                       for v in NEUTRAL[name]):  # a boolean is no number
                raise bad_request(f"options.{name} is not supported by this server (leave it out)", f"options.{name}")
        return {name: value for name, value in options.items() if name in HONOURED}

    @model_validator(mode="after")
    def _ollama_checks(self) -> OllamaOptions:
        penalty = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        if self.repeat_last_n not in (None, -1) and penalty != 1.0:  # the penalty here reads the whole context (-1)
            raise bad_request("options.repeat_last_n other than -1 is not supported with repeat_penalty: the "
                              "penalty covers the whole context", "options.repeat_last_n")
        return self

    @field_validator("num_predict")
    @classmethod
    def _no_limit(cls, num_predict: int | None) -> int | None:
        """-1 and -2 (until the context is full) are no limit; SamplingParams checks any other value."""
        return None if num_predict in (-1, -2) else num_predict

    @property
    def names(self) -> dict[str, str]:
        return {**super().names, "repetition_penalty": "repeat_penalty"}


class _OllamaRequest(RequestModel):
    """What /api/chat and /api/generate share. Ollama's clients send only its fields: another is a 400 (a field
    sent for a reason is never dropped unseen). Ollama has no `tool_choice`: a reply may call any tool offered
    (`tool_choice` is "auto", parsed once like chat's)."""

    ROUTE: ClassVar[str] = ""
    FIELDS: ClassVar[frozenset[str]] = frozenset({"model", "format", "options", "stream", "keep_alive", "think",
                                                   "logprobs", "top_logprobs"})

    model: str | None = None
    format: Any = None  # "json", a JSON schema, or "" / absent for free text
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    stream: bool | None = None  # true unless false, as in Ollama
    keep_alive: Any = None
    think: Any = None  # true, false or a level ("low", ...): false turns a reasoning model's thinking off
    logprobs: Any = None
    top_logprobs: Any = None

    _constraint: tuple[Grammar, str] | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _known(cls, body: Any) -> Any:
        unknown = sorted(set(body) - cls.FIELDS) if isinstance(body, dict) else []
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}: /api/{cls.ROUTE} takes {', '.join(sorted(cls.FIELDS))}",
                              unknown[0])
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    @model_validator(mode="after")
    def _shared_checks(self) -> Any:
        if self.model is None:
            raise bad_request("model is required", "model")
        field({"think": self.think}, "think", (bool, str))
        constraint = requested_grammar({"response_format": self.response_format})
        self._constraint = constraint and (constraint[0], "format")
        return self

    @property
    def constraint(self) -> tuple[Grammar, str] | None:
        """`format` as one Grammar, named "format" (None: free text)."""
        return self._constraint

    @property
    def tool_choice(self) -> ToolChoice:
        """Ollama's API has no `tool_choice`: a reply may call any tool it is offered."""
        return ToolChoice()

    @property
    def function_tools(self) -> list[dict[str, Any]] | None:
        """The function tools the chat template shows (None: none)."""
        return None

    def sampling_kwargs(self) -> dict[str, Any]:
        """`options` (and the top-level fields that shape sampling) -> SamplingParams keyword arguments."""
        for name in ("logprobs", "top_logprobs"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported on this route (use /v1/chat/completions)", name)
        return self.options.to_sampling_kwargs()

    @property
    def response_format(self) -> dict[str, Any] | None:
        """`format` as OpenAI's `response_format`: "json" -> any JSON object, a schema -> that schema, "" or absent
        -> free text."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return {"type": "json_object"}
        if isinstance(self.format, dict):
            return {"type": "json_schema", "json_schema": {"name": "format", "schema": self.format}}
        raise bad_request('format must be "json" or a JSON schema object', "format")


class OllamaChatRequest(_OllamaRequest):
    """POST /api/chat: Ollama's `messages` (with `images`, `tool_calls`, `tool_name`) and `tools`."""

    ROUTE: ClassVar[str] = "chat"
    FIELDS: ClassVar[frozenset[str]] = _OllamaRequest.FIELDS | {"messages", "tools"}

    messages: Any = Field(default_factory=lambda: Messages([]))  # Messages, parsed (none: load the model)
    tools: Any = None

    _tools: list[dict[str, Any]] | None = PrivateAttr(None)

    @field_validator("messages", mode="before")
    @classmethod
    def _parse_messages(cls, messages: Any) -> Messages:
        """Ollama's messages -> OpenAI's, read as chat reads them (a 400 naming the field)."""
        if isinstance(messages, list) and not messages:
            return Messages([])
        if not isinstance(messages, list):
            return parse_messages(messages)  # its 400
        return parse_messages([openai_message(m, i) for i, m in enumerate(messages)])

    @model_validator(mode="after")
    def _chat_checks(self) -> OllamaChatRequest:
        self._tools = parse_tools({"tools": self.tools, "tool_choice": self.tool_choice})
        return self

    @property
    def function_tools(self) -> list[dict[str, Any]] | None:
        return self._tools


class OllamaGenerateRequest(_OllamaRequest):
    """POST /api/generate: a `prompt` (with `system`, `images`), through the chat template unless `raw`."""

    ROUTE: ClassVar[str] = "generate"
    FIELDS: ClassVar[frozenset[str]] = _OllamaRequest.FIELDS | {"prompt", "suffix", "system", "template", "context",
                                                                "raw", "images"}

    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[Any] | None = None
    raw: bool = False
    images: list[Any] = Field(default_factory=list)

    _messages: Messages = PrivateAttr(default_factory=lambda: Messages([]))

    @model_validator(mode="after")
    def _generate_checks(self) -> OllamaGenerateRequest:
        for name in ("suffix", "template"):  # a fill-in-the-middle, a Go template: neither is done here
            if getattr(self, name):
                raise bad_request(f"{name} is not supported by this server", name)
        if self.context:
            raise bad_request("context (the tokens of an earlier reply) is not supported: send the conversation to "
                              "/api/chat", "context")
        for j, image in enumerate(self.images):
            if not isinstance(image, str):
                raise bad_request(f"images[{j}] must be a base64 string", f"images[{j}]")
        if self.prompt or self.images:  # the messages the chat template renders (unless raw)
            system = [openai_message({"role": "system", "content": self.system}, 0)] if self.system else []
            self._messages = parse_messages([*system, openai_message({"role": "user", "content": self.prompt,
                                                                      "images": self.images}, 1)])
        return self

    @property
    def messages(self) -> Messages:
        """`system` and `prompt` (with `images`) as the chat template takes them (none when both are empty)."""
        return self._messages


class OllamaShowRequest(RequestModel):
    """POST /api/show: the model, by `model` (or by `name`, its older field)."""

    model: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _named(self) -> OllamaShowRequest:
        if not self.model and self.name is None:
            raise bad_request("model is required", "model")
        return self

    @property
    def model_name(self) -> str:
        """The model asked for, without Ollama's default tag."""
        return (self.model or self.name or "").removesuffix(":latest")


class OllamaEmbedRequest(RequestModel):
    """POST /api/embed: `input` (a string or a list of them; read against the server's limits by the handler),
    `truncate` (default true, as Ollama), `dimensions`. `options` are not taken here."""

    model: str | None = Field(None, validate_default=True)
    input: Any = None
    truncate: bool | None = None
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None

    @model_validator(mode="after")
    def _embed_checks(self) -> OllamaEmbedRequest:
        if self.model is None:
            raise bad_request("model is required", "model")
        if self.dimensions is not None and self.dimensions < 1:
            raise bad_request(f"dimensions must be at least 1 (got {self.dimensions})", "dimensions")
        if self.options:
            raise bad_request("options are not taken by /api/embed here", "options")
        return self

    @property
    def model_name(self) -> str:
        """The model asked for, without Ollama's default tag."""
        return (self.model or "").removesuffix(":latest")


def openai_message(message: Any, i: int) -> dict[str, Any]:
    """An Ollama message -> the OpenAI message `parse_messages` reads: `images` (base64) become image parts,
    `tool_calls` with object arguments get ids and JSON strings, a tool result's `tool_name` its name."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", where)
    result = {key: message[key] for key in ("role", "content") if key in message}
    images = field(message, "images", list, [], param=f"{where}.images")
    if images:
        for j, image in enumerate(images):
            if not isinstance(image, str):
                raise bad_request(f"{where}.images[{j}] must be a base64 string", f"{where}.images[{j}]")
        result["content"] = [{"type": "text", "text": field(message, "content", str, "", param=f"{where}.content")},
                             *({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
                               for image in images)]
    calls = field(message, "tool_calls", list, param=f"{where}.tool_calls")
    if calls:
        result["tool_calls"] = [openai_call(call, f"{where}.tool_calls[{j}]", j) for j, call in enumerate(calls)]
        result.setdefault("content", "")
    name = field(message, "tool_name", str, param=f"{where}.tool_name")
    if name is not None:
        result["name"] = name
    return result


def openai_call(call: Any, where: str, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise bad_request(f"{where} must be an object with a function", where)
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{index}", "type": "function", "function": {"name": function.get("name"),
                                                                     "arguments": arguments}}
