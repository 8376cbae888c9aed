"""`tfserve transcribe FILE`: speech to text on the command line, with the server's Whisper batcher in-process."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from tfserve.cli.completion import speech_models
from tfserve.cli.output import writable, write_text
from tfserve.errors import TfserveError, UsageError


class AudioFormat(str, Enum):
    text = "text"
    json = "json"
    verbose_json = "verbose_json"
    srt = "srt"
    vtt = "vtt"


def transcribe(
    file: Annotated[Path, typer.Argument(
        show_default=False, help="Audio in any common format: wav, flac, mp3, ogg/opus, m4a, webm...")],
    model: Annotated[str, typer.Option(
        "--model", "-m", autocompletion=speech_models,
        help="Whisper model: a store name (catalog ones are pulled on first use), an HF directory or a cached "
             "hub id.")] = "whisper-tiny.en",
    response_format: Annotated[AudioFormat, typer.Option(
        "--format", "-f", help="What to print: plain text, OpenAI's json or verbose_json, or subtitles.")
    ] = AudioFormat.text,
    language: Annotated[str | None, typer.Option(
        "--language", "-l", show_default=False,
        help="Spoken language (ISO 639-1, e.g. fr); multilingual models detect it when left out.")] = None,
    translate: Annotated[bool, typer.Option(
        "--translate", help="Translate into English (multilingual models).")] = False,
    prompt: Annotated[str | None, typer.Option(
        show_default=False, help="Text to condition on: names, spellings, the previous part.")] = None,
    temperature: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="0: greedy, falling back to sampling on a repetition loop.")] = 0.0,
    words: Annotated[bool, typer.Option(
        "--words", help="Time every word too: verbose_json gets a `words` list, srt and vtt a cue per word "
                        "(text and json have no times to carry them).")] = False,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", show_default=False, help="Write to this file instead of standard output.")] = None,
    max_audio_windows: Annotated[int, typer.Option(
        min=1, help="30-second windows decoded together.")] = 8,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
) -> None:
    """Transcribe (or translate) an audio file with Whisper.

    The model runs in this process, on the server's Whisper batcher: a long file's 30-second windows are
    decoded together (--max-audio-windows at a time).

    [bold]Examples[/bold]

      tfserve transcribe talk.mp3
      tfserve transcribe talk.mp3 --format srt -o talk.srt
      tfserve transcribe talk.mp3 --format vtt --words    # a cue per word (karaoke-style captions)
      tfserve transcribe interview.m4a -m whisper-base --translate
    """
    if words and response_format in (AudioFormat.text, AudioFormat.json):
        raise typer.BadParameter(f"--format {response_format.value} has no timestamps to carry word times; use "
                                 "--format verbose_json, srt or vtt", param_hint="--words")
    writable(output, "--output")
    from tfserve.audio import formats
    from tfserve.audio.decode import AudioError, decode_audio
    from tfserve.audio.job import TranscriptionOptions
    from tfserve.audio.transcriber import Transcriber
    from tfserve.audio.whisper_model import SpeechRequestError, WhisperModel, language_code
    from tfserve.cli.progress import step_progress
    from tfserve.models.loading import resolve_device

    if language is not None and language_code(language) is None:  # now, not after the model loads
        raise typer.BadParameter(f"{language!r} is not a language Whisper knows; give an ISO 639-1 code such as "
                                 "en or fr", param_hint="--language")
    device = resolve_device(device)  # a device this machine lacks fails now, in one line
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise TfserveError(f"cannot read {file}: {exc.strerror or exc}") from None
    try:
        audio = decode_audio(data)
    except AudioError as exc:
        raise TfserveError(f"{file}: {exc}") from None
    with step_progress() as progress:
        progress(f"Loading {model}")
        whisper = WhisperModel.from_spec(model, progress=progress, device=device)
    task = "translate" if translate else "transcribe"
    try:
        code = whisper.check_request(language, task)
    except SpeechRequestError as exc:
        raise UsageError(f"--{exc.param}: {exc}" if exc.param == "model" else str(exc)) from None
    options = TranscriptionOptions(task=task, language=code, prompt=prompt, temperature=temperature,
                                   word_timestamps=words)
    transcriber = Transcriber(whisper, max_audio_windows).start()
    try:
        result = _run(transcriber, audio, options, file.name)
    except Exception as exc:  # the model failed (logged with its traceback): one line here
        raise TfserveError(f"transcribing {file} failed: {type(exc).__name__}: {exc}") from None
    finally:
        transcriber.stop()
    body = formats.render(result, response_format.value, task, include_words=words, usage=formats.usage(result))
    text = json.dumps(body, ensure_ascii=False, indent=2) + "\n" if isinstance(body, dict) else body
    if output is None:
        typer.echo(text, nl=False)
    else:
        write_text(output, text)


def _run(transcriber, audio, options, name: str):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tfserve.cli.output import err_console

    total_s = len(audio) / 16000
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[detail]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
        task = bar.add_task(f"Transcribing {name}", total=total_s, detail=f"0:00 / {_clock(total_s)}")

        def on_segments(job, segments) -> None:
            done_s = min(job.seek / 100, total_s)
            bar.update(task, completed=done_s, detail=f"{_clock(done_s)} / {_clock(total_s)}")

        return transcriber.transcribe(audio, options, on_segments)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
