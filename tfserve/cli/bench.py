"""`tfserve bench`: the command group, its in-process runs (offline, roofline) and the side-by-side comparison of
saved results. `bench serve` (any OpenAI-compatible server) is in bench_serve.py, `bench transcribe` and
`bench embeddings` in bench_audio.py and bench_embeddings.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer

from tfserve.cli import bench_audio, bench_embeddings, bench_serve
from tfserve.cli.bench_common import DatasetOpt, NumPromptsOpt, OutputJsonOpt, show_result
from tfserve.cli.completion import chat_models, choices
from tfserve.cli.options import (DEFAULT_MODEL, DeviceOpt, Dtype, DtypeOpt, ModelOpt, Quantization, QuantizationOpt,
                                 TensorParallelOpt, CompileOpt, CudaGraphOpt)
from tfserve.cli.output import console, err_console, to_json, writable, write_text
from tfserve.errors import UsageError

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
    show_result(result, f"offline {engine}: {loaded.name}", output_json, settings)


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
    at torch's own matmul rate here) and against the peak of the unit its weights
    multiply on (float32 FMA, bfloat16 or int8 dot products), measured in registers.
    Each round measures them back to back.

    [bold]Examples[/bold]

      tfserve bench roofline                       # float32, a batch of 32
      tfserve bench roofline --dtype float16 --batch 8 -o roofline.json
      tfserve bench roofline --dtype auto          # the default model's GGUF blocks: int8 units
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
    weights = engine.quantization if engine.quantization != "none" else details["dtype"]  # (Q4_1/Q8_0: the blocks)
    table = Table(title=f"roofline: {engine.model_name} ({weights}, "
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
            (f"{batch} sequences: of the roofline", "batch_of_roofline", "{:.0%}"),
            (f"{results[0]['unit']} unit's peak, GOP/s", "unit_peak_gops", "{:.0f}"),
            (f"{batch} sequences: of the unit's peak", "batch_of_unit_peak", "{:.1%}")]
    for label, key, form in rows:
        table.add_row(label, *(form.format(r[key]) if r[key] is not None else "-" for r in results))
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


app.command("serve")(bench_serve.serve)


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
