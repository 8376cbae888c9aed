"""Consoles shared by the commands: results to stdout, messages and progress to stderr."""

from __future__ import annotations

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    """Print one readable red line to stderr."""
    err_console.print(f"[bold red]Error:[/] {message}", highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """Print one yellow line to stderr."""
    err_console.print(f"[yellow]Warning:[/] {message}", highlight=False, soft_wrap=True)
