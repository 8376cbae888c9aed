"""One chat: send a turn, stream its reply to the screen, keep the conversation and the statistics.
A failed turn is one red line and the chat goes on; Ctrl-C while a reply streams cancels just that reply.
With MCP tools, a reply that ends in tool calls has them run (agent.py) and the model is asked again."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from tfserve.chat.agent import MAX_TOOL_ROUNDS, run_tool_calls
from tfserve.chat.backend import ChatBackend, ChatError, ContextFull, Reply, ReplyStats, context_name
from tfserve.chat.conversation import Conversation, Settings
from tfserve.chat.images import Attachment, message_content
from tfserve.chat.render import LiveReply, PlainReply, TurnStats, footer

if TYPE_CHECKING:
    from tfserve.chat.mcp_tools import McpToolbox


@dataclass(slots=True)
class SessionStats:
    """Totals over the session, for /stats."""

    num_replies: int = 0  # replies that did not fail (cancelled ones too)
    num_cancelled: int = 0
    num_errors: int = 0  # replies that failed
    num_completion_tokens: int = 0
    num_context_tokens: int | None = None  # prompt + reply of the last turn, when the backend says
    ttfts_s: list[float] = field(default_factory=list)
    decode_s: float = 0.0  # time after each first token, summed

    def add(self, turn: TurnStats, num_context_tokens: int | None, failed: bool = False) -> None:
        """Count one reply. A failed one counts as an error, but its tokens and timings count too: the server
        generated what streamed before the failure."""
        self.num_replies += not failed
        self.num_errors += failed
        self.num_cancelled += turn.cancelled
        self.num_completion_tokens += turn.num_tokens
        if num_context_tokens is not None:
            self.num_context_tokens = num_context_tokens
        if turn.ttft_s is not None:
            self.ttfts_s.append(turn.ttft_s)
            self.decode_s += turn.elapsed_s - turn.ttft_s


class ChatSession:
    """A conversation with `backend`. Replies go to `console` (markdown when it is a terminal) or, with
    `plain=True`, as bare text to stdout; errors go to `error_console`. With `tools` (MCP servers) every request
    offers them; a call runs once `confirm` (the REPL's prompt) says yes, or at once with `auto_approve`."""

    def __init__(self, backend: ChatBackend, console: Console, *, conversation: Conversation | None = None,
                 settings: Settings | None = None, plain: bool = False, markdown: bool = True,
                 error_console: Console | None = None, tools: McpToolbox | None = None,
                 auto_approve: bool = False) -> None:
        self.backend = backend
        self.console = console
        self.error_console = error_console or console
        self.conversation = conversation or Conversation()
        self.settings = settings or Settings()
        self.plain = plain
        self.markdown = markdown
        self.stats = SessionStats()
        self.last_turn: TurnStats | None = None
        self.unanswered: str | list | None = None  # a message whose turn failed before any text, for /retry
        self.tools = tools
        self.auto_approve = auto_approve  # run tool calls without asking (--yes, /set approve auto)
        self.tool_choice = "auto"  # the first request of each message (/set tool_choice); later rounds: auto
        self.confirm: Callable[[str], str] | None = None  # asks the user a question; None: nobody to ask (pipes)
        self.pending_images: list[Attachment] = []  # /image or dropped paths: sent with the next message
        self.num_failures = 0  # red lines so far (failed replies and commands): a piped chat's exit code

    def ask(self, text: str) -> bool:
        """Send `text` (with the pending images) as the user's turn and stream the answer. False when the turn
        failed."""
        content = message_content(text, self.pending_images)
        self.pending_images = []
        return self._send(content)

    def _send(self, content: str | list[dict[str, Any]]) -> bool:
        self.conversation.add("user", content)
        return self._answer(content)

    def retry(self) -> bool:
        """Regenerate the answer to the last user message (or resend one that failed)."""
        if self.unanswered is not None:
            return self._send(self.unanswered)
        content = self.conversation.pop_reply()
        if content is None:
            self.error("nothing to retry yet: send a message first")
            return False
        return self._send(content)

    def error(self, message: str) -> None:
        """One red line; the chat goes on. A terminal wraps it at word boundaries; a pipe or file gets it as one
        line, whatever its length."""
        self.num_failures += 1
        self.error_console.print(Text.assemble(("Error: ", "bold red"), (message, "red")),
                                 soft_wrap=not self.error_console.is_terminal)

    def _answer(self, text: str | list[dict[str, Any]]) -> bool:
        """Stream the reply; while it ends in tool calls, run them and stream the next one."""
        self.unanswered = None
        question: str | list[dict[str, Any]] | None = text
        for _ in range(MAX_TOOL_ROUNDS):
            calls, ok = self._reply(question)
            if not ok or not calls:
                return ok
            question = None
            results, go_on = run_tool_calls(self, calls)
            self.conversation.turns.extend(results)
            if not go_on:
                return False
        self.console.print(Text(f"Stopped after {MAX_TOOL_ROUNDS} rounds of tool calls; send a message (\"go on\") "
                                "to let the model continue.", style="yellow"), soft_wrap=not self.console.is_terminal)
        return True

    def _reply(self, question: str | list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], bool]:
        """One request: stream its reply and keep it (a cut-off one as far as it got). Returns the tool calls it
        ended with, and False when it failed or was cancelled. `question`: the user's message, on the first."""
        start = time.perf_counter()
        first = last = None
        num_deltas = 0  # one per token from tfserve and most servers: the count when no usage arrives
        cancelled, failure, reply = False, None, None
        view = PlainReply(sys.stdout) if self.plain else LiveReply(self.console, self.markdown)
        with view:
            try:
                reply = self._stream(first=question is not None)
                for delta in reply:
                    last = time.perf_counter()
                    first = first or last
                    num_deltas += 1
                    view.append(delta)
            except KeyboardInterrupt:
                cancelled = True
            except ChatError as exc:
                failure = exc
            finally:
                if reply is not None:
                    reply.close()  # after Ctrl-C or an error: the server aborts the request
        stats = reply.stats if reply is not None else ReplyStats()
        # calls of a reply that did not end whole are dropped: a call is kept only with its result
        calls = list(stats.tool_calls) if self.tools is not None and not cancelled and failure is None else []
        context_full = failure is None and stats.context_capped and stats.finish_reason == "length"
        if view.text or calls:
            extra = {"tool_calls": calls} if calls else {}
            self.conversation.add("assistant", view.text or None, **extra)
        else:
            if question is not None:
                self.conversation.turns.pop()  # nothing came back: the question waits for /retry
                self.unanswered = question
            if context_full:  # a token or two of nothing: not an answer, and the next one would be the same
                failure = ContextFull(stats.max_context_tokens)
        turn = TurnStats(stats.num_completion_tokens or num_deltas, None if first is None else first - start,
                         (last or time.perf_counter()) - start, cancelled)
        num_prompt_tokens = stats.num_prompt_tokens
        self.stats.add(turn, None if num_prompt_tokens is None else num_prompt_tokens + turn.num_tokens,
                       failed=failure is not None)
        if failure is not None:
            self.error(str(failure))
            return [], False
        self.last_turn = turn
        if not self.plain:
            self.console.print(footer(turn), highlight=False)
        if context_full:
            context = context_name(stats.max_context_tokens)
            self.error_console.print(Text(f"The reply stopped where the model's {context} ends: /clear, or /save "
                                          "and start over, before the next message.", style="yellow"),
                                     soft_wrap=not self.error_console.is_terminal)
        return calls, not cancelled

    def _stream(self, first: bool) -> Reply:
        messages = self.conversation.messages()
        if self.tools is None:
            return self.backend.stream(messages, self.settings)
        tool_choice = self.tool_choice if first else "auto"  # forced again after a result, it would never answer
        return self.backend.stream(messages, self.settings, self.tools.openai_tools(), tool_choice)
