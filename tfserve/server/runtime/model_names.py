"""What a client may name in a request's `model` for loading on demand, shared by the chat model's residency
(residency.py) and the speech models (speech.py): store names and hub ids, never a path, and which names mean
a speech model."""

from __future__ import annotations

import re

from tfserve.server.errors import ApiError

OPENAI_NAMES = ("whisper-1",)  # what OpenAI clients send by default: the default speech model here
# what a client may name: a store name or a hub id ("org/name"), never a filesystem path
_LOADABLE_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # a store name or hub id
# a chat model's name may add transformers' `@revision` and `:file.gguf` (a GGUF file inside the model)
_LOADABLE_CHAT_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[\w.-]+)?(:[\w.-]+\.gguf)?$")


def is_loadable_name(name: str, chat: bool = False) -> bool:
    """Whether a client may name `name` for loading: a store name or a hub id (for a `chat` model, with
    `@revision` and `:file.gguf`), never a path."""
    return bool((_LOADABLE_CHAT_NAME if chat else _LOADABLE_NAME).match(name)) and ".." not in name


def refuse_speech_model(name: str) -> None:
    """400 for a Whisper model (or `whisper-1`, the default one) named on a text endpoint (it would be loaded as a
    text model in the chat model's place)."""
    from tfserve.models import store

    if name in OPENAI_NAMES or store.is_speech_model(name):
        raise ApiError(400, f"{name!r} is a speech-to-text model: send audio to /v1/audio/transcriptions or "
                       "/v1/audio/translations", param="model", code="model_not_supported")
