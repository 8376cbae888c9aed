"""Progress a person can follow: rich bars on a terminal, one line per stage in a log."""

from __future__ import annotations

import io

from rich.console import Console

from tfserve.cli import progress as progress_module


def run_steps(monkeypatch, terminal: bool) -> str:
    out = io.StringIO()
    monkeypatch.setattr(progress_module, "err_console", Console(file=out, force_terminal=terminal, width=100))
    with progress_module.step_progress() as progress:
        progress("Downloading x wheel")
        progress("Downloading x wheel", 500_000, 1_000_000)
        progress("Downloading x wheel", 1_000_000, 1_000_000)
        progress("Converting GGUF to HF")
    return out.getvalue()


def test_a_log_gets_a_line_when_each_stage_starts_and_ends(monkeypatch):
    lines = run_steps(monkeypatch, terminal=False).splitlines()
    assert [line.split(" ", 1)[1].split(" (")[0] for line in lines] == [
        "Downloading x wheel ...", "done: Downloading x wheel", "Converting GGUF to HF ...",
        "done: Converting GGUF to HF"]
    assert "1.0 MB" in lines[1] and "\x1b" not in "".join(lines)


def test_a_terminal_gets_bars(monkeypatch):
    text = run_steps(monkeypatch, terminal=True)
    assert "\x1b" in text and "Converting GGUF to HF" in text and "done:" not in text
