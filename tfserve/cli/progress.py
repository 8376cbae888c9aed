"""Progress for long steps (pull, convert, kernel build, load), driven by the `progress(step, completed,
total)` callbacks of `tfserve.models` and the CLI: rich bars on a terminal, one log line per step otherwise
(a log file, a pipe, CI), so a person tailing a log sees each stage as it starts and ends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.filesize import decimal
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from tfserve.cli.output import err_console


@contextmanager
def step_progress() -> Iterator:
    """Yield a `progress(step, completed=None, total=None)` callback that shows each step on stderr: on a
    terminal a spinner, then a bar and byte counts once the step reports them, a tick when it is done;
    elsewhere a line when a step starts and one when it ends."""
    with (_bars() if err_console.is_terminal else _lines()) as progress:
        yield progress


@contextmanager
def _bars() -> Iterator:
    columns = [SpinnerColumn(finished_text="[green]✓[/]"), TextColumn("{task.description}"),
               BarColumn(), TextColumn("{task.fields[detail]}"), TimeElapsedColumn()]
    with Progress(*columns, console=err_console) as bar:
        tasks: dict[str, TaskID] = {}

        def finish_last() -> None:
            if tasks:
                task = bar.tasks[-1]
                bar.update(task.id, total=task.total or 1, completed=task.total or 1)

        def progress(step: str, completed: int | None = None, total: int | None = None) -> None:
            if step not in tasks:
                finish_last()
                tasks[step] = bar.add_task(step, total=None, detail="")
            if completed is not None:
                detail = f"{decimal(completed)}/{decimal(total)}" if total else decimal(completed)
                bar.update(tasks[step], completed=completed, total=total, detail=detail)

        yield progress
        finish_last()


@contextmanager
def _lines() -> Iterator:
    current: dict = {}  # the step under way: name, start time, bytes so far

    def line(text: str) -> None:
        err_console.print(f"{time.strftime('%H:%M:%S')} {text}", highlight=False, markup=False, soft_wrap=True)

    def finish_last() -> None:
        if current:
            size = f", {decimal(current['bytes'])}" if current["bytes"] else ""
            line(f"done: {current['step']} ({time.perf_counter() - current['start']:.1f} s{size})")
            current.clear()

    def progress(step: str, completed: int | None = None, total: int | None = None) -> None:
        if current.get("step") != step:
            finish_last()
            current.update(step=step, start=time.perf_counter(), bytes=0)
            line(f"{step} ...")
        if completed is not None:
            current["bytes"] = completed

    yield progress
    finish_last()
