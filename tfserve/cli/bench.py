"""`tfserve bench`: offline (engine in-process) and online (any OpenAI-compatible server) runs, and
side-by-side comparison of their JSON results."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer

from tfserve.cli import bench_audio, bench_embeddings
from tfserve.cli.completion import chat_models, choices
from tfserve.cli.options import (DEFAULT_MODEL, DeviceOpt, Dtype, DtypeOpt, ModelOpt, Quantization, QuantizationOpt,
                                 TensorParallelOpt, CompileOpt, CudaGraphOpt)
from tfserve.cli.output import bad_value_message, console, err_console, to_json, writable, write_text
from tfserve.errors import TfserveError, UsageError

app = typer.Typer(
    help="""Measure throughput and latency: offline (engine in-process) or online (any OpenAI-compatible URL).

    Each run prints a table and, with -o FILE, writes its JSON; `bench compare` sets such files side by side.

    [bold]Examples[/bold]

      tfserve bench offline --num-prompts 64 --output-len 128 -o offline.json
      tfserve bench serve --url localhost:8000 -c 32 --max-tokens 128 --ignore-eos -o online.json
      tfserve bench transcribe talk.wav --clip-seconds 10 -n 8 -c 1,8
      tfserve bench embeddings --model all-minilm-l6-v2 --batch 1,32
      tfserve bench compare online.json vllm.json
    """,
    no_args_is_help=True,
    rich_markup_mode="rich",
)
app.command("transcribe")(bench_audio.transcribe)
app.command("embeddings")(bench_embeddings.embeddings)

ENGINES = ("tfserve", "transformers", "transformers-static")  # what `bench offline --engine` runs
ENDPOINTS = ("chat", "completions")  # what `bench serve --endpoint` sends to
NumPromptsOpt = Annotated[int, typer.Option("--num-prompts", "-n", min=1, help="Requests to send.")]
OutputJsonOpt = Annotated[Path | None, typer.Option("--output-json", "-o", help="Write the result as JSON here.")]
DatasetOpt = Annotated[Path | None, typer.Option("--dataset", help="JSONL ({'prompt': ...}) or ShareGPT file.")]
InputLenOpt = Annotated[int | None, typer.Option("--input-len", min=1, help="Random prompts of this many tokens.")]


@app.command("offline")
def offline(
    ctx: typer.Context,
    model: ModelOpt = DEFAULT_MODEL,
    num_prompts: NumPromptsOpt = 64,
    input_len: Annotated[int | None, typer.Option("--input-len", min=1,
                                                  help="Random prompts of this many tokens (default 30-80).")] = None,
    output_len: Annotated[int, typer.Option("--output-len", min=1, help="Tokens generated per request.")] = 128,
    dataset: DatasetOpt = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help="Concurrent sequences.")] = 32,
    max_batch_tokens: Annotated[int, typer.Option("--max-batch-tokens", min=1, help="Token budget per step.")] = 512,
    engine: Annotated[str, typer.Option(
        "--engine", autocompletion=choices(*ENGINES),
        help="tfserve; transformers (its generate_batch); transformers-static (one left-padded model.generate of "
             "all prompts: with --num-prompts 1, single-stream generate).")] = "tfserve",
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    quantization: QuantizationOpt = Quantization.none,
    speculative: Annotated[str | None, typer.Option(
        "--speculative", autocompletion=choices("ngram", "draft"),
        help="ngram (prompt lookup) or draft (a draft model): speculative decoding (the tfserve engine).")] = None,
    speculative_model: Annotated[str | None, typer.Option(
        "--speculative-model", autocompletion=chat_models,
        help="The draft model of --speculative draft (implies it).", show_default=False)] = None,
    num_speculative_tokens: Annotated[int, typer.Option(
        "--num-speculative-tokens", min=1, max=16, help="Tokens proposed per step with --speculative.")] = 4,
    tensor_parallel_size: TensorParallelOpt = 1,
    compile_model: CompileOpt = False,
    cuda_graph: CudaGraphOpt = None,
    output_json: OutputJsonOpt = None,
) -> None:
    """Run the engine in-process on a fixed workload (greedy, EOS ignored, fixed output length).

    No server, no HTTP: the engine's own speed. --engine transformers runs transformers' generate on the same
    prompts, the baseline to compare with.

    [bold]Examples[/bold]

      tfserve bench offline --num-prompts 64 --output-len 128
      tfserve bench offline --engine transformers -o transformers.json
      tfserve bench offline --num-prompts 1 --max-num-seqs 1           # one stream
      tfserve bench offline --engine transformers-static --num-prompts 1
      tfserve bench offline --tensor-parallel-size 2 --dtype float32   # the model split over 2 ranks
    """
    from tfserve.bench import offline as bench_offline
    from tfserve.bench.metrics import summarize
    from tfserve.bench.settings import run_settings
    from tfserve.cli.loading import engine_config_from_flags, refuse_speech_model
    from tfserve.cli.progress import step_progress
    from tfserve.models.loading import load_model

    if engine not in ENGINES:
        raise UsageError(f"--engine must be tfserve, transformers or transformers-static, not {engine!r}")
    writable(output_json, "--output-json")
    refuse_speech_model(model, "benchmark it with `tfserve bench transcribe`")
    texts = None
    if dataset is not None:  # read (a missing or bad file is one line) before the model loads
        from tfserve.bench.datasets import load_file, take

        texts = take(load_file(dataset), num_prompts)
    with step_progress() as progress:
        if engine == "tfserve":  # the engine as `tfserve serve` builds it (weight formats, kernels)
            from tfserve.engine.engine import Engine

            config = engine_config_from_flags({"max_num_seqs": max_num_seqs, "max_batch_tokens": max_batch_tokens,
                                               "speculative": speculative, "speculative_model": speculative_model,
                                               "num_speculative_tokens": num_speculative_tokens,
                                               "tensor_parallel_size": tensor_parallel_size,
                                               "compile": compile_model,
                                               "cuda_graph": cuda_graph})
            ours = Engine.from_pretrained(model, config, dtype=dtype.value, device=device,
                                          quantization=quantization.value, progress=progress)
            loaded = SimpleNamespace(model=ours.model, tokenizer=ours.tokenizer, name=ours.model_name)
            ran_on = _engine_details(ours)
        else:
            loaded = load_model(model, dtype=dtype.value, device=device, quantization=quantization.value,
                                progress=progress)
            ran_on = {"device": str(loaded.model.device), "dtype": str(loaded.model.dtype).removeprefix("torch.")}
    tokenizer = loaded.tokenizer
    if texts is not None:
        prompts = [tokenizer.encode(p) for p in texts]
    else:
        low, high = (input_len, input_len) if input_len else (30, 80)
        prompts = bench_offline.random_prompts(num_prompts, low, high, loaded.model.config.get_text_config().vocab_size)
    with err_console.status(f"running {engine} on {num_prompts} prompts x {output_len} tokens"):
        records: list = []
        if engine == "tfserve":
            try:
                run = bench_offline.run_tfserve(ours, prompts, output_len, records=records)
            finally:
                ours.close()
        elif engine == "transformers":
            run = bench_offline.run_transformers_cb(loaded.model, prompts, output_len, max_num_seqs, max_batch_tokens)
        else:
            run = bench_offline.run_hf_static(loaded.model, prompts, output_len)
    if records:
        result = summarize(records, run.duration_s)
    else:
        from tfserve.bench.metrics import RequestRecord

        per_request = run.num_output_tokens // max(run.num_prompts, 1)
        result = summarize([RequestRecord(ok=True, prompt_tokens=run.num_prompt_tokens // run.num_prompts,
                                          output_tokens=per_request) for _ in range(run.num_prompts)], run.duration_s)
    settings = run_settings("offline", ctx.params, model_name=loaded.name, **ran_on,
                            mean_input_len=round(sum(map(len, prompts)) / max(len(prompts), 1), 1))
    _show(result, f"offline {engine}: {loaded.name}", output_json, settings)


@app.command("roofline")
def roofline(
    ctx: typer.Context,
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = Dtype.float32,
    batch: Annotated[int, typer.Option("--batch", min=1, max=256, help="Sequences of the batched decode step.")] = 32,
    output_len: Annotated[int, typer.Option("--output-len", min=8, help="Tokens each run decodes.")] = 64,
    rounds: Annotated[int, typer.Option("--rounds", min=1, max=20, help="Rounds of every measurement.")] = 3,
    output_json: OutputJsonOpt = None,
) -> None:
    """How close CPU decoding comes to this machine's limits, measured here and now.

    One sequence's step against reading the weights once (every weight streamed);
    a batch's step against the matmul roofline (2 FLOPs a parameter a sequence,
    at torch's own matmul rate here). Each round measures both back to back.

    [bold]Examples[/bold]

      tfserve bench roofline                       # float32, a batch of 32
      tfserve bench roofline --dtype float16 --batch 8 -o roofline.json
    """
    from tfserve.bench.roofline import measure
    from tfserve.bench.settings import run_settings
    from tfserve.cli.loading import engine_config_from_flags, refuse_speech_model
    from tfserve.cli.progress import step_progress
    from tfserve.engine.engine import Engine

    writable(output_json, "--output-json")
    refuse_speech_model(model, "benchmark it with `tfserve bench transcribe`")
    with step_progress() as progress:
        config = engine_config_from_flags({"max_num_seqs": batch, "max_batch_tokens": max(512, batch)})
        engine = Engine.from_pretrained(model, config, dtype=dtype.value, device="cpu", progress=progress)
    from rich.table import Table

    details = _engine_details(engine)
    table = Table(title=f"roofline: {engine.model_name} ({details['dtype']}, "
                        f"kernels {details['cpu_kernels'] or 'off'})")
    table.add_column("")
    try:
        with err_console.status(f"measuring {rounds} rounds"):
            results = measure(engine, batch, output_len, rounds)
    finally:
        engine.close()
    for r in results:
        table.add_column(f"round {r['round']}", justify="right")
    rows = [("read the weights, GB/s", "read_gb_s", "{:.1f}"), ("1 sequence: step, ms", "one_step_ms", "{:.2f}"),
            ("1 sequence: GB/s", "one_gb_s", "{:.1f}"), ("1 sequence: of the read", "one_of_read", "{:.0%}"),
            ("matmul float32, GFLOP/s", "matmul_gflops", "{:.0f}"),
            ("matmul bfloat16, GFLOP/s", "matmul_gflops_bf16", "{:.0f}"), (f"{batch} sequences: step, ms", "batch_step_ms", "{:.1f}"),
            (f"{batch} sequences: tok/s", "batch_tok_s", "{:.0f}"), ("roofline, tok/s", "roofline_tok_s", "{:.0f}"),
            (f"{batch} sequences: of the roofline", "batch_of_roofline", "{:.0%}")]
    for label, key, form in rows:
        table.add_row(label, *(form.format(r[key]) for r in results))
    console.print(table)
    if output_json is not None:
        settings = run_settings("roofline", ctx.params, model_name=engine.model_name, **details)
        write_text(output_json, to_json({"rounds": results, "settings": settings}))


def _engine_details(engine) -> dict:
    """What ran a tfserve engine's forward: device, dtype, the forward backend, the ISA the CPU kernels were built
    for (`TFSERVE_KERNELS_MARCH` may ask for less than the CPU has; None without them)."""
    runner = engine.runner
    return {"device": engine.device, "dtype": str(engine.dtype).removeprefix("torch."),
            "forward_backend": runner.forward.name,
            "cpu_kernels": runner.cpu_ops.isa if runner.cpu_ops is not None else None,
            "cuda_graph": runner.graphs is not None}


@app.command("serve")
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
            _show(result, f"{base_url} {model} {sweep_key}={value}", None)
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


@app.command("compare")
def compare(
    files: Annotated[list[Path], typer.Argument(help="Result JSON files (runs or sweeps).")],
    plot: Annotated[Path | None, typer.Option("--plot", help="PNG of throughput and TTFT per sweep.")] = None,
) -> None:
    """Show runs side by side, each with its ratio to the first run at the same sweep point.

    Single runs compare with the first single run; a sweep's rows with the rows of the same value before them
    (another sweep's, or a single run made at that value).

    [bold]Examples[/bold]

      tfserve bench compare tfserve.json transformers.json
      tfserve bench compare tfserve-sweep.json vllm-sweep.json --plot sweep.png
    """
    from tfserve.bench.report import compare_table, load_runs, plot_sweep

    writable(plot, "--plot")
    runs = [run for path in files for run in load_runs(path)]  # each file read and checked before printing
    series, sweep_key = [], None
    for path in files if plot is not None else ():
        data = json.loads(Path(path).read_text())
        if "runs" in data:
            series.append((Path(path).stem, data["values"], data["runs"]))
            sweep_key = sweep_key or data.get("sweep")
    if plot is not None and not series:
        raise UsageError("--plot needs sweep results (tfserve bench serve --sweep ...)")
    console.print(compare_table(runs))
    if plot is not None:
        plot_sweep(series, plot, sweep_key or "concurrency")


def _show(result: dict, title: str, output_json: Path | None, settings: dict | None = None) -> None:
    """Print `result`'s table; write it (with the run's `settings`) to `output_json` if given."""
    from tfserve.bench.report import result_table

    console.print(result_table(result, title))
    if output_json is not None:
        write_text(output_json, to_json({**result, "settings": settings}))


def served_model(base_url: str, api_key: str, model: str | None, chat: bool = True) -> str:
    """The model to send, checked before any load as `tfserve chat` checks it (GET /v1/models with the key):
    `model` where the server serves it, else the first chat model it lists. A refused key, a URL that is no
    OpenAI-compatible server, a model it does not serve (`chat`: or a speech-to-text one) are one line."""
    from tfserve.chat.client import RemoteBackend

    backend = RemoteBackend(base_url, api_key=api_key, model=model, timeout=30.0)
    try:
        return backend.connect(chat=chat, need_models=True).model
    finally:
        backend.close()


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
