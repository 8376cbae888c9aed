"""POST /v1/audio/transcriptions and /v1/audio/translations: multipart as OpenAI defines them, answered by the
Whisper transcriber of the model the request names (loaded on demand beside the chat model).

Response formats json | text | srt | vtt | verbose_json; `stream=true` sends OpenAI's `transcript.text.delta`
events as segments are decoded, then `transcript.text.done`. A client that disconnects aborts its job.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tfserve.audio import formats
from tfserve.audio.decode import AudioError, decode_audio
from tfserve.audio.job import TranscriptionOptions
from tfserve.audio.whisper_model import SpeechRequestError
from tfserve.server.api.audio_form import AudioForm, read_form
from tfserve.server.body import while_arriving
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.runtime.state import STATE
from tfserve.server.sse import EventStream


async def transcriptions(request: web.Request) -> web.StreamResponse:
    return await _answer(request, "transcribe")


async def translations(request: web.Request) -> web.StreamResponse:
    return await _answer(request, "translate")


async def _answer(request: web.Request, task: str) -> web.StreamResponse:
    state = request.app[STATE]
    state.check_available()
    form = await while_arriving(request, read_form(request, task))
    speech = state.speech
    transcriber = await speech.get(form.model, state.model_aliases)
    try:
        language = transcriber.whisper.check_request(form.language, task)
    except SpeechRequestError as exc:
        code = "model_not_supported" if exc.param == "model" else "invalid_language"
        raise bad_request(str(exc), exc.param, code=code) from None
    try:
        audio = await asyncio.to_thread(decode_audio, form.file, max_seconds=speech.options.max_audio_s)
    except AudioError as exc:
        raise bad_request(f"file: {exc}", "file", code="invalid_audio") from None

    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    options = TranscriptionOptions(task=task, language=language, prompt=form.prompt, temperature=form.temperature,
                                   word_timestamps="word" in form.granularities)
    job = await asyncio.to_thread(transcriber.make_job, audio, options,
                                  lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload)))
    transcriber.submit(job)
    finished = False
    try:
        if form.stream:
            response = await _stream(request, events)
        else:
            result = await _result(events)
            response = _respond(form, task, result)
        finished = True
        return response
    finally:
        if not finished:
            job.abort()  # the client left, or the answer failed: free its slot before the next step


async def _result(events: asyncio.Queue) -> Any:
    while True:
        kind, payload = await events.get()
        if kind == "done":
            return payload
        if kind == "error":
            raise ApiError(500, f"transcription failed: {type(payload).__name__}: {payload}", code="internal_error")


def _respond(form: AudioForm, task: str, result) -> web.Response:
    usage = formats.usage(result)
    body = formats.render(result, form.response_format, task, include_words="word" in form.granularities,
                          include_segments="segment" in form.granularities or not form.granularities, usage=usage)
    if isinstance(body, dict):
        return web.json_response(body)
    return web.Response(text=body, content_type=formats.CONTENT_TYPES[form.response_format])


async def _stream(request: web.Request, events: asyncio.Queue) -> web.StreamResponse:
    stream = EventStream(request)
    await stream.open()
    said, space = False, ""  # the deltas join to the done text: no space before the first, none held at the end
    while True:
        kind, payload = await events.get()
        if kind == "segments":
            text = space + "".join(s.text for s in payload)
            delta = text.strip() if not said else text.rstrip()
            space = text[len(text.rstrip()):]
            if delta:
                said = True
                await stream.send({"type": "transcript.text.delta", "delta": delta})
        elif kind == "done":
            await stream.send({"type": "transcript.text.done", "text": payload.text,
                               "usage": formats.token_usage(payload)})
            return await stream.close()
        else:
            await stream.send_error(ApiError(500, f"transcription failed: {payload}", code="internal_error"))
            return await stream.close()
