"""The multipart form of an audio request, read and checked: every field OpenAI defines for
/v1/audio/transcriptions and /v1/audio/translations, a 400 naming the field that is wrong, 413 for a file over
the body limit. Fields OpenAI added that tfserve does not use (`chunking_strategy`, `include[]`) are accepted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.multipart import BodyPartReader

from tfserve.audio.formats import RESPONSE_FORMATS
from tfserve.sampling_params import RANGES
from tfserve.server.errors import ApiError, bad_request

GRANULARITIES = ("segment", "word")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


# aiohttp raises RuntimeError for an unknown transfer encoding
_UNREADABLE = (ValueError, UnicodeDecodeError, AssertionError, LookupError, RuntimeError)


@dataclass(slots=True)
class AudioForm:
    """An audio request's fields."""

    file: bytes = b""
    filename: str | None = None
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    response_format: str = "json"
    granularities: list[str] = field(default_factory=list)  # timestamp_granularities[]
    stream: bool = False


async def read_form(request: web.Request, task: str) -> AudioForm:
    """The form of `request`; 400 for a body that is not multipart/form-data or a bad field."""
    if not request.content_type.startswith("multipart/"):
        raise bad_request("send the audio as multipart/form-data with a `file` field (and `model`, "
                          "`response_format`, ... as form fields)", "file")
    try:
        reader = await request.multipart()
        form, has_file = AudioForm(), False
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):  # a multipart part nested in the form
                raise bad_request("the form's parts must be plain fields and files, not nested multipart bodies",
                                  "file")
            name = part.name or ""
            if name != "file" and name not in _SETTERS:  # not a field of OpenAI's form that tfserve reads: unread
                await part.release()
                continue
            try:
                if name == "file":
                    if has_file:  # which one to transcribe is not ours to guess
                        raise bad_request("the form holds two `file` fields: send one audio file", "file")
                    form.file, form.filename = await _read_file(part, request.client_max_size), part.filename
                    has_file = True
                    continue
                value = await part.text()
            except _UNREADABLE as exc:  # an unknown charset or transfer encoding, bytes that are not text
                raise bad_request(f"{name}: the form field could not be read: {exc}", name) from None
            _SETTERS[name](form, value, task)
    except ApiError:
        raise
    except _UNREADABLE as exc:  # a malformed body
        raise bad_request(f"the multipart body could not be read: {exc}", "file") from None
    if not has_file:
        raise bad_request("the `file` field is missing: send the audio file as a multipart file field", "file")
    if form.stream and form.response_format not in ("json", "text"):
        raise bad_request(f"stream: streaming sends text deltas; it needs response_format json or text, not "
                          f"{form.response_format!r}", "stream")
    if "word" in form.granularities and form.response_format != "verbose_json":
        raise bad_request("timestamp_granularities[]: word timestamps need response_format verbose_json",
                          "timestamp_granularities[]")
    return form


async def _read_file(part, max_bytes: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(1 << 16):
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the file is larger than the server's body limit of {max_bytes} bytes "
                                f"(see --max-body-size)", param="file", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _model(form: AudioForm, value: str, task: str) -> None:
    form.model = value.strip() or None


def _language(form: AudioForm, value: str, task: str) -> None:
    if task == "translate":
        raise bad_request("language: translations are always into English; the spoken language is detected "
                          "(leave `language` out)", "language")
    form.language = value.strip() or None


def _prompt(form: AudioForm, value: str, task: str) -> None:
    form.prompt = value or None


def _set_temperature(form: AudioForm, value: str, task: str) -> None:
    form.temperature = _temperature(value)


def _response_format(form: AudioForm, value: str, task: str) -> None:
    if value not in RESPONSE_FORMATS:
        raise bad_request(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {value!r}",
                          "response_format")
    form.response_format = value


def _granularity(form: AudioForm, value: str, task: str) -> None:
    if value not in GRANULARITIES:
        raise bad_request(f"timestamp_granularities[] must be among {', '.join(GRANULARITIES)}, got {value!r}",
                          "timestamp_granularities[]")
    form.granularities.append(value)


def _stream(form: AudioForm, value: str, task: str) -> None:
    lowered = value.strip().lower()
    if lowered not in _TRUE + _FALSE:
        raise bad_request(f"stream must be true or false, got {value!r}", "stream")
    form.stream = lowered in _TRUE


# the text fields read, each by its setter (others are skipped)
_SETTERS: dict[str, Callable[[AudioForm, str, str], None]] = {
    "model": _model, "language": _language, "prompt": _prompt, "temperature": _set_temperature,
    "response_format": _response_format, "timestamp_granularities[]": _granularity,
    "timestamp_granularities": _granularity, "stream": _stream}


def _temperature(value: str) -> float:
    """The form's temperature (text), in the range of the one table (`RANGES["transcription_temperature"]`)."""
    limits = RANGES["transcription_temperature"]
    try:
        temperature = float(value)
    except ValueError:
        raise bad_request(f"temperature must be a number {limits.what()}, got {value!r}", "temperature") from None
    if not limits.accepts(temperature):  # NaN and infinities too
        raise bad_request(f"temperature must be {limits.what()}, got {value!r}", "temperature")
    return temperature
