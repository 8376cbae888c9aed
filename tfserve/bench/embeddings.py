"""Embeddings benchmark: the same sentences embedded in requests of `batch` inputs, by tfserve's encoder in-process,
by sentence-transformers' `encode` on the same folder (the baseline), or by any OpenAI-compatible /v1/embeddings at
a concurrency. Reported as inputs/s, tokens/s and request latencies."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from tfserve.bench.metrics import latency_summary

_WORDS = ("the model server embeds every sentence of a document so that search finds passages by meaning rather "
          "than by words alone while chat answers from what it finds quickly on any machine with small batches "
          "and large ones alike retrieval augmented generation needs vectors fast").split()


@dataclass(slots=True)
class Batch:
    """One request's worth of inputs, and its latency once sent."""

    texts: list[str]
    latency_s: float = 0.0
    error: str | None = None


def sentences(num_inputs: int, min_words: int = 8, max_words: int = 48, seed: int = 0) -> list[str]:
    """`num_inputs` sentences of random lengths (RAG chunks and queries), the same for every backend and run."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))) + "."
            for _ in range(num_inputs)]


def batches(texts: list[str], batch: int) -> list[Batch]:
    return [Batch(texts[i:i + batch]) for i in range(0, len(texts), batch)]


def run_interleaved(embeds: dict[str, Callable[[list[str]], object]], work: dict[str, list[Batch]]) -> dict[str, float]:
    """Embed batch i with every backend in turn, then batch i + 1: a machine whose load drifts during the run
    slows each backend alike. Each backend's time is the sum of its own calls."""
    totals = dict.fromkeys(embeds, 0.0)
    for i in range(max(len(items) for items in work.values())):
        for name, embed in embeds.items():
            if i < len(work[name]):
                item = work[name][i]
                begin = time.perf_counter()
                embed(item.texts)
                item.latency_s = time.perf_counter() - begin
                totals[name] += item.latency_s
    return totals


def tfserve_embed(encoder) -> Callable[[list[str]], object]:
    """tfserve's path for one request: tokenize, then one forward per length bucket."""
    return lambda texts: encoder.encode(encoder.tokenize(texts, truncate=True))


def sentence_transformers_embed(path: str, device: str) -> Callable[[list[str]], object]:
    """sentence-transformers' `encode` of the same model folder: the baseline."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ImportError("the baseline needs sentence-transformers: pip install sentence-transformers") from None
    model = SentenceTransformer(path, device=device)
    return lambda texts: model.encode(texts, batch_size=max(len(texts), 1), convert_to_numpy=True)


async def run_online(base_url: str, model: str, work: list[Batch], concurrency: int, api_key: str = "EMPTY") -> float:
    """POST every batch to `base_url`/embeddings, `concurrency` at a time; the wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    limit = asyncio.Semaphore(concurrency)

    async def one(item: Batch) -> None:
        async with limit:
            begin = time.perf_counter()
            try:
                await client.embeddings.create(model=model, input=item.texts, encoding_format="float")
            except openai.OpenAIError as exc:
                item.error = str(exc)
            item.latency_s = time.perf_counter() - begin

    start = time.perf_counter()
    await asyncio.gather(*(one(item) for item in work))
    await client.close()
    return time.perf_counter() - start


def summarize(work: list[Batch], wall_s: float, num_tokens: int) -> dict:
    """The run's figures: inputs/s and tokens/s over the wall time, request latencies (ms)."""
    done = [item for item in work if item.error is None]
    num_inputs = sum(len(item.texts) for item in done)
    return {"num_requests": len(work), "num_failed": len(work) - len(done), "num_inputs": num_inputs,
            "wall_s": round(wall_s, 3), "inputs_per_s": round(num_inputs / wall_s, 1) if wall_s else None,
            "tokens_per_s": round(num_tokens / wall_s, 1) if wall_s and len(done) == len(work) else None,
            "latency_ms": latency_summary([item.latency_s for item in done]),
            "errors": sorted({item.error for item in work if item.error})[:5]}
