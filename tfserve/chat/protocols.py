"""Which API a chat server speaks: OpenAI's (`RemoteBackend`), Ollama's (`OllamaBackend`), or TGI's (its chat is
OpenAI's /v1/chat/completions; its model is named by GET /info, not /v1/models). `--protocol auto` tries
OpenAI's first and, where /v1/models is missing, asks /api/version (Ollama) and /info (TGI)."""

from __future__ import annotations

from typing import Any

from tfserve.chat.backend import ChatError, ServerError
from tfserve.chat.client import RemoteBackend

PROTOCOLS = ("auto", "openai", "ollama", "tgi")


def connect_remote(url: str, protocol: str = "auto", *, api_key: str | None = None,
                   model: str | None = None) -> Any:
    """A connected ChatBackend for the server at `url` speaking `protocol` (one of PROTOCOLS)."""
    if protocol not in PROTOCOLS:
        raise ChatError(f"unknown protocol {protocol!r}; one of {', '.join(PROTOCOLS)}")
    if protocol == "ollama":
        from tfserve.chat.ollama_client import OllamaBackend

        return OllamaBackend(url, api_key=api_key, model=model).connect()
    backend = TgiBackend(url, api_key=api_key, model=model) if protocol == "tgi" else RemoteBackend(
        url, api_key=api_key, model=model)
    try:
        return backend.connect()
    except ServerError as exc:
        if protocol != "auto" or exc.status not in (404, 405):
            raise
        found = detect(backend)
        if found is None:
            raise
        backend.close()
        return connect_remote(url, found, api_key=api_key, model=model)


def detect(backend: RemoteBackend) -> str | None:
    """"ollama" or "tgi" where the server answers that API's probe (GET /api/version, GET /info), else None."""
    if isinstance(_get(backend, "/api/version"), dict):
        return "ollama"
    info = _get(backend, "/info")
    if isinstance(info, dict) and "max_total_tokens" in info:
        return "tgi"
    return None


def _get(backend: RemoteBackend, path: str) -> Any:
    """GET `path` on the server with the backend's key: the JSON body, or None (an error, no JSON)."""
    try:
        response = backend.client.get(path.replace("/", f"{backend.url}/", 1), cast_to=object)
    except Exception:  # any failure means "not this API"
        return None
    return response


class TgiBackend(RemoteBackend):
    """A TGI server: OpenAI's chat at /v1/chat/completions; the model it serves is /info's `model_id`."""

    def connect(self, *, chat: bool = True, need_models: bool = False) -> TgiBackend:
        info = _get(self, "/info")
        if not isinstance(info, dict) or not isinstance(info.get("model_id"), str):
            raise ChatError(f"{self.url} does not answer /info as a TGI server")
        if self.model is not None and self.model != info["model_id"]:
            raise ChatError(f"{self.url} serves {info['model_id']!r}, not {self.model!r}")
        self.model = info["model_id"]
        return self

    def list_models(self) -> list[str]:
        return [self.model] if self.model else []
