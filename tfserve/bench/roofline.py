"""How close the engine's decode steps come to this machine's own limits (`tfserve bench roofline`): one
sequence's step against the time to read the model's weight bytes once (decoding one sequence streams every
weight), and a batch's step against the matmul roofline (the weights read once, and 2 FLOPs per parameter per
sequence at the GFLOP/s that torch's own matmul reaches here: float32, or bfloat16 for bfloat16 weights, where
oneDNN uses the CPU's matrix units — AMX tiles, AVX512-BF16 — so the report shows the fraction of their
measured peak). Each round measures the limits and the steps
back to back, so a machine whose neighbours come and go is compared with itself. With the CPU kernels it also
measures the peak of the unit the batch's weights multiply on (in registers: the kernels' `unit_peak_gops`, csrc/
peak.h: float32 FMA, bfloat16 dot products, int8 dot products for GGUF blocks and int8) and the fraction of it the
batch's step reaches (unmeasured on AMX tiles: None)."""

from __future__ import annotations

import statistics
import time

import torch

from tfserve.bench.offline import random_prompts


def weight_bytes(engine) -> int:
    """Bytes of weight one decode step reads: the lean forward's linear layers as the kernels hold them (a
    GGUF's blocks are a fraction of the float parameters transformers loads), else the model's parameters
    (tied ones once)."""
    counted = getattr(engine.runner.forward, "weight_bytes", None)
    if counted is not None:
        return counted()
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def read_gb_per_s(num_bytes: int, repeats: int = 7) -> float:
    """GB/s of reading `num_bytes` of float32 from memory once (16 distinct tensors summed, torch's threads),
    the median of `repeats` passes."""
    pieces = [torch.ones(max(num_bytes // 4 // 16, 1)) for _ in range(16)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for piece in pieces:
            piece.sum()
        times.append(time.perf_counter() - start)
    return sum(p.numel() * 4 for p in pieces) / statistics.median(times) / 1e9


def matmul_gflops(rows: int, inner: int, outer: int, seconds: float = 0.3, dtype=torch.float32) -> float:
    """GFLOP/s of torch's matmul [rows, inner] @ [inner, outer] in `dtype` (its best of three timed runs)."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, outer, dtype=dtype)
    for _ in range(3):
        a @ b
    flops = 2 * rows * inner * outer
    start = time.perf_counter()
    count = 0
    while time.perf_counter() - start < seconds / 3:
        a @ b
        count += 1
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        best = max(best, flops * count / (time.perf_counter() - start) / 1e9)
    return best


def batch_unit(formats) -> str:
    """The unit a batch's decode rows multiply on, for weights in `formats` (the lean forward's labels): bfloat16's
    dot products, int8's for blocks (GGUF types, int8), else float32 FMA."""
    if "bfloat16" in formats:
        return "bfloat16"
    return "int8" if set(formats) - {"float32", "float16"} else "float32"


def unit_peak(engine, unit: str) -> float | None:
    """GOP/s of `unit` in registers on the engine's threads (the kernels' own measure), or None: no kernels, or
    bfloat16 on AMX tiles (not what peak.h measures)."""
    ops = engine.runner.cpu_ops
    if ops is None or not hasattr(ops, "unit_peak_gops") or (unit == "bfloat16" and ops.amx_active()):
        return None
    return ops.unit_peak_gops(unit) or None


def decode_step_s(engine, num_seqs: int, num_tokens: int, vocab_size: int, seed: int = 0) -> float:
    """The median time of `engine.step()` once `num_seqs` greedy sequences (40-token random prompts) all decode:
    the steps after the one that prefilled the last prompt."""
    from tfserve import SamplingParams

    engine.block_pool.reset_prefix_cache()
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    for prompt in random_prompts(num_seqs, 40, 40, vocab_size, seed):
        engine.add_request(prompt, params)
    times, decoding = [], False
    while engine.has_unfinished:
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if decoding and len(outputs) == num_seqs:  # every sequence sampled one token in this step
            times.append(elapsed)
        decoding = decoding or sum(1 for o in outputs if o.delta_tokens) == num_seqs
    return statistics.median(times) if times else float("nan")


def measure(engine, batch: int = 32, num_tokens: int = 64, rounds: int = 3) -> list[dict]:
    """`rounds` rounds of: the read rate of the weights' bytes, one sequence's decode step, torch's matmul rate,
    `batch` sequences' decode step; each round's figures and ratios (see the module's docstring)."""
    from tfserve import SamplingParams

    model = engine.model
    config = model.config.get_text_config()
    num_bytes = weight_bytes(engine)
    num_params = sum(p.numel() for p in model.parameters())
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", 4 * hidden)
    vocab_size = config.vocab_size
    engine.generate_batch([[100, 101, 102]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    formats = getattr(engine.runner.forward, "weight_formats", {})
    peak_dtype = torch.bfloat16 if "bfloat16" in formats else torch.float32  # the units its weights go through
    unit = batch_unit(formats)
    results = []
    for index in range(rounds):
        read = read_gb_per_s(num_bytes)
        one = decode_step_s(engine, 1, num_tokens, vocab_size, seed=index)
        gflops = matmul_gflops(2048, hidden, inner)
        bf16_gflops = matmul_gflops(2048, hidden, inner, dtype=torch.bfloat16)
        peak = bf16_gflops if peak_dtype == torch.bfloat16 else gflops
        many = decode_step_s(engine, batch, num_tokens, vocab_size, seed=index + 1000)
        unit_gops = unit_peak(engine, unit)
        batch_gops = 2 * num_params * batch / many / 1e9
        bound = max(num_bytes / (read * 1e9), 2 * num_params * batch / (peak * 1e9))
        result = {"round": index + 1, "weight_bytes": num_bytes, "read_gb_s": round(read, 2),
                  "one_step_ms": round(one * 1e3, 3), "one_gb_s": round(num_bytes / one / 1e9, 2),
                  "one_of_read": round(num_bytes / one / 1e9 / read, 3), "matmul_gflops": round(gflops, 1),
                  "matmul_gflops_bf16": round(bf16_gflops, 1), "peak_dtype": str(peak_dtype).removeprefix("torch."),
                  "batch": batch, "batch_step_ms": round(many * 1e3, 3), "batch_tok_s": round(batch / many, 1),
                  "roofline_tok_s": round(batch / bound, 1), "batch_of_roofline": round(bound / many, 3),
                  "unit": unit, "unit_peak_gops": round(unit_gops, 1) if unit_gops else None,
                  "batch_gops": round(batch_gops, 2),
                  "batch_of_unit_peak": round(batch_gops / unit_gops, 4) if unit_gops else None}
        results.append(result)
    return results
