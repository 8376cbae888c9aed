"""`tfserve bench serve`: stream requests to any OpenAI-compatible server (optionally launched first, once per
model) and report throughput and latency percentiles, over a sweep of one setting."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

from tfserve.cli.bench_common import DatasetOpt, NumPromptsOpt, OutputJsonOpt, served_model, show_result
from tfserve.cli.completion import choices
from tfserve.cli.options import DEFAULT_MODEL
from tfserve.cli.output import bad_value_message, console, err_console, to_json, writable, write_text
from tfserve.errors import TfserveError, UsageError

ENDPOINTS = ("chat", "completions")  # what `bench serve --endpoint` sends to
InputLenOpt = Annotated[int | None, typer.Option("--input-len", min=1, help="Random prompts of this many tokens.")]


def serve(
    ctx: typer.Context,
    url: Annotated[str, typer.Option("--url", help="Server URL (host:port, http://host:port or .../v1).")] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Model name to send in requests (default: the first the server lists in /v1/models).")] = None,
    num_prompts: NumPromptsOpt = 64,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Requests in flight at most.")] = 32,
    request_rate: Annotated[float | None, typer.Option("--request-rate", min=0.001,
                                                       help="Poisson arrivals per second (default: all at once).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Output tokens per request.")] = 128,
    input_len: InputLenOpt = None,
    dataset: DatasetOpt = None,
    endpoint: Annotated[str, typer.Option("--endpoint", autocompletion=choices(*ENDPOINTS),
                                          help="chat or completions.")] = "chat",
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Send ignore_eos (tfserve, vLLM) for fixed lengths.")] = False,
    extra_body: Annotated[str | None, typer.Option("--extra-body", help="JSON merged into every request body.")] = None,
    image: Annotated[Path | None, typer.Option(
        "--image", help="Send this image (a data URL image_url part) with chat requests: a vision model's run.",
        show_default=False)] = None,
    image_fraction: Annotated[float, typer.Option(
        "--image-fraction", min=0.0, max=1.0, help="With --image: the share of requests that carry it (the rest "
                                                   "are text only), spread evenly.")] = 1.0,
    api_key: Annotated[str, typer.Option("--api-key", envvar="TFSERVE_API_KEY", help="Bearer token.")] = "EMPTY",
    launch: Annotated[str | None, typer.Option("--launch", help="Start this server command first; stop it after.")] = None,
    models: Annotated[str | None, typer.Option(
        "--models", metavar="FILE,FILE",
        help="Run everything once per model: --launch starts the server with each in place of {model} (GGUF files, "
             "directories, names), and each run reports the server's start time and resident memory.",
        show_default=False)] = None,
    launch_timeout: Annotated[float, typer.Option("--launch-timeout", min=0.001,
                                                  help="Seconds to wait for it.")] = 600.0,
    sweep: Annotated[str | None, typer.Option("--sweep", help="A series, e.g. concurrency=1,8,32.")] = None,
    prompts_per_concurrency: Annotated[int | None, typer.Option(
        "--prompts-per-concurrency", min=1,
        help="Send max(4, K x concurrency) prompts per run instead of --num-prompts (for sweeps).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="With --sweep: PNG of throughput and TTFT.")] = None,
    output_json: OutputJsonOpt = None,
) -> None:
    """Stream requests to an OpenAI-compatible server and report throughput and latency percentiles.

    Any such server: tfserve, vLLM, llama.cpp's llama-server, transformers serve. --launch starts it first (its
    output shown if it dies before it is ready) and stops it after.

    [bold]Examples[/bold]

      tfserve bench serve --url localhost:8000 -c 32 --max-tokens 128 --ignore-eos
      tfserve bench serve --launch "tfserve serve --port 8011" --url localhost:8011 --sweep concurrency=1,8,32
      tfserve bench serve --url localhost:8000 --request-rate 4 --dataset prompts.jsonl -o run.json
      tfserve bench serve --url localhost:8000 --image cat.png --image-fraction 0.5   # a vision model
      tfserve bench serve --launch "llama-server -m model.gguf -np 32 -c 32768 -t 2 --port 8080" --url localhost:8080
      tfserve bench serve --launch "tfserve serve --model {model} --port 8011" --url localhost:8011 \\
          --models a.Q4_K_M.gguf,b.Q8_0.gguf --sweep concurrency=1,32   # start time, memory, tok/s per file
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tfserve.bench.datasets import builtin_prompts, load_file, random_text_prompts, take
    from tfserve.bench.launch import check_reachable, launched
    from tfserve.bench.metrics import summarize
    from tfserve.bench.online import OnlineConfig, run_online
    from tfserve.bench.report import plot_sweep
    from tfserve.bench.settings import run_settings

    if endpoint not in ENDPOINTS:
        raise UsageError(f"--endpoint must be chat or completions, not {endpoint!r}")
    writable(output_json, "--output-json")
    writable(plot, "--plot")
    if plot is not None and not sweep:
        raise UsageError("--plot needs --sweep (it draws throughput and TTFT across the sweep's values)")
    from tfserve.chat.client import openai_base_url

    base_url = openai_base_url(url)  # as `tfserve chat` reads its URL; anything else is a usage error
    extra = _parse_json(extra_body, "--extra-body")
    image_url = _image_data_url(image, endpoint) if image is not None else None
    sweep_key, sweep_values = _parse_sweep(sweep, ctx) if sweep else ("concurrency", [concurrency])
    largest = max(num_prompts, *(max(4, prompts_per_concurrency * c) for c in sweep_values
                                 if prompts_per_concurrency and sweep_key == "concurrency"), 0)
    if dataset is not None:
        all_prompts = take(load_file(dataset), largest)
    elif input_len is not None:
        all_prompts = random_text_prompts(largest, input_len, _local_tokenizer(model or DEFAULT_MODEL))
    else:
        all_prompts = take(builtin_prompts(), largest)

    def serve_runs(model: str) -> list[dict]:
        """One run per sweep value against the server at base_url."""
        runs = []
        for value in sweep_values:
            config = OnlineConfig(base_url=base_url, model=model, max_tokens=max_tokens, concurrency=concurrency,
                                  request_rate=request_rate, endpoint=endpoint, api_key=api_key,
                                  ignore_eos=ignore_eos, extra_body=extra, image_url=image_url,
                                  image_fraction=image_fraction)
            setattr(config, sweep_key, value)
            count = num_prompts
            if prompts_per_concurrency and sweep_key == "concurrency":
                count = max(4, prompts_per_concurrency * value)
            prompts = all_prompts[:count]
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(),
                          console=err_console, transient=True) as progress:
                task = progress.add_task(f"{sweep_key}={value}", total=len(prompts), failed=0)
                failures = []

                def done(record, task=task, failures=failures):
                    if not record.ok:
                        failures.append(record.error)
                    progress.update(task, advance=1, failed=len(failures))

                records, duration = asyncio.run(run_online(config, prompts, on_done=done))
            result = summarize(records, duration)
            for message in list(dict.fromkeys(f for f in failures if f))[:3]:
                err_console.print(f"[red]failed:[/] {message}", highlight=False)
            runs.append(result)
            show_result(result, f"{base_url} {model} {sweep_key}={value}", None)
        return runs

    model_files = _models(models, launch)
    per_model = []
    for model_file in model_files:
        command = launch.replace("{model}", shlex.quote(model_file)) if model_file is not None else launch
        with launched(command, base_url, launch_timeout) as process:
            check_reachable(base_url, loading_timeout_s=launch_timeout)
            served = served_model(base_url, api_key, None if model_file else model)  # a refused key...: one line
            memory = {"start_s": round(process.ready_s, 2), "rss_mb_ready": _rss_mb(process)} if process else {}
            runs = serve_runs(served)
            if process is not None:
                memory["rss_mb_after"] = _rss_mb(process)
                err_console.print(f"{model_file or served}: ready in {memory['start_s']:.1f} s, resident "
                                  f"{memory['rss_mb_ready']:,} MB after the load, {memory['rss_mb_after']:,} MB after "
                                  "the runs", highlight=False)
        per_model.append({"model": model_file or served, **memory, "runs": runs})
    if models is not None:
        console.print(_models_table(per_model, sweep_key, sweep_values))
        if output_json is not None:
            settings = run_settings("serve", ctx.params, url=base_url)
            write_text(output_json, to_json({"sweep": sweep_key, "values": sweep_values, "models": per_model,
                                             "settings": settings}))
        if all(run["completed"] == 0 for entry in per_model for run in entry["runs"]):
            raise TfserveError("every request failed (see above)")
        return
    runs, model = per_model[0]["runs"], per_model[0]["model"]
    if output_json is not None:
        settings = run_settings("serve", ctx.params, url=base_url, model=model)
        payload = runs[0] if not sweep else {"sweep": sweep_key, "values": sweep_values, "runs": runs}
        write_text(output_json, to_json({**payload, "settings": settings}))
    if plot is not None:
        plot_sweep([(model, sweep_values, runs)], plot, sweep_key)
    if all(run["completed"] == 0 for run in runs):
        raise TfserveError("every request failed (see above)")


def _models(models: str | None, launch: str | None) -> list[str | None]:
    """--models as a list (one None: the server --launch or --url names), checked against --launch."""
    if models is None:
        return [None]
    if not launch or "{model}" not in launch:
        raise UsageError("--models needs --launch with {model} where each model goes, e.g. --launch "
                         "\"tfserve serve --model {model} --port 8011\"")
    names = [name.strip() for name in models.split(",") if name.strip()]
    if not names:
        raise UsageError("--models names no model")
    return names


def _rss_mb(process) -> int:
    from tfserve.bench.launch import tree_rss_bytes

    return round(tree_rss_bytes(process.pid) / 2**20)


def _models_table(per_model: list[dict], sweep_key: str, values: list):
    """One row per model: start, memory, output tokens per second at each sweep value."""
    from rich.table import Table

    table = Table(title="models")
    for column in ("model", "start s", "RSS MB (loaded)", "RSS MB (after)"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for value in values:
        table.add_column(f"tok/s {sweep_key}={value}", justify="right")
    for entry in per_model:
        rates = [f"{run.get('output_throughput', 0):.1f}" for run in entry["runs"]]
        table.add_row(Path(entry["model"]).name, f"{entry.get('start_s', 0):.1f}", f"{entry.get('rss_mb_ready', 0):,}",
                      f"{entry.get('rss_mb_after', 0):,}", *rates)
    return table


def _image_data_url(path: Path, endpoint: str) -> str:
    """--image as a data URL, or one line saying why not."""
    import base64
    import mimetypes

    if endpoint != "chat":
        raise UsageError("--image needs --endpoint chat (images travel as chat content parts)")
    mime = mimetypes.guess_type(path.name)[0]
    if mime not in ("image/png", "image/jpeg", "image/webp", "image/gif"):
        raise UsageError(f"--image {path}: not a PNG, JPEG, WebP or GIF file (by its name)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"--image {path}: {exc.strerror or exc}") from None
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"



def _parse_json(text: str | None, flag: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} is not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object")
    return value


def _parse_sweep(text: str, ctx: typer.Context) -> tuple[str, list]:
    """--sweep KEY=V1,V2,...: each value checked as the option KEY names would check it (its type, its range)."""
    key, _, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if key not in ("concurrency", "request_rate", "max_tokens") or not values:
        raise UsageError("--sweep takes KEY=V1,V2,... with KEY one of concurrency, request_rate, max_tokens")
    option = next(param for param in ctx.command.params if param.name == key)
    parsed = []
    for value in values.split(","):
        try:
            parsed.append(option.process_value(ctx, value.strip()))
        except typer.BadParameter as exc:
            raise UsageError(f"--sweep {key}={value.strip()}: {bad_value_message(exc, exc.message)}") from None
    return key, parsed


def _local_tokenizer(model: str):
    """The model's tokenizer when it is on this machine (for exact random prompt lengths), else None."""
    try:
        from transformers import AutoTokenizer

        from tfserve.models.loading import resolve_model

        resolved = resolve_model(model)
        if resolved.kind == "gguf":
            return None
        return AutoTokenizer.from_pretrained(str(resolved.path))
    except Exception:
        return None
