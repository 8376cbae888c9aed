"""Offline throughput: the engine in-process against transformers' own ways of generating, on the same
prompts and weights (`tfserve bench offline`)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class OfflineResult:
    """What an offline run produced and how long it took."""

    engine: str
    num_prompts: int
    num_prompt_tokens: int
    num_output_tokens: int
    duration_s: float

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.duration_s


def random_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token prompts, lengths uniform in [min_len, max_len]; ids avoid the special low range."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)]


def run_tfserve(engine, prompts: list[list[int]], output_len: int, records: list | None = None) -> OfflineResult:
    """Our engine (an `Engine`), stepped here so that every token's arrival time is known (for TTFT/ITL
    records)."""
    from tfserve import SamplingParams
    from tfserve.bench.metrics import RequestRecord

    engine.generate_batch(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm up
    engine.block_pool.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params)[0] for prompt in prompts]
    times: dict[str, list[float]] = {i: [] for i in ids}
    finished = {}
    while engine.has_unfinished:
        for out in engine.step():
            now = time.perf_counter() - start
            if out.delta_tokens:
                times[out.request_id].append(now)
            if out.finished:
                finished[out.request_id] = out
    duration = time.perf_counter() - start
    num_output = sum(len(o.generated_tokens) for o in finished.values())
    if records is not None:
        for request_id, prompt in zip(ids, prompts):
            out, stamps = finished[request_id], times[request_id]
            records.append(RequestRecord(ok=out.finish_reason in ("stop", "length"), prompt_tokens=len(prompt),
                                         output_tokens=len(out.generated_tokens),
                                         ttft_s=stamps[0] if stamps else None, e2e_s=stamps[-1] if stamps else None,
                                         token_times_s=stamps, error=out.error))
    return OfflineResult("tfserve", len(prompts), sum(map(len, prompts)), num_output, duration)


def run_transformers_cb(model, prompts: list[list[int]], output_len: int, max_num_seqs: int,
                        max_batch_tokens: int = 512) -> OfflineResult:
    """transformers' own continuous batching (`model.generate_batch`)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=max_num_seqs, max_batch_tokens=max_batch_tokens)
    model.set_attn_implementation("sdpa")
    model.generate_batch(prompts[:2], generation_config=GenerationConfig(max_new_tokens=4, do_sample=False),
                         continuous_batching_config=cb_config)
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
    duration = time.perf_counter() - start
    num_output = sum(len(o.generated_tokens) for o in outputs.values())
    return OfflineResult("transformers-generate_batch", len(prompts), sum(map(len, prompts)), num_output, duration)


@torch.inference_mode()
def run_hf_static(model, prompts: list[list[int]], output_len: int) -> OfflineResult:
    """One left-padded `model.generate` over all prompts (with one prompt: single-stream `generate`)."""
    model.set_attn_implementation("sdpa")
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm up
    max_len = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (max_len - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                         do_sample=False, pad_token_id=0)
    duration = time.perf_counter() - start
    num_output = (out.shape[1] - max_len) * len(prompts)
    return OfflineResult("transformers-generate-static", len(prompts), int(mask.sum()), num_output, duration)
