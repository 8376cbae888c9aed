"""Showing a reply while it streams: rich markdown in a `Live` region for a terminal, plain text for pipes;
then a dim footer (tokens, tok/s, time to first token)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import IO

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment
from rich.spinner import Spinner
from rich.text import Text

from tfserve.chat.backend import Thinking

REFRESH_PER_SECOND = 12


@dataclass(slots=True)
class TurnStats:
    """Timings of one reply, measured by the client."""

    num_tokens: int
    ttft_s: float | None  # request sent -> first text
    elapsed_s: float  # request sent -> last text
    cancelled: bool = False

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate: tokens after the first over the time after the first."""
        if self.ttft_s is None or self.num_tokens < 2 or self.elapsed_s <= self.ttft_s:
            return None
        return (self.num_tokens - 1) / (self.elapsed_s - self.ttft_s)


class _Tail:
    """Markdown (or plain text) rendered in full, but while streaming only the lines that fit the screen:
    a Live region taller than the terminal cannot be redrawn and would repeat itself in the scrollback."""

    def __init__(self, markdown: bool) -> None:
        self.text = ""
        self.markdown = markdown
        self.streaming = True

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        renderable = Markdown(self.text) if self.markdown else Text(self.text)
        lines = console.render_lines(renderable, options, pad=False)
        if self.streaming:
            lines = lines[-max(1, console.size.height - 2):]
        for i, line in enumerate(lines):
            yield from line
            if i < len(lines) - 1:
                yield Segment.line()


class LiveReply:
    """`with LiveReply(console) as view: view.append(delta)`: a spinner until the first text, then the reply
    redrawn a dozen times a second (parsed once per redraw, not per token); the whole reply stays on screen."""

    def __init__(self, console: Console, markdown: bool = True) -> None:
        self.console = console
        self._tail = _Tail(markdown)
        self._thinking = Text(style="dim italic")  # a reasoning model's thinking, above its answer
        self._live = Live(Spinner("dots", style="dim"), console=console, refresh_per_second=REFRESH_PER_SECOND,
                          vertical_overflow="visible", transient=False)

    @property
    def text(self) -> str:
        return self._tail.text

    def __enter__(self) -> LiveReply:
        self._stack = ExitStack()
        self._stack.enter_context(no_echo())
        self._stack.enter_context(self._live)
        return self

    def append(self, delta: str) -> None:
        if isinstance(delta, Thinking):
            if not self._thinking:
                self._live.update(Group(self._thinking, self._tail))
            self._thinking.append(delta)
            return
        if not self._tail.text and not self._thinking:
            self._live.update(self._tail)
        self._tail.text += delta

    def __exit__(self, *exc: object) -> None:
        self._tail.streaming = False
        self._live.transient = not self._tail.text and not self._thinking  # nothing arrived: no spinner left
        self._stack.close()  # the final, full render; then echo comes back
        if self._tail.text and not self.console.is_terminal:
            self.console.line()  # Live ends the line itself only on terminals


@contextmanager
def no_echo() -> Iterator[None]:
    """Keys typed while a reply streams are not echoed (they wait for the next prompt), nor is Ctrl-C's "^C":
    either would move the cursor under the Live region, which then redraws one line off and repeats a line."""
    try:
        import termios
    except ImportError:  # Windows
        yield
        return
    try:
        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError, AttributeError):  # stdin is not a terminal (pipes, tests)
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


class PlainReply:
    """Deltas written as they come, for pipes: no markup; each answer ends with a newline."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file
        self.text = ""

    def __enter__(self) -> PlainReply:
        return self

    def append(self, delta: str) -> None:
        if isinstance(delta, Thinking):  # a pipe gets the answer only
            return
        self.text += delta
        self.file.write(delta)
        self.file.flush()

    def __exit__(self, *exc: object) -> None:
        if self.text and not self.text.endswith("\n"):
            self.file.write("\n")
            self.file.flush()


def footer(stats: TurnStats) -> Text:
    """`42 tokens · 35.1 tok/s · TTFT 120 ms`, dim; cancelled replies say so first."""
    parts = [f"{stats.num_tokens} token{'s' if stats.num_tokens != 1 else ''}"]
    if stats.tokens_per_s is not None:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
    if stats.ttft_s is not None:
        parts.append(f"TTFT {stats.ttft_s * 1000:.0f} ms")
    text = Text()
    if stats.cancelled:
        text.append("[cancelled] ", style="yellow")
    text.append(" · ".join(parts), style="dim")
    return text
