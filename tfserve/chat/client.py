"""Where replies come from: the `ChatBackend` protocol and `RemoteBackend`, any OpenAI-compatible server
through the `openai` SDK. (`LocalBackend`, the engine in this process, is in `local.py`.)"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import urlsplit

from tfserve.chat.conversation import DEFAULT_MAX_TOKENS, Settings
from tfserve.errors import TfserveError, UsageError

API_KEY_ENVVARS = ("TFSERVE_API_KEY", "OPENAI_API_KEY")


class ChatError(TfserveError):
    """A failed turn, said in one line; the chat goes on (at start-up the CLI exits 1 with it)."""


class ServerError(ChatError):
    """The server answered with an error body (bad request, unknown model, overloaded...)."""

    def __init__(self, message: str, status: int | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status; None for an error sent inside a stream
        self.detail = detail  # the server's own message; None where it sent none (an HTML page, an empty body)


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


URL_FORMS = "use host:port or http(s)://host:port[/v1]"


def normalize_url(url: str) -> str:
    """`8000`, `host:port`, `http(s)://host:port[/v1][/chat/completions][/]` -> `http(s)://host:port` (no
    trailing /v1 nor endpoint). What is no such URL (another scheme, no host, a port that is no number in
    1-65535) is a UsageError in one line: `tfserve chat`, `bench serve --url` and `bench transcribe --url` read
    their URL here."""
    given, url = url, url.strip()
    if url.isdigit():
        url = f"localhost:{url}"
    elif url.startswith(":"):
        url = f"localhost{url}"
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    for endpoint in ("/chat/completions", "/completions", "/responses", "/models"):  # a pasted endpoint URL
        url = url.removesuffix(endpoint)
    url = url.removesuffix("/v1").rstrip("/")
    _check_url(url, given)
    return url


def _check_url(url: str, given: str) -> None:
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: no number, or past 65535
    except ValueError as exc:
        if "out of range" in str(exc):
            raise UsageError(f"invalid URL {given!r}: the port must be 1-65535") from None
        raise UsageError(f"invalid URL {given!r}: {URL_FORMS}") from None
    if parts.scheme not in ("http", "https") or any(c.isspace() for c in parts.netloc):
        raise UsageError(f"invalid URL {given!r}: {URL_FORMS}")
    if not parts.hostname:
        raise UsageError(f"invalid URL {given!r}: no host; {URL_FORMS}")
    if port == 0:
        raise UsageError(f"invalid URL {given!r}: the port must be 1-65535")


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

    def connect(self, *, chat: bool = True, need_models: bool = False) -> RemoteBackend:
        """Check the server answers /v1/models (with the key) and serves the model; without a model, take the
        first chat model it lists. `chat`: refuse a speech-to-text model; `need_models` (a benchmark's check):
        refuse a server without /v1/models even for a named model, which a chat may still talk to. Raises
        ChatError, one line each: a refused key, no OpenAI-compatible server, a model it does not serve."""
        try:
            models = self._models()
        except ServerError as exc:
            if exc.status in (401, 403):
                raise ServerError(f"{self.url} refused the API key ({exc.status}): pass --api-key", exc.status,
                                  exc.detail) from None
            if exc.status is None or exc.status >= 500:  # it failed: its own words say more
                raise
            if self.model is not None and exc.status == 404 and not need_models:
                return self  # it answers, without /v1/models: the named model may still chat
            raise ServerError(f"{self.url} does not answer /v1/models as an OpenAI-compatible server "
                              f"({exc.status})", exc.status, exc.detail) from None
        offered = [model.id for model in models if not (chat and _is_speech(model))]
        kind = "chat models" if chat else "models"
        if self.model is None:
            if not offered:
                raise ChatError(f"{self.url} lists no {kind}; name one with --model")
            self.model = offered[0]
            return self
        # a name the list leaves out may still be served: an alias, or a model the server loads on demand
        model = next((model for model in models if model.id == self.model), None) or self._retrieve(self.model)
        served = ", ".join(offered) or "none"
        if model is None:
            raise ChatError(f"{self.url} does not serve {self.model!r}; its {kind}: {served}")
        if chat and _is_speech(model):
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
        except (AttributeError, TypeError, ValueError):  # a 200 the SDK cannot read as a list (an HTML page)
            raise ChatError(f"{self.url} does not answer /v1/models with a model list: is it an OpenAI-compatible "
                            "server?") from None

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
    """An `openai.APIError` as one line: the status code and the server's own message; where it sent none (an
    HTML page, an empty body), the status's reason and the request instead, never the page."""
    status = getattr(exc, "status_code", None)
    detail = _server_message(getattr(exc, "body", None))
    if status is None:  # an error sent inside a stream
        return ServerError(f"server error: {detail or ' '.join(str(exc.message).split())[:300]}")
    if detail:
        return ServerError(f"server error {status}: {detail}", status, detail)
    try:
        reason = f" ({HTTPStatus(status).phrase})"
    except ValueError:
        reason = ""
    request = getattr(exc, "request", None)
    where = f" from {request.method} {request.url.path}" if request is not None else ""
    hint = ": is this an OpenAI-compatible server?" if status in (404, 405, 501) else ""
    return ServerError(f"server error {status}{reason}{where}{hint}", status)


def _server_message(body: Any) -> str | None:
    """The message of an error body: OpenAI's {"error": {"message"}}, {"detail"} (FastAPI) or short plain text;
    None for an HTML page (a proxy's, a web server's) or nothing."""
    if isinstance(body, dict):
        error = body.get("error", body)
        message = (error.get("message") or error.get("detail")) if isinstance(error, dict) else error
    else:
        message = body
    if not isinstance(message, str) or not message.strip() or message.lstrip().startswith("<"):
        return None
    return " ".join(message.split())[:300]
