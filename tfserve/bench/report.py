"""Showing results: a rich table per run, a side-by-side comparison, a PNG chart."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.table import Table

from tfserve.bench.metrics import LATENCY_KEYS
from tfserve.errors import TfserveError

_THROUGHPUTS = (("request_throughput", "Request throughput (req/s)"),
                ("output_throughput", "Output throughput (tok/s)"),
                ("total_token_throughput", "Total throughput (tok/s)"))
_LATENCY_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E latency"}
_HIGHER_IS_BETTER = {"completed", "request_throughput", "output_throughput", "total_token_throughput"}


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:,.2f}"


def result_table(result: dict, title: str = "Benchmark") -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("Metric")
    table.add_column("Value", justify="right")
    for key in ("completed", "failed", "duration_s"):
        table.add_row(key.replace("_", " ").capitalize(), _fmt(result[key]))
    for key, name in _THROUGHPUTS:
        table.add_row(name, _fmt(result[key]))
    for key in LATENCY_KEYS:
        for stat in ("mean", "p50", "p90", "p99"):
            table.add_row(f"{_LATENCY_NAMES[key]} {stat} (ms)", _fmt(result[key][stat]))
    return table


def flatten(result: dict) -> dict[str, float]:
    """One level: `ttft_ms.p50` and so on."""
    flat = {}
    for key, value in result.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{stat}": v for stat, v in value.items()})
        else:
            flat[key] = value
    return flat


_SHORT_KEYS = {"concurrency": "c", "request_rate": "rate"}  # a sweep row's label: "run c=8"


def load_runs(path: str | Path) -> list[tuple[str, dict]]:
    """A result file's runs with labels: one run, or every run of a sweep."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TfserveError(f"no such file: {path}") from None
    except OSError as exc:
        raise TfserveError(f"cannot read benchmark result {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise TfserveError(f"cannot read benchmark result {path}: not JSON ({exc.msg} at line {exc.lineno} "
                           f"column {exc.colno})") from None
    except UnicodeDecodeError:
        raise TfserveError(f"cannot read benchmark result {path}: not JSON (not even text)") from None
    if isinstance(data, dict) and isinstance(data.get("runs"), list) and "sweep" in data:
        key = _SHORT_KEYS.get(data["sweep"], data["sweep"])
        return [(f"{path.stem} {key}={v}", run) for v, run in zip(data["values"], data["runs"])]
    if isinstance(data, dict) and "output_throughput" in data:
        return [(path.stem, data)]
    raise TfserveError(f"{path} is not a tfserve bench result")


_COMPARE_COLUMNS = (("output_throughput", "output tok/s"), ("ttft_ms.p50", "TTFT p50 ms"),
                    ("ttft_ms.p99", "TTFT p99 ms"), ("tpot_ms.p50", "TPOT p50 ms"), ("itl_ms.p50", "ITL p50 ms"),
                    ("e2e_ms.p50", "E2E p50 ms"))


def compare_table(runs: list[tuple[str, dict]]) -> Table:
    """One row per run, the headline metrics across. Each value also shows its ratio (green where better) to the
    first run before it at the same sweep point (`_reference`); the caption says why a run shows none."""
    table = Table(title="Comparison", header_style="bold")
    table.add_column("run", no_wrap=True)
    table.add_column("ok/failed", justify="right")
    for _, name in _COMPARE_COLUMNS:
        table.add_column(name, justify="right")
    unmatched = False
    for index, (label, run) in enumerate(runs):
        reference = _reference(runs, index)
        unmatched |= reference is None and index > 0
        flat, base_flat = flatten(run), flatten(reference) if reference is not None else {}
        row = [label, f"{run['completed']}/{run['failed']}"]
        for key, _ in _COMPARE_COLUMNS:
            value, base = flat.get(key), base_flat.get(key)
            cell = _fmt(value)
            if isinstance(value, (int, float)) and isinstance(base, (int, float)) \
                    and base and not math.isnan(base) and not math.isnan(value):
                ratio = value / base
                good = (ratio >= 1) == (key.split(".")[0] in _HIGHER_IS_BETTER)
                cell += f" [{'green' if good else 'red'}]{ratio:.2f}x[/]"
            row.append(cell)
        table.add_row(*row)
    if unmatched and len({_source(label) for label, _ in runs}) > 1:
        table.caption = ("no ratio: no run before it at the same sweep point (a single run is at the "
                         "concurrency, request rate or max tokens its settings record)")
    return table


def _reference(runs: list[tuple[str, dict]], index: int) -> dict | None:
    """The run that `runs[index]` is compared with: the first before it at the same point. Two single runs are
    (different engines, the same workload); a sweep's row and another sweep's row of the same value are; a single
    run and a sweep's row are where the single run's settings record the swept value."""
    label, run = runs[index]
    point = _point(label)
    for earlier_label, earlier in runs[:index]:
        earlier_point = _point(earlier_label)
        if point is None and earlier_point is None:
            return earlier
        if point is not None and earlier_point is not None:
            if point == earlier_point:
                return earlier
        elif _made_at(earlier if point is not None else run, point or earlier_point):
            return earlier
    return None


def _point(label: str) -> tuple[str, str] | None:
    """A sweep row's (key, value), from the label `load_runs` gave it ("run c=8"); None for a single run."""
    name, _, last = label.rpartition(" ")
    key, equals, value = last.partition("=")
    return (key, value) if name and equals and key in (*_SHORT_KEYS.values(), "max_tokens") else None


def _source(label: str) -> str:
    """The file a row came from (its name)."""
    return label.rpartition(" ")[0] if _point(label) else label


def _made_at(run: dict, point: tuple[str, str]) -> bool:
    """Whether a single run's settings record the sweep point's value (`bench serve -o` writes them)."""
    key = {short: name for name, short in _SHORT_KEYS.items()}.get(point[0], point[0])
    settings = run.get("settings")
    return isinstance(settings, dict) and key in settings and str(settings[key]) == point[1]


def plot_sweep(series: list[tuple[str, list[float], list[dict]]], path: str | Path, xlabel: str = "concurrency") -> None:
    """Output throughput and TTFT p50 against the swept value, one line per series (label, xs, runs)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TfserveError("--plot needs matplotlib: pip install matplotlib") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, xs, runs in series:
        left.plot(xs, [r["output_throughput"] for r in runs], marker="o", label=label)
        right.plot(xs, [r["ttft_ms"]["p50"] for r in runs], marker="o", label=label)
    left.set(xlabel=xlabel, ylabel="output tokens/s", title="Output throughput")
    right.set(xlabel=xlabel, ylabel="ms", title="TTFT p50", yscale="log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise TfserveError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
