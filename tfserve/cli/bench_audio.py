"""`tfserve bench transcribe`: speech-to-text speed, in-process or against a server, at one or more
concurrencies."""

from __future__ import annotations

import asyncio
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from tfserve.cli.completion import speech_models
from tfserve.cli.output import console, err_console, to_json, writable, write_text
from tfserve.errors import TfserveError, UsageError


class AudioBackend(str, Enum):
    tfserve = "tfserve"
    transformers = "transformers"


def transcribe(
    ctx: typer.Context,
    files: Annotated[list[Path], typer.Argument(show_default=False, help="Audio files (any common format).")],
    url: Annotated[str | None, typer.Option(
        "--url", show_default=False, help="Send to this OpenAI-compatible server instead of running in-process.")
    ] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="Whisper model (store name, directory, hub id).",
                                       autocompletion=speech_models)] = "whisper-tiny.en",
    backend: Annotated[AudioBackend, typer.Option(
        help="In-process: tfserve's batched transcriber, or transformers' own ASR pipeline (the baseline).")
    ] = AudioBackend.tfserve,
    num_requests: Annotated[int, typer.Option("--num-requests", "-n", min=1, help="Transcriptions per run.")] = 8,
    concurrency: Annotated[str, typer.Option(
        "--concurrency", "-c", help="Transcriptions in flight at most; a list (1,8) runs each in turn.")] = "1,8",
    clip_seconds: Annotated[float | None, typer.Option(
        "--clip-seconds", min=0.5, show_default=False,
        help="Cut (or loop) the audio into clips of this length; default: the files as they are.")] = None,
    device: Annotated[str, typer.Option(
        "--device", help="In-process: auto, cpu, cuda or cuda:N.")] = "auto",
    api_key: Annotated[str, typer.Option("--api-key", envvar="TFSERVE_API_KEY", help="Bearer token.")] = "EMPTY",
    output_json: Annotated[Path | None, typer.Option("--output-json", "-o", help="Write the results as JSON here.")
                           ] = None,
) -> None:
    """Transcribe audio at each concurrency and report the real-time factor and latencies.

    Concurrency 1 is one transcription after another; higher concurrencies share encoder passes and decoder
    steps (tfserve), or take turns (transformers' pipeline).

    [bold]Examples[/bold]

      tfserve bench transcribe talk.wav --clip-seconds 10 -n 8 -c 1,8
      tfserve bench transcribe talk.wav --clip-seconds 10 -n 8 -c 1 --backend transformers
      tfserve bench transcribe talk.wav --url localhost:8000 -c 8
    """
    from tfserve.audio.decode import AudioError, decode_audio
    from tfserve.bench.audio import clips
    from tfserve.bench.settings import run_settings

    levels = _concurrencies(concurrency)
    writable(output_json, "--output-json")
    if url is None:
        from tfserve.models.loading import resolve_device

        device = resolve_device(device)  # a device this machine lacks fails now, in one line
    else:
        from tfserve.bench.launch import check_reachable
        from tfserve.chat.client import openai_base_url
        from tfserve.cli.bench_common import served_model

        url = openai_base_url(url)
        check_reachable(url, launch_hint=False)  # one line now, not a table of failures
        served_model(url, api_key, model, chat=False)
    audio = []
    for path in files:
        try:
            audio.append(decode_audio(path.read_bytes()))
        except (OSError, AudioError) as exc:
            raise TfserveError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    inputs = clips(audio, num_requests, clip_seconds)
    if url is not None:
        label, run = f"{url} {model}", _online(url, model, api_key)
    else:
        label, run = f"{backend.value} {model}", _offline(model, backend, device)
    runs = []
    for level in levels:
        result = {"backend": "online" if url else backend.value, "model": model, "concurrency": level,
                  **run(inputs, level)}
        runs.append(result)
        _show(result, f"{label} concurrency={level}")
    if output_json is not None:
        settings = run_settings("transcribe", ctx.params, concurrency=levels, url=url)
        payload = runs[0] if len(runs) == 1 else {"runs": runs}
        write_text(output_json, to_json({**payload, "settings": settings}))
    if all(run["num_failed"] == run["num_requests"] for run in runs):
        raise TfserveError("every transcription failed (see above)")


def _offline(model: str, backend: AudioBackend, device: str):
    from tfserve.audio.transcriber import Transcriber
    from tfserve.audio.whisper_model import WhisperModel
    from tfserve.bench.audio import run_offline, summarize, transformers_pipeline
    from tfserve.cli.progress import step_progress

    with step_progress() as progress:
        progress(f"Loading {model}")
        whisper = WhisperModel.from_spec(model, progress=progress, device=device)
    if backend == AudioBackend.transformers:
        transcribe_one = transformers_pipeline(whisper)
    else:
        transcriber = Transcriber(whisper, max_num_windows=8).start()  # a daemon thread: ends with the command

        def transcribe_one(audio) -> str:
            return transcriber.transcribe(audio).text

    def run(inputs, level: int) -> dict:
        # warm up at the level measured, a second of audio a request: first-call allocations, thread pools, and
        # the first batch of each size's kernel choices (cuBLAS, cuDNN) are not the run's
        run_offline(transcribe_one, [audio[:16000] for audio in inputs[:level]], level)
        records, wall_s = _with_progress(inputs, level, lambda done: run_offline(transcribe_one, inputs, level, done))
        return summarize(records, wall_s)

    return run


def _online(base_url: str, model: str, api_key: str):
    from tfserve.bench.audio import run_online, summarize

    def run(inputs, level: int) -> dict:
        records, wall_s = _with_progress(
            inputs, level, lambda done: asyncio.run(run_online(base_url, model, inputs, level, api_key, done)))
        return summarize(records, wall_s)

    return run


def _with_progress(inputs, level: int, start):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task(f"concurrency={level}", total=len(inputs))
        return start(lambda record: progress.update(task, advance=1))


def _show(result: dict, title: str) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    latency = result["latency_ms"]
    rows = [("requests", f"{result['num_requests']} ({result['num_failed']} failed)"),
            ("audio", f"{result['audio_s']:.1f} s"), ("wall time", f"{result['wall_s']:.2f} s"),
            ("real-time factor", f"{result['rtf']}" if result["rtf"] is not None else "-"),
            ("x real time", f"{result['x_realtime']}"),
            ("latency p50 / p90 / p99", f"{latency['p50']:.0f} / {latency['p90']:.0f} / {latency['p99']:.0f} ms")]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for error in result["errors"]:
        err_console.print(f"[red]failed:[/] {error}", highlight=False)


def _concurrencies(text: str) -> list[int]:
    try:
        levels = [int(value) for value in text.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency takes numbers separated by commas, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise UsageError("--concurrency values must be at least 1")
    return levels
