"""Where replies come from: the `ChatBackend` protocol and `RemoteBackend`, any OpenAI-compatible server
through the `openai` SDK. (`LocalBackend`, the engine in this process, is in `local.py`.)"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tfserve.chat.conversation import DEFAULT_MAX_TOKENS, Settings
from tfserve.errors import TfserveError

API_KEY_ENVVARS = ("TFSERVE_API_KEY", "OPENAI_API_KEY")


class ChatError(TfserveError):
    """A failed turn, said in one line; the chat goes on (at start-up the CLI exits 1 with it)."""


class ServerError(ChatError):
    """The server answered with an error body (bad request, unknown model, overloaded...)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status; None for an error sent inside a stream


class ConnectionLost(ChatError):
    """The server cannot be reached, or went away in the middle of a reply."""


@dataclass(slots=True)
class ReplyStats:
    """What the backend reports about one reply; None where it does not say."""

    num_prompt_tokens: int | None = None
    num_completion_tokens: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" | ...; None while streaming or when cut off
    # the reply's calls in OpenAI's shape, {"id", "type": "function", "function": {"name", "arguments"}},
    # complete once the reply has ended
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class Thinking(str):
    """A delta of a reasoning model's thinking (`reasoning_content`), shown apart from the answer and never sent
    back in the conversation."""


class Reply(Protocol):
    """One streaming reply: iterate for text deltas (its tool calls land in `stats.tool_calls`); `close()`
    stops it (the server aborts the request)."""

    stats: ReplyStats

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None: ...


class ChatBackend(Protocol):
    """Something that answers chat messages: a server (`RemoteBackend`) or an in-process engine (`LocalBackend`)."""

    model: str | None
    label: str  # where the model runs, for the banner: "http://localhost:8000" or "in-process"

    def list_models(self) -> list[str]: ...

    def stream(self, messages: list[dict[str, Any]], settings: Settings, tools: list[dict] | None = None,
               tool_choice: str = "auto") -> Reply:
        """Start a reply to `messages`; `tools` (OpenAI function tools) are offered only when given, with
        `tool_choice` (auto, required, none)."""
        ...

    def close(self) -> None: ...


def normalize_url(url: str) -> str:
    """`8000`, `host:port`, `http(s)://host:port[/v1][/chat/completions][/]` -> `http(s)://host:port` (no
    trailing /v1 nor endpoint)."""
    url = url.strip()
    if url.isdigit():
        url = f"localhost:{url}"
    elif url.startswith(":"):
        url = f"localhost{url}"
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    for endpoint in ("/chat/completions", "/completions", "/responses", "/models"):  # a pasted endpoint URL
        url = url.removesuffix(endpoint)
    return url.removesuffix("/v1").rstrip("/")


class RemoteBackend:
    """An OpenAI-compatible server at `url`. `connect()` checks it answers and picks the model."""

    def __init__(self, url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0) -> None:
        import openai

        self.url = normalize_url(url)
        self.label = self.url
        self.model = model
        api_key = api_key or next((os.environ[k] for k in API_KEY_ENVVARS if os.environ.get(k)), None)
        # the SDK insists on a key; servers without one ignore the header
        try:
            self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none", max_retries=0,
                                        timeout=timeout)
        except Exception as exc:  # httpx's InvalidURL (a port that is no number, an unclosed [host]), ...
            raise ChatError(f"invalid URL {url!r}: {exc}") from None

    def connect(self) -> RemoteBackend:
        """Check the server answers and serves the model for chat; without a model, take the first chat model
        it lists. Raises ChatError."""
        try:
            models = self._models()
        except ServerError as exc:
            if self.model is None or exc.status != 404:
                raise
            return self  # it answers, without /v1/models: the named model may still chat
        chat_models = [model.id for model in models if not _is_speech(model)]
        if self.model is None:
            if not chat_models:
                raise ChatError(f"{self.url} lists no chat models; name one with --model")
            self.model = chat_models[0]
            return self
        # a name the list leaves out may still be served: an alias, or a model the server loads on demand
        model = next((model for model in models if model.id == self.model), None) or self._retrieve(self.model)
        served = ", ".join(chat_models) or "none"
        if model is None:
            raise ChatError(f"{self.url} does not serve {self.model!r}; its chat models: {served}")
        if _is_speech(model):
            raise ChatError(f"{self.model!r} is a speech-to-text model (`tfserve transcribe` takes it), not a chat "
                            f"model; {self.url}'s chat models: {served}")
        return self

    def list_models(self) -> list[str]:
        """The server's chat models (speech-to-text models, which only transcribe, left out)."""
        return [model.id for model in self._models() if not _is_speech(model)]

    def _models(self) -> list[Any]:
        import openai

        try:
            return list(self.client.models.list())
        except openai.APIConnectionError:
            raise ConnectionLost(self.unreachable_message) from None
        except openai.APIError as exc:
            raise describe(exc) from None

    def _retrieve(self, name: str) -> Any | None:
        """GET /v1/models/NAME: the model, or None where the server does not know it (or has no such route)."""
        import openai

        try:
            return self.client.models.retrieve(name)
        except openai.APIConnectionError:
            raise ConnectionLost(self.unreachable_message) from None
        except openai.APIError:
            return None

    @property
    def unreachable_message(self) -> str:
        return f"cannot reach {self.url} — is `tfserve serve` running?"

    def stream(self, messages: list[dict[str, Any]], settings: Settings, tools: list[dict] | None = None,
               tool_choice: str = "auto") -> Reply:
        import openai

        kwargs = settings.sampling_kwargs()
        if tools:
            kwargs["tools"] = tools
            if tool_choice != "auto":
                kwargs["tool_choice"] = tool_choice
        capped = settings.max_tokens is None
        if capped:
            kwargs["max_tokens"] = DEFAULT_MAX_TOKENS
        try:
            try:
                stream = self._create(messages, kwargs)
            except openai.BadRequestError as exc:
                if not (capped and _context_too_short(exc)):
                    raise
                # the context leaves less than the default cap: let the server give what it leaves
                stream = self._create(messages, {k: v for k, v in kwargs.items() if k != "max_tokens"})
        except openai.APIConnectionError:
            raise ConnectionLost(self.unreachable_message) from None
        except openai.APIError as exc:
            raise describe(exc) from None
        return _RemoteReply(stream)

    def _create(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> Any:
        return self.client.chat.completions.create(model=self.model, messages=messages, stream=True,
                                                   stream_options={"include_usage": True}, **kwargs)

    def close(self) -> None:
        self.client.close()


class _RemoteReply:
    """The deltas of one streamed chat completion."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.stats = ReplyStats()

    def __iter__(self) -> Iterator[str]:
        import openai

        try:
            for chunk in self._stream:
                if chunk.usage is not None:
                    self.stats.num_prompt_tokens = chunk.usage.prompt_tokens
                    self.stats.num_completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        self.stats.finish_reason = choice.finish_reason
                    delta = choice.delta
                    if delta is None:
                        continue
                    # tfserve and vLLM's name, then the newer `reasoning`: extra fields the SDK keeps as they come
                    thinking = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
                    if isinstance(thinking, str) and thinking:
                        yield Thinking(thinking)
                    if delta.content:
                        yield delta.content
                    for call in getattr(delta, "tool_calls", None) or ():
                        self._add_call_delta(call)
        except openai.APIConnectionError:
            raise ConnectionLost("connection lost in the middle of the reply") from None
        except openai.APIError as exc:
            raise describe(exc) from None
        if self.stats.finish_reason is None:
            raise ConnectionLost("the reply ended without a finish reason (connection lost?)")

    def _add_call_delta(self, delta: Any) -> None:
        """A call arrives in pieces: its id and name first, then its arguments as they are written."""
        calls = self.stats.tool_calls
        index = delta.index if delta.index is not None else len(calls) - 1
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call, function = calls[index], delta.function
        call["id"] = delta.id or call["id"]
        if function is not None:
            call["function"]["name"] += function.name or ""
            call["function"]["arguments"] += function.arguments or ""

    def close(self) -> None:
        """Close the HTTP response: the server sees the client leave and aborts the generation."""
        self._stream.close()


def _is_speech(model: Any) -> bool:
    """Whether a /v1/models entry is a speech-to-text model: tfserve says so by its input_modalities (["audio"]);
    servers that do not (OpenAI's whisper-1, vLLM's openai/whisper-*) by its name."""
    modalities = getattr(model, "input_modalities", None)  # an extra field, kept by the SDK as it came
    if isinstance(modalities, list):
        return "text" not in modalities
    return "whisper" in model.id.lower()


def _context_too_short(exc: Any) -> bool:
    # servers name it differently: OpenAI and tfserve by code, others by the field
    return getattr(exc, "code", None) == "context_length_exceeded" or getattr(exc, "param", None) in (
        "max_tokens", "max_completion_tokens")


def describe(exc: Any) -> ServerError:
    """An `openai.APIError` as one line: the status code and the server's own message."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    message = body.get("message") if isinstance(body, dict) else None
    message = message or (body if isinstance(body, str) and body else None) or getattr(exc, "message", str(exc))
    message = " ".join(str(message).split())[:300]  # an HTML error page from a proxy stays one line
    status = getattr(exc, "status_code", None)
    return ServerError(f"server error {status}: {message}" if status else f"server error: {message}", status)
