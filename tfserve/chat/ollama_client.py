"""`OllamaBackend`: the chat's replies from a server that speaks Ollama's API (/api/tags, /api/chat streamed as
NDJSON), for `tfserve chat URL --protocol ollama` (or found by `--protocol auto`). The conversation stays in
OpenAI's shape; it is turned into Ollama's messages at each turn and the reply's calls back into OpenAI's."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

from tfserve.chat.backend import (ChatError, ConnectionLost, ContextFull, ReplyStats, ServerError, Thinking,
                                  max_context_tokens_in)
from tfserve.chat.client import API_KEY_ENVVARS, normalize_url, tls_problem
from tfserve.chat.conversation import DEFAULT_MAX_TOKENS, Settings

_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "num_predict", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


class OllamaBackend:
    """An Ollama-compatible server at `url`. `connect()` checks it answers /api/tags and picks the model."""

    def __init__(self, url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0) -> None:
        import httpx

        self.url = self.label = normalize_url(url)
        self.model = model
        api_key = api_key or next((os.environ[name] for name in API_KEY_ENVVARS if os.environ.get(name)), None)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def connect(self) -> OllamaBackend:
        models = self.list_models()
        if self.model is None:
            if not models:
                raise ChatError(f"{self.url} lists no models; name one with --model")
            self.model = models[0]
        elif self.model not in models and f"{self.model}:latest" not in models:
            raise ChatError(f"{self.url} does not serve {self.model!r}; its models: {', '.join(models) or 'none'}")
        return self

    def list_models(self) -> list[str]:
        body = self._call("GET", "/api/tags")
        models = body.get("models") if isinstance(body, dict) else None
        if not isinstance(models, list):
            raise ChatError(f"{self.url}'s /api/tags is not an Ollama model list: is it an Ollama server?")
        return [m.get("model") or m.get("name") for m in models if isinstance(m, dict) and
                isinstance(m.get("model") or m.get("name"), str)]

    def stream(self, messages: list[dict[str, Any]], settings: Settings, tools: list[dict] | None = None,
               tool_choice: str = "auto") -> _OllamaReply:
        options = {_OPTIONS[k]: v for k, v in settings.sampling_kwargs().items() if k in _OPTIONS}
        capped = "num_predict" not in options
        if capped:
            options["num_predict"] = DEFAULT_MAX_TOKENS
        body: dict[str, Any] = {"model": self.model, "messages": ollama_messages(messages), "stream": True,
                                "options": options}
        if tools and tool_choice != "none":  # Ollama has no tool_choice: "required" is left to the model
            body["tools"] = tools
        stats = ReplyStats()
        try:
            response = self._open(body)
        except ServerError as exc:
            if not (capped and exc.detail and "context length" in exc.detail):
                raise
            # the context leaves less than the default cap: the server gives what it leaves
            stats.context_capped = True
            stats.max_context_tokens = max_context_tokens_in(exc.detail)
            body["options"] = {**options, "num_predict": -1}
            try:
                response = self._open(body)
            except ServerError as again:
                if again.detail and "context length" in again.detail:
                    raise ContextFull(max_context_tokens_in(again.detail)) from None
                raise
        return _OllamaReply(response, stats)

    def _open(self, body: dict[str, Any]) -> Any:
        import httpx

        try:
            response = self.http.send(self.http.build_request("POST", "/api/chat", json=body), stream=True)
        except httpx.HTTPError as exc:
            raise ConnectionLost(tls_problem(exc, self.url) or f"cannot reach {self.url}") from None
        if response.status_code >= 400:
            response.read()
            response.close()
            raise _error(response)
        return response

    def _call(self, method: str, path: str) -> Any:
        import httpx

        try:
            response = self.http.request(method, path)
        except httpx.HTTPError as exc:
            raise ConnectionLost(tls_problem(exc, self.url) or f"cannot reach {self.url}") from None
        if response.status_code in (401, 403):
            raise ServerError(f"{self.url} refused the API key ({response.status_code}): pass --api-key",
                              response.status_code)
        if response.status_code >= 400:
            raise _error(response)
        try:
            return response.json()
        except ValueError:
            return None

    def close(self) -> None:
        self.http.close()


class _OllamaReply:
    """The deltas of one /api/chat stream; its calls land in `stats.tool_calls` in OpenAI's shape."""

    def __init__(self, response: Any, stats: ReplyStats) -> None:
        self._response, self.stats = response, stats

    def __iter__(self) -> Iterator[str]:
        import httpx

        try:
            for line in self._response.iter_lines():
                if not line.strip():
                    continue
                part = json.loads(line)
                if part.get("error"):
                    raise ServerError(f"server error: {part['error']}")
                message = part.get("message") or {}
                if message.get("thinking"):
                    yield Thinking(message["thinking"])
                if message.get("content"):
                    yield message["content"]
                for call in message.get("tool_calls") or ():
                    function = call.get("function") or {}
                    arguments = function.get("arguments", {})
                    self.stats.tool_calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                                  "function": {"name": function.get("name", ""), "arguments":
                                                               arguments if isinstance(arguments, str)
                                                               else json.dumps(arguments)}})
                if part.get("done"):
                    self.stats.num_prompt_tokens = part.get("prompt_eval_count")
                    self.stats.num_completion_tokens = part.get("eval_count")
                    reason = part.get("done_reason") or "stop"
                    self.stats.finish_reason = "tool_calls" if self.stats.tool_calls else reason
        except httpx.HTTPError:
            raise ConnectionLost("connection lost in the middle of the reply") from None
        except ValueError:
            raise ChatError("the server sent a line that is not JSON: is it an Ollama server?") from None
        finally:
            self._response.close()
        if self.stats.finish_reason is None:
            raise ConnectionLost("the reply ended without done (connection lost?)")

    def close(self) -> None:
        self._response.close()


def ollama_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages -> Ollama's: image parts -> base64 `images`, call arguments -> objects, a tool result's
    call id -> its `tool_name`."""
    names: dict[str, str] = {}
    result = []
    for message in messages:
        out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
        if isinstance(out["content"], list):
            parts = out["content"]
            out["content"] = "".join(p.get("text", "") for p in parts if p.get("type") == "text")
            out["images"] = [p["image_url"]["url"].partition("base64,")[2] for p in parts
                             if p.get("type") == "image_url"]
        for call in message.get("tool_calls") or ():
            names[call.get("id", "")] = call["function"]["name"]
            arguments = call["function"].get("arguments") or "{}"
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
            out.setdefault("tool_calls", []).append({"function": {"name": call["function"]["name"],
                                                                  "arguments": arguments}})
        if message["role"] == "tool" and message.get("tool_call_id") in names:
            out["tool_name"] = names[message["tool_call_id"]]
        result.append(out)
    return result


def _error(response: Any) -> ServerError:
    try:
        detail = response.json().get("error")
    except (ValueError, AttributeError):
        detail = None
    detail = detail if isinstance(detail, str) else None
    said = f": {detail}" if detail else ""
    return ServerError(f"server error {response.status_code}{said}", response.status_code, detail)
