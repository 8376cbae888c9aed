"""Consoles shared by the commands: results to stdout, messages and progress to stderr."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from tfserve.errors import TfserveError, UsageError

# emoji=False: names people type hold colons (`NAME:FILE.gguf`), and Rich would turn `a:smile:b` into an emoji
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)


def error(message: str) -> None:
    """Print one readable red line to stderr: one line in a pipe or a file; a terminal wraps it at word
    boundaries (left to the terminal, a long line would break mid-word)."""
    err_console.print(f"[bold red]Error:[/] {escape(message)}", highlight=False,
                      soft_wrap=not err_console.is_terminal)


def warn(message: str) -> None:
    """Print one yellow line to stderr."""
    err_console.print(f"[yellow]Warning:[/] {escape(message)}", highlight=False,
                      soft_wrap=not err_console.is_terminal)


def bad_value_message(exc: Exception, message: str | None = None) -> str:
    """A Click/Typer usage error's message (or `message`, a part of it) in tfserve's words. Typer checks option
    values with pydantic, whose wording ("Input should be a valid integer, unable to parse string as an
    integer", "Value error, 'x' is not one of ...") reads like no other line of ours and hides the value given:
    that part is said again plainly."""
    if message is None:
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    cause = exc.__cause__
    errors = cause.errors() if type(cause).__name__ == "ValidationError" else None
    if not errors:
        return message
    plain = _plain_validation_error(errors[0])
    return message.replace(str(errors[0].get("msg")), plain) if plain else message


_BOUNDS = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
           "greater_than": ("more than", "gt"), "less_than": ("less than", "lt")}


def _plain_validation_error(error: dict) -> str | None:
    """One pydantic error (`ValidationError.errors()[0]`) as a line of ours; None where there is no better one."""
    kind, given, context = error.get("type"), error.get("input"), error.get("ctx") or {}
    if kind == "int_parsing":
        return f"{given!r} is not a whole number"
    if kind == "float_parsing":
        return f"{given!r} is not a number"
    if kind == "bool_parsing":
        return f"{given!r} is not true or false"
    if kind in _BOUNDS and _BOUNDS[kind][1] in context:
        word, key = _BOUNDS[kind]
        return f"must be {word} {context[key]} (got {given})"
    if kind == "value_error" and context.get("error"):  # a ValueError raised by a check: its own words
        return str(context["error"])
    return None


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
