"""Consoles shared by the commands: results to stdout, messages and progress to stderr."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    """Print one readable red line to stderr."""
    err_console.print(f"[bold red]Error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """Print one yellow line to stderr."""
    err_console.print(f"[yellow]Warning:[/] {escape(message)}", highlight=False, soft_wrap=True)
