"""Consoles shared by the commands: results to stdout, messages and progress to stderr."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from tfserve.errors import TfserveError, UsageError

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    """Print one readable red line to stderr."""
    err_console.print(f"[bold red]Error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """Print one yellow line to stderr."""
    err_console.print(f"[yellow]Warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def writable(path: Path | None, flag: str) -> None:
    """Check, before the work that fills it, that `path` can be written: its folder exists and it is no folder."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder: give a file name")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: there is no folder {path.parent}")


def write_text(path: Path, text: str) -> None:
    """`path.write_text(text)`, failing with one line (a full disk, a folder gone since)."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise TfserveError(f"cannot write {path}: {exc.strerror or exc}") from None


def to_json(payload: Any) -> str:
    """Indented JSON that strict parsers read: a statistic of no samples (NaN) or an infinite one is null."""
    return json.dumps(_finite(payload), indent=2)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
