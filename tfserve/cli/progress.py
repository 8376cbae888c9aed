"""Rich progress for long steps (pull, convert, load), driven by the `progress(step, completed, total)`
callbacks of `tfserve.models`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.filesize import decimal
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from tfserve.cli.output import err_console


@contextmanager
def step_progress() -> Iterator:
    """Yield a `progress(step, completed=None, total=None)` callback that shows each step as one line on
    stderr: a spinner, then a bar and byte counts once the step reports them; a tick when it is done."""
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
