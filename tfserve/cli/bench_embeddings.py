"""`tfserve bench embeddings`: sentence-embedding speed, tfserve's encoder in-process or a server's /v1/embeddings at
one or more concurrencies, beside sentence-transformers' `encode` of the same model in the same run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from tfserve.cli.output import console, err_console, to_json, writable, write_text
from tfserve.errors import TfserveError, UsageError


def embeddings(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", "-m", help="Embedding model (store name, directory, hub id).")
                     ] = "all-minilm-l6-v2",
    url: Annotated[str | None, typer.Option(
        "--url", show_default=False, help="Send to this server's /v1/embeddings instead of running in-process.")
    ] = None,
    batch: Annotated[str, typer.Option("--batch", "-b", help="Inputs per request; a list (1,32) runs each.")] = "1,32",
    concurrency: Annotated[str, typer.Option(
        "--concurrency", "-c", help="With --url: requests in flight at most; a list (1,8) runs each.")] = "1",
    num_inputs: Annotated[int, typer.Option("--num-inputs", "-n", min=1, help="Sentences embedded per run.")] = 256,
    baseline: Annotated[bool, typer.Option(
        "--baseline/--no-baseline", help="Also run sentence-transformers' encode on the same model and inputs "
                                         "(in-process; needs sentence-transformers).")] = True,
    device: Annotated[str, typer.Option("--device", help="In-process: cpu, cuda or cuda:N.")] = "cpu",
    api_key: Annotated[str, typer.Option("--api-key", envvar="TFSERVE_API_KEY", help="Bearer token.")] = "EMPTY",
    output_json: Annotated[Path | None, typer.Option("--output-json", "-o", help="Write the results as JSON here.")
                           ] = None,
) -> None:
    """Embed the same sentences (8-48 words) in requests of --batch inputs; report inputs/s, tokens/s, latencies.

    In-process, tfserve's encoder (length-bucketed forwards, SDPA) runs beside sentence-transformers' encode of the
    same folder; with --url, the server's /v1/embeddings at each --concurrency, and the baseline in-process.

    [bold]Examples[/bold]

      tfserve bench embeddings --model all-minilm-l6-v2 --batch 1,32
      tfserve bench embeddings --url localhost:8000 --batch 1,32 -c 1,16 --no-baseline
    """
    from tfserve.bench.embeddings import batches, sentence_transformers_embed, sentences, tfserve_embed
    from tfserve.bench.settings import run_settings

    sizes, levels = _numbers(batch, "--batch"), _numbers(concurrency, "--concurrency")
    writable(output_json, "--output-json")
    if url is not None:
        from tfserve.bench.launch import check_reachable
        from tfserve.chat.client import openai_base_url

        url = openai_base_url(url)
        check_reachable(url, launch_hint=False)
    encoder, path = _load(model, device)
    texts = sentences(num_inputs)
    num_tokens = sum(len(ids) for ids in encoder.tokenize(texts, truncate=True))
    in_process = {"tfserve": tfserve_embed(encoder)} if url is None else {}
    if baseline:
        try:
            in_process["sentence-transformers"] = sentence_transformers_embed(str(path), device)
        except ImportError as exc:
            raise TfserveError(f"{exc} (or pass --no-baseline)") from None
    runs = []
    for size in sizes:
        if url is not None:
            for level in levels:
                runs.append({"backend": "tfserve (server)", "model": model, "batch": size, "concurrency": level,
                             **_online(url, model, api_key, batches(texts, size), level, num_tokens)})
        for name, result in _offline(in_process, texts, size, num_tokens).items():
            runs.append({"backend": name, "model": model, "batch": size, "concurrency": 1, **result})
    _show(runs, f"embeddings: {model}, {num_inputs} sentences, {num_tokens} tokens")
    if output_json is not None:
        settings = run_settings("embeddings", ctx.params, batch=sizes, concurrency=levels, url=url)
        write_text(output_json, to_json({"runs": runs, "settings": settings}))
    if all(run["num_failed"] == run["num_requests"] for run in runs):
        raise TfserveError("every request failed (see above)")


def _load(model: str, device: str):
    from tfserve.cli.progress import step_progress
    from tfserve.embeddings.encoder import Encoder
    from tfserve.models.loading import resolve_model

    with step_progress() as progress:
        progress(f"Loading {model}")
        encoder = Encoder.from_spec(model, device=device)
    return encoder, resolve_model(model).path


def _offline(embeds: dict, texts: list[str], size: int, num_tokens: int) -> dict[str, dict]:
    """Each in-process backend over the same batches, interleaved; its figures by name."""
    from tfserve.bench.embeddings import batches, run_interleaved, summarize

    if not embeds:
        return {}
    warm = {name: batches(texts[:2 * size], size) for name in embeds}
    run_interleaved(embeds, warm)  # first-call allocations and thread pools are not the run's
    work = {name: batches(texts, size) for name in embeds}
    times = run_interleaved(embeds, work)
    return {name: summarize(work[name], times[name], num_tokens) for name in embeds}


def _online(url: str, model: str, api_key: str, work, level: int, num_tokens: int) -> dict:
    from tfserve.bench.embeddings import run_online, summarize

    asyncio.run(run_online(url, model, work[:level], level, api_key))  # warm up
    for item in work:
        item.latency_s, item.error = 0.0, None
    return summarize(work, asyncio.run(run_online(url, model, work, level, api_key)), num_tokens)


def _show(runs: list[dict], title: str) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("backend", "batch", "conc.", "inputs/s", "tokens/s", "p50 ms", "p99 ms", "vs ST"):
        table.add_column(column, justify="left" if column == "backend" else "right", overflow="fold")
    baseline = {run["batch"]: run["inputs_per_s"] for run in runs if run["backend"] == "sentence-transformers"}
    for run in runs:
        latency, base = run["latency_ms"], baseline.get(run["batch"])
        ratio = f"{run['inputs_per_s'] / base:.2f}x" if base and run["inputs_per_s"] else "-"
        table.add_row(run["backend"], str(run["batch"]), str(run["concurrency"]), f"{run['inputs_per_s']}",
                      f"{run['tokens_per_s']}", f"{latency['p50']:.1f}", f"{latency['p99']:.1f}", ratio)
    console.print(table)
    for run in runs:
        for error in run["errors"]:
            err_console.print(f"[red]failed:[/] {error}", highlight=False)


def _numbers(text: str, flag: str) -> list[int]:
    try:
        values = [int(value) for value in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} takes numbers separated by commas, not {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} values must be at least 1")
    return values
