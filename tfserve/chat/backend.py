"""What every chat backend shares: the `ChatBackend` and `Reply` protocols, a reply's statistics, and the errors a
turn fails with. The backends: `RemoteBackend` (client.py, any OpenAI-compatible server), `OllamaBackend`
(ollama_client.py) and `LocalBackend` (local.py, the engine in this process)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tfserve.chat.conversation import Settings
from tfserve.errors import TfserveError


class ChatError(TfserveError):
    """A failed turn, said in one line; the chat goes on (at start-up the CLI exits 1 with it)."""


class ServerError(ChatError):
    """The server answered with an error body (bad request, unknown model, overloaded...)."""

    def __init__(self, message: str, status: int | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status; None for an error sent inside a stream
        self.detail = detail  # the server's own message; None where it sent none (an HTML page, an empty body)


class ConnectionLost(ChatError):
    """The server cannot be reached, or went away in the middle of a reply."""


class ContextFull(ChatError):
    """The conversation leaves the model no room to answer: said as what to do about it, not in the server's
    token arithmetic. The chat does not drop its oldest turns to make room: that would change what the model
    knows without telling, and which turns may go is the user's call (/clear, or /save and edit the file)."""

    def __init__(self, max_context_tokens: int | None = None) -> None:
        super().__init__(f"the conversation fills the model's {context_name(max_context_tokens)}, so your message "
                         "got no answer: /clear, or /save and start over")
        self.max_context_tokens = max_context_tokens


@dataclass(slots=True)
class ReplyStats:
    """What the backend reports about one reply; None where it does not say."""

    num_prompt_tokens: int | None = None
    num_completion_tokens: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" | ...; None while streaming or when cut off
    # the reply's calls in OpenAI's shape, {"id", "type": "function", "function": {"name", "arguments"}},
    # complete once the reply has ended
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # the context, not max_tokens, capped the reply (max_tokens was left to the server because the default cap
    # did not fit): a reply that ends by "length" then ended because the conversation filled the context
    context_capped: bool = False
    max_context_tokens: int | None = None  # the model's context (prompt and reply) where known


class Thinking(str):
    """A delta of a reasoning model's thinking (`reasoning_content`), shown apart from the answer and never sent
    back in the conversation."""


class Reply(Protocol):
    """One streaming reply: iterate for text deltas (its tool calls land in `stats.tool_calls`); `close()`
    stops it (the server aborts the request)."""

    stats: ReplyStats

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None: ...


class ChatBackend(Protocol):
    """Something that answers chat messages: a server (`RemoteBackend`) or an in-process engine (`LocalBackend`)."""

    model: str | None
    label: str  # where the model runs, for the banner: "http://localhost:8000" or "in-process"

    def list_models(self) -> list[str]: ...

    def stream(self, messages: list[dict[str, Any]], settings: Settings, tools: list[dict] | None = None,
               tool_choice: str = "auto") -> Reply:
        """Start a reply to `messages`; `tools` (OpenAI function tools) are offered only when given, with
        `tool_choice` (auto, required, none)."""
        ...

    def close(self) -> None: ...


def context_name(max_context_tokens: int | None) -> str:
    """"8192-token context", or "context" where its size is not known."""
    return f"{max_context_tokens}-token context" if max_context_tokens else "context"


def max_context_tokens_in(message: str) -> int | None:
    """The context size in a context error's message, in OpenAI's words ("maximum context length is 8192
    tokens"), which tfserve and vLLM use too; None where it is not said so."""
    found = re.search(r"maximum context length is (\d+) tokens", message)
    return int(found.group(1)) if found else None
