"""`RemoteBackend`: replies from any OpenAI-compatible server through the `openai` SDK; its URL forms, and its
errors said in one line. (The `ChatBackend` protocol and what every backend shares are in `backend.py`;
`LocalBackend`, the engine in this process, is in `local.py`.)"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from tfserve.chat.backend import (ChatError, ConnectionLost, ContextFull, Reply, ReplyStats, ServerError, Thinking,
                                  max_context_tokens_in)
from tfserve.chat.conversation import DEFAULT_MAX_TOKENS, Settings
from tfserve.errors import UsageError

API_KEY_ENVVARS = ("TFSERVE_API_KEY", "OPENAI_API_KEY")
NO_KEY = "EMPTY"  # what `bench serve` sends when no key is given (vLLM's placeholder): not a key the user gave
URL_FORMS = "use host:port or http(s)://host:port[/v1]"


def openai_base_url(url: str) -> str:
    """The OpenAI base URL (`.../v1`) that a `--url` names, as `normalize_url` reads it."""
    return normalize_url(url) + "/v1"


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
        # where the key came from, for the line that says the server refused it; None: no key was given
        self.key_source = "--api-key" if api_key and api_key != NO_KEY else None
        if not api_key:
            name = next((name for name in API_KEY_ENVVARS if os.environ.get(name)), None)
            api_key, self.key_source = (os.environ[name], f"${name}") if name else (None, None)
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
                said = (f"refused the API key given with {self.key_source} ({exc.status})" if self.key_source
                        else f"refused the API key ({exc.status}): pass --api-key")
                raise ServerError(f"{self.url} {said}", exc.status, exc.detail) from None
            if exc.status is None or exc.status >= 500:  # it failed: its own words say more
                raise
            if self.model is not None and exc.status == 404 and not need_models:
                return self  # it answers, without /v1/models: the named model may still chat
            raise ServerError(f"{self.url} does not answer /v1/models as an OpenAI-compatible server "
                              f"({exc.status})", exc.status, exc.detail) from None
        offered = [model["id"] for model in models if not (chat and _is_speech(model))]
        kind = "chat models" if chat else "models"
        if self.model is None:
            if not offered:
                raise ChatError(f"{self.url} lists no {kind}; name one with --model")
            self.model = offered[0]
            return self
        # a name the list leaves out may still be served: an alias, or a model the server loads on demand
        model = next((model for model in models if model["id"] == self.model), None) or self._retrieve(self.model)
        served = ", ".join(offered) or "none"
        if model is None:
            raise ChatError(f"{self.url} does not serve {self.model!r}; its {kind}: {served}")
        if chat and _is_speech(model):
            raise ChatError(f"{self.model!r} is a speech-to-text model (`tfserve transcribe` takes it), not a chat "
                            f"model; {self.url}'s chat models: {served}")
        return self

    def list_models(self) -> list[str]:
        """The server's chat models (speech-to-text models, which only transcribe, left out)."""
        return [model["id"] for model in self._models() if not _is_speech(model)]

    def _models(self) -> list[dict[str, Any]]:
        """The entries of GET /v1/models that name a model (a string id; others are skipped, as a client skips
        what it cannot use). Read as JSON here, not through the SDK's types, which take any shape and fail later
        (an id that is a number, a "data" that is one object); what is no list of objects is one ChatError."""
        import openai

        try:
            body = self.client.models.with_raw_response.list().http_response.json()
        except openai.APIConnectionError as exc:
            raise ConnectionLost(self.unreachable(exc)) from None
        except openai.APIError as exc:
            raise describe(exc) from None
        except ValueError:  # a 200 that is no JSON (an HTML page)
            body = None
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(entry, dict) for entry in data):
            raise ChatError(f"{self.url}'s /v1/models is not an OpenAI model list: is it an OpenAI-compatible "
                            "server?")
        return [entry for entry in data if isinstance(entry.get("id"), str)]

    def _retrieve(self, name: str) -> dict[str, Any] | None:
        """GET /v1/models/NAME: the model, or None where the server does not know it (or has no such route, or
        answers with no model object)."""
        import openai

        try:
            body = self.client.models.with_raw_response.retrieve(name).http_response.json()
        except openai.APIConnectionError as exc:
            raise ConnectionLost(self.unreachable(exc)) from None
        except (openai.APIError, ValueError):
            return None
        return body if isinstance(body, dict) and isinstance(body.get("id"), str) else None

    def unreachable(self, exc: BaseException) -> str:
        """Why a connection failed, in one line: nothing listens, or (an SSL error under `exc`) TLS went wrong.
        An https:// URL for a plain-HTTP server fails the handshake, which is no reason to ask whether the server
        runs."""
        tls = tls_problem(exc, self.url)
        return tls or f"cannot reach {self.url} — is `tfserve serve` running?"

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
        stats = ReplyStats()
        try:
            try:
                stream = self._create(messages, kwargs)
            except openai.BadRequestError as exc:
                if _conversation_too_long(exc) or not (capped and _context_too_short(exc)):
                    raise
                # the context leaves less than the default cap: let the server give what it leaves (the reply
                # then ends where the context does)
                stats.context_capped, stats.max_context_tokens = True, _max_context_tokens(exc)
                stream = self._create(messages, {k: v for k, v in kwargs.items() if k != "max_tokens"})
        except openai.BadRequestError as exc:
            # without max_tokens a context error can only be the conversation's own length
            if _conversation_too_long(exc) or (stats.context_capped and _context_too_short(exc)):
                raise ContextFull(_max_context_tokens(exc) or stats.max_context_tokens) from None
            raise describe(exc) from None
        except openai.APIConnectionError as exc:
            raise ConnectionLost(self.unreachable(exc)) from None
        except openai.APIError as exc:
            raise describe(exc) from None
        return _RemoteReply(stream, stats)

    def _create(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> Any:
        return self.client.chat.completions.create(model=self.model, messages=messages, stream=True,
                                                   stream_options={"include_usage": True}, **kwargs)

    def close(self) -> None:
        self.client.close()


class _RemoteReply:
    """The deltas of one streamed chat completion."""

    def __init__(self, stream: Any, stats: ReplyStats | None = None) -> None:
        self._stream = stream
        self.stats = stats or ReplyStats()

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
        stats = self.stats
        if stats.context_capped and stats.max_context_tokens is None and stats.num_prompt_tokens is not None:
            # a reply the context capped fills it, so the usage says the context's size
            stats.max_context_tokens = stats.num_prompt_tokens + (stats.num_completion_tokens or 0)

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


def _is_speech(model: dict[str, Any]) -> bool:
    """Whether a /v1/models entry (with a string id) is a speech-to-text model: tfserve says so by its
    input_modalities (["audio"]); servers that do not (OpenAI's whisper-1, vLLM's openai/whisper-*) by its name."""
    modalities = model.get("input_modalities")
    if isinstance(modalities, list):
        return "text" not in modalities
    return "whisper" in model["id"].lower()


def _context_too_short(exc: Any) -> bool:
    # servers name it differently: OpenAI and tfserve by code, others by the field
    return getattr(exc, "code", None) == "context_length_exceeded" or getattr(exc, "param", None) in (
        "max_tokens", "max_completion_tokens")


def _conversation_too_long(exc: Any) -> bool:
    """A context error about the messages themselves (tfserve names "prompt" or "messages", OpenAI "messages"),
    not about max_tokens: no max_tokens would make it fit."""
    return getattr(exc, "code", None) == "context_length_exceeded" and getattr(exc, "param", None) not in (
        "max_tokens", "max_completion_tokens")


def _max_context_tokens(exc: Any) -> int | None:
    return max_context_tokens_in(str(getattr(exc, "message", "") or ""))


def tls_problem(exc: BaseException, url: str) -> str | None:
    """One line for a connection that failed in TLS (an `ssl.SSLError` among `exc`'s causes), else None. An
    https:// URL for a server that speaks plain HTTP fails with "wrong version number" (or the newer "record
    layer failure"): it says to use http://, since asking whether the server runs would send the user looking
    in the wrong place."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, ssl.SSLError):
        return None
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"cannot reach {url}: its TLS certificate is not trusted ({cause.verify_message})"
    if cause.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG"):
        plain = "http://" + url.split("://", 1)[-1]
        return f"{url} does not speak HTTPS (its answer is plain HTTP): use {plain}"
    return f"cannot reach {url}: the TLS handshake failed ({cause.reason or cause})"


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
