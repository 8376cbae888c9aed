"""Benchmark maths: per-request records in, the summary `tfserve bench` reports out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass(slots=True)
class RequestRecord:
    """What one benchmark request measured. Times are seconds from the request's start."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None  # first content token
    e2e_s: float | None = None  # last byte of the response
    token_times_s: list[float] = field(default_factory=list)  # arrival of each streamed content chunk
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(values_s: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 in milliseconds."""
    ms = [v * 1000 for v in values_s]
    mean = sum(ms) / len(ms) if ms else math.nan
    return {"mean": mean, "p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """The JSON result: completed, failed, throughputs and the four latency summaries."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    # Time per output token after the first: (e2e - ttft) / (tokens - 1), per request.
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done
            if r.output_tokens > 1 and r.ttft_s is not None and r.e2e_s is not None]
    itl = [b - a for r in done for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": latency_summary(ttft),
        "tpot_ms": latency_summary(tpot),
        "itl_ms": latency_summary(itl),
        "e2e_ms": latency_summary(e2e),
    }
