"""The interactive loop (prompt-toolkit: history in the tfserve home, auto-suggest, multiline, completion of
slash commands) and piped mode (each stdin line is one turn, answers as plain text)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prompt_toolkit import PromptSession
from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
from prompt_toolkit.completion import Completer, NestedCompleter, PathCompleter, WordCompleter
from prompt_toolkit.formatted_text import HTML
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from rich.text import Text

from tfserve.chat.backend import ChatError
from tfserve.chat.commands import COMMANDS, SET_KEYS, attach, plural, run_command
from tfserve.chat.images import dropped_images, starts_with_image
from tfserve.chat.session import ChatSession

PROMPT = HTML("<ansigreen><b>›</b></ansigreen> ")


def history_path() -> Path:
    """`$TFSERVE_HOME/chat_history`, shared by every chat."""
    from tfserve.models.store import home

    path = home() / "chat_history"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def handle_line(session: ChatSession, line: str) -> bool:
    """One line of input: a slash command, or a message (`//` sends a message that starts with /). Image files
    the message names (a file dropped into the terminal) are attached to it; a message of nothing but image
    paths attaches them to the next one. False when the chat should end."""
    text = line.strip()
    if not text:
        return True
    if text.startswith("/") and not text.startswith("//") and not starts_with_image(text):
        return run_command(session, text)
    text, paths = dropped_images(text.removeprefix("/") if text.startswith("//") else text)
    for path in paths:
        if attach(session, path) is None:
            return True  # the message was meant with its image: not sent without it
    if text:
        session.ask(text)
    return True


def run_repl(session: ChatSession, *, input: Any = None, output: Any = None, history: History | None = None) -> None:
    """Chat until /exit or Ctrl-D. Ctrl-C at the prompt clears the line; while a reply streams it cancels
    the reply (see `ChatSession.ask`)."""
    prompt = make_prompt_session(session, input=input, output=output, history=history)
    # tool approvals are asked on the same terminal (or test pipe), kept out of the message history
    session.confirm = PromptSession(input=input, output=output, history=InMemoryHistory()).prompt
    print_banner(session)
    while True:
        try:
            line = prompt.prompt(PROMPT)
        except KeyboardInterrupt:
            continue
        except EOFError:
            break
        if not handle_line(session, line):
            break


def run_piped(session: ChatSession, lines: Iterable[str]) -> int:
    """Each non-empty line is one user turn (slash commands work too). A line that fails (a reply, or a command
    such as a /load of a missing file) does not stop the rest, but the exit code is 1: a script learns that
    something went wrong. 0 when every line went through."""
    for line in lines:
        if not handle_line(session, line.rstrip("\r\n")):
            break
    return 1 if session.num_failures else 0


def make_prompt_session(session: ChatSession, *, input: Any = None, output: Any = None,
                        history: History | None = None) -> PromptSession:
    bindings = KeyBindings()

    @bindings.add("escape", "enter")  # Alt-Enter arrives as Esc, Enter in most terminals
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    return PromptSession(
        history=history if history is not None else FileHistory(str(history_path())),
        auto_suggest=AutoSuggestFromHistory(),
        completer=_completer(session),
        complete_while_typing=True,
        key_bindings=bindings,
        prompt_continuation=lambda width, line_number, wrap_count: " " * (width - 2) + "┆ ",
        input=input,
        output=output,
    )


class SlashCompleter(Completer):
    """Completes slash commands, then their arguments (settings, models, paths); never plain messages."""

    def __init__(self, models: list[str]) -> None:
        # WORD=True: "/" is part of the word, so "/sa" completes to "/save"
        self.names = WordCompleter(list(COMMANDS), WORD=True)
        nested: dict[str, Any] = {name: None for name in COMMANDS}
        nested["/set"] = {name: None for name in SET_KEYS}
        nested["/set"]["approve"] = {"auto": None, "ask": None}
        nested["/model"] = {name: None for name in models}
        nested["/save"] = nested["/load"] = nested["/image"] = PathCompleter(expanduser=True)
        self.arguments = NestedCompleter.from_nested_dict(nested)

    def get_completions(self, document, complete_event):
        text = document.text_before_cursor.lstrip()
        if not text.startswith("/") or "\n" in text:
            return
        completer = self.names if " " not in text else self.arguments
        yield from completer.get_completions(document, complete_event)


def _completer(session: ChatSession) -> SlashCompleter:
    try:
        models = session.backend.list_models()
    except ChatError:
        models = []
    return SlashCompleter(models)


def print_banner(session: ChatSession) -> None:
    console = session.console
    console.print(Text.assemble(("tfserve chat", "bold"), "  ", (str(session.backend.model), "cyan"),
                                ("  " + session.backend.label, "dim")))
    console.print(Text("/help for commands · Esc-Enter for a new line · Ctrl-C cancels a reply · Ctrl-D exits",
                       style="dim"))
    if session.tools is not None:
        approve = "run without asking" if session.auto_approve else "ask before each call"
        console.print(Text(f"MCP: {plural(len(session.tools.tools), 'tool')} from "
                           f"{plural(len(session.tools.status()), 'server')} ({approve}) · /tools lists them",
                           style="dim"))
