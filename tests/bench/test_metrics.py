"""Benchmark maths against hand-computed examples, and the report tables."""

import io
import json
import math

import pytest
from rich.console import Console

from tfserve.bench.metrics import RequestRecord, latency_summary, percentile, summarize
from tfserve.bench.report import compare_table, load_runs, result_table

KEYS = {"completed", "failed", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
        "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}


def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_summarize_hand_computed():
    records = [
        # ttft 0.1 s, tokens at 0.1, 0.2, 0.4 -> itl 0.1, 0.2; tpot (0.4 - 0.1) / 2 = 0.15
        RequestRecord(ok=True, prompt_tokens=10, output_tokens=3, ttft_s=0.1, e2e_s=0.4, token_times_s=[0.1, 0.2, 0.4]),
        # ttft 0.3 s, tokens at 0.3, 0.5 -> itl 0.2; tpot (0.5 - 0.3) / 1 = 0.2
        RequestRecord(ok=True, prompt_tokens=20, output_tokens=2, ttft_s=0.3, e2e_s=0.5, token_times_s=[0.3, 0.5]),
        RequestRecord(ok=False, error="500 boom"),
    ]
    result = summarize(records, duration_s=2.0)
    assert set(result) == KEYS
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["request_throughput"] == 1.0
    assert result["output_throughput"] == 2.5  # 5 tokens / 2 s
    assert result["total_token_throughput"] == 17.5  # (5 + 30) / 2 s
    assert result["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert result["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert result["tpot_ms"]["mean"] == pytest.approx(175.0)
    assert result["itl_ms"]["mean"] == pytest.approx((100 + 200 + 200) / 3)
    assert result["itl_ms"]["p50"] == pytest.approx(200.0)
    assert result["e2e_ms"]["p90"] == pytest.approx(490.0)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(result[key]) == {"mean", "p50", "p90", "p99"}


def test_latency_summary_in_milliseconds():
    assert latency_summary([0.001, 0.003]) == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8),
                                               "p99": pytest.approx(2.98)}


def _render(table) -> str:
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    console.print(table)
    return console.file.getvalue()


def test_result_table_and_compare(tmp_path):
    fast = summarize([RequestRecord(ok=True, output_tokens=100, ttft_s=0.05, e2e_s=1.0, token_times_s=[0.05, 1.0])], 1.0)
    slow = summarize([RequestRecord(ok=True, output_tokens=100, ttft_s=0.2, e2e_s=4.0, token_times_s=[0.2, 4.0])], 4.0)
    text = _render(result_table(fast, "run"))
    assert "Output throughput (tok/s)" in text and "100.0" in text
    (tmp_path / "single.json").write_text(json.dumps(fast))
    assert load_runs(tmp_path / "single.json") == [("single", fast)]
    (tmp_path / "a.json").write_text(json.dumps({"sweep": "concurrency", "values": [1], "runs": [fast]}))
    (tmp_path / "b.json").write_text(json.dumps({"sweep": "concurrency", "values": [1, 8], "runs": [slow, fast]}))
    runs = load_runs(tmp_path / "a.json") + load_runs(tmp_path / "b.json")
    assert [label for label, _ in runs] == ["a c=1", "b c=1", "b c=8"]
    text = _render(compare_table(runs))
    assert "output tok/s" in text
    assert "0.25x" in text  # b's throughput at c=1 is a quarter of a's at c=1
    assert "4.00x" in text  # and its TTFT four times
    assert "1.00x" not in text  # a reference shows no ratio to itself


def test_load_runs_rejects_other_json(tmp_path):
    from tfserve.errors import TfserveError

    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(TfserveError, match="not a tfserve bench result"):
        load_runs(tmp_path / "x.json")
