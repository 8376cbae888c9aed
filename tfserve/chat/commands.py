"""Slash commands. Each is a function `(session, arg) -> bool` (False ends the chat) registered with its
usage and a one-line help; `/help` lists them in this file's order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from rich.table import Table
from rich.text import Text

from tfserve.chat.backend import ChatError
from tfserve.chat.conversation import Conversation, Settings
from tfserve.chat.images import Attachment, path_of, read_image
from tfserve.images import size_text
from tfserve.chat.session import ChatSession

Handler = Callable[[ChatSession, str], bool]


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    usage: str
    help: str
    run: Handler


COMMANDS: dict[str, Command] = {}
SETTING_NAMES = [f.name for f in fields(Settings)]
# approve: how MCP tool calls are approved (ask | auto); tool_choice: what the first request of a message asks
SET_KEYS = [*SETTING_NAMES, "approve", "tool_choice"]
TOOL_CHOICES = ("auto", "required", "none")


def plural(count: int, noun: str) -> str:
    """`1 tool`, `2 tools`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def command(usage: str, help: str, aliases: tuple[str, ...] = ()) -> Callable[[Handler], Handler]:
    def register(run: Handler) -> Handler:
        for name in (usage.split()[0], *aliases):
            COMMANDS[name] = Command(name, usage, help, run)
        return run
    return register


def run_command(session: ChatSession, line: str) -> bool:
    """Run a `/command args` line; False when the chat should end. Unknown commands send nothing."""
    name, _, arg = line.strip().partition(" ")
    found = COMMANDS.get(name.lower())
    if found is None:
        session.error(f"unknown command {name}; /help lists the commands (start a message with // to send a /)")
        return True
    return found.run(session, arg.strip())


@command("/help", "this list")
def _help(session: ChatSession, arg: str) -> bool:
    table = Table.grid(padding=(0, 2))
    seen = set()
    for cmd in COMMANDS.values():
        if cmd.usage not in seen:
            seen.add(cmd.usage)
            table.add_row(cmd.usage, f"[dim]{cmd.help}[/]")
    session.console.print(table)
    session.console.print("[dim]Enter sends; Esc-Enter (or Alt-Enter) adds a line; Ctrl-C cancels a reply; "
                          "Ctrl-D exits.[/]")
    return True


@command("/exit", "leave (also /quit, Ctrl-D)", aliases=("/quit",))
def _exit(session: ChatSession, arg: str) -> bool:
    return False


@command("/clear", "start a new conversation (the system prompt stays)")
def _clear(session: ChatSession, arg: str) -> bool:
    session.conversation.turns.clear()
    session.unanswered = None
    session.pending_images.clear()
    session.console.print("[dim]New conversation.[/]")
    return True


@command("/system TEXT", "set the system prompt; /system alone removes it")
def _system(session: ChatSession, arg: str) -> bool:
    session.conversation.system = arg or None
    session.console.print(f"[dim]System prompt {'set' if arg else 'removed'}.[/]")
    return True


@command("/image PATH", "attach an image to your next message (so does a file dropped into the prompt); "
                       "/image alone lists the attached ones, /image clear drops them")
def _image(session: ChatSession, arg: str) -> bool:
    if arg.lower() == "clear":
        num_dropped = len(session.pending_images)
        session.pending_images.clear()
        session.console.print(Text(f"Dropped {plural(num_dropped, 'image')}.", style="dim"))
        return True
    if not arg:
        if not session.pending_images:
            session.console.print(Text("No images attached: /image PATH, or drop a file into the prompt.",
                                       style="dim"))
        for attachment in session.pending_images:
            session.console.print(Text(f"  {attachment.path}  ({size_text(attachment.num_bytes)})"))
        return True
    attach(session, path_of(arg))
    return True


def attach(session: ChatSession, path: Path) -> Attachment | None:
    """Read `path` into the pending images and say so; one red line (and None) when it cannot be."""
    try:
        attachment = read_image(path)
    except ChatError as exc:
        session.error(str(exc))
        return None
    session.pending_images.append(attachment)
    session.console.print(Text(f"Attached {path.name} ({size_text(attachment.num_bytes)}) to your next "
                               f"message; {plural(len(session.pending_images), 'image')} waiting.", style="dim"),
                          soft_wrap=not session.console.is_terminal)
    return attachment


@command("/set KEY VALUE", f"change a setting ({', '.join(SETTING_NAMES)}); VALUE none unsets it; "
                          "/set approve auto|ask: run MCP tools without asking, or ask first; "
                          "/set tool_choice auto|required|none: whether a message's first reply must call a tool")
def _set(session: ChatSession, arg: str) -> bool:
    key, _, value = arg.partition(" ")
    if not key or not value.strip():
        session.error(f"usage: /set KEY VALUE; keys: {', '.join(SET_KEYS)}")
        return True
    key = key.replace("-", "_")
    if key not in SET_KEYS:
        session.error(f"unknown setting {key!r}; one of {', '.join(SET_KEYS)}")
        return True
    if key == "approve":
        return _set_approve(session, value.strip().lower())
    if key == "tool_choice":
        return _set_tool_choice(session, value.strip().lower())
    try:
        session.settings = session.settings.set(key, value.strip())
    except ValueError as exc:
        session.error(str(exc))
        return True
    session.console.print(Text(f"{key} = {getattr(session.settings, key.replace('-', '_'))}", style="dim"))
    return True


def _set_approve(session: ChatSession, value: str) -> bool:
    if value not in ("auto", "ask"):
        session.error(f"approve is auto (run MCP tools without asking) or ask (got {value!r})")
        return True
    session.auto_approve = value == "auto"
    session.console.print(Text(f"approve = {value}", style="dim"))
    return True


def _set_tool_choice(session: ChatSession, value: str) -> bool:
    if value not in TOOL_CHOICES:
        session.error(f"tool_choice is one of {', '.join(TOOL_CHOICES)} (got {value!r})")
        return True
    session.tool_choice = value
    note = " (the first reply of each message calls a tool; small models need it)" if value == "required" else ""
    session.console.print(Text(f"tool_choice = {value}{note}", style="dim"))
    return True


@command("/settings", "show the model, the system prompt and the sampling settings")
def _settings(session: ChatSession, arg: str) -> bool:
    table = Table.grid(padding=(0, 2))
    table.add_row("model", Text(str(session.backend.model)))
    table.add_row("system", Text(session.conversation.system) if session.conversation.system else "[dim](none)[/]")
    for key, value in asdict(session.settings).items():
        table.add_row(key, "[dim]default[/]" if value is None else str(value))
    if session.tools is not None:
        table.add_row("approve", "auto" if session.auto_approve else "ask")
        table.add_row("tool_choice", session.tool_choice)
    session.console.print(table)
    return True


@command("/tools", "the MCP servers (--mcp-config) and their tools; a server that is down is started again")
def _tools(session: ChatSession, arg: str) -> bool:
    toolbox = session.tools
    if toolbox is None:
        session.console.print("[dim]No MCP tools: start the chat with --mcp-config FILE.[/]")
        return True
    with session.console.status(Text("Listing tools…", style="dim")):
        toolbox.refresh(retry=True)
    table = Table.grid(padding=(0, 2))
    status = toolbox.status()
    for label, state in status.items():
        why = toolbox.errors.get(label)
        table.add_row(Text(label, style="bold"), Text(state, style="green" if state == "running" else "yellow"),
                      Text(why or "", style="red"))
        for tool in toolbox.tools.values():
            if tool.label == label:
                summary = (tool.tool.description or "").strip().split("\n")[0]
                table.add_row(Text(f"  {tool.name}", style="cyan"), "", Text(summary, style="dim"))
    session.console.print(table)
    approve = ("auto (/set approve ask to ask first)" if session.auto_approve
               else "ask (/set approve auto to stop asking)")
    session.console.print(Text(f"{plural(len(toolbox.tools), 'tool')} from {plural(len(status), 'server')}; "
                               f"approve: {approve}", style="dim"))
    return True


@command("/retry", "regenerate the last answer")
def _retry(session: ChatSession, arg: str) -> bool:
    session.retry()
    return True


@command("/save FILE", "save the conversation as JSON")
def _save(session: ChatSession, arg: str) -> bool:
    if not arg:
        session.error("usage: /save FILE")
        return True
    path = Path(arg).expanduser()
    try:
        session.conversation.save(path, session.settings, session.backend.model)
    except OSError as exc:
        session.error(f"cannot write {path}: {exc.strerror or exc}")
        return True
    session.console.print(Text(f"Saved {len(session.conversation.turns)} messages to {path}.", style="dim"))
    return True


@command("/load FILE", "continue a conversation saved with /save (its settings too)")
def _load(session: ChatSession, arg: str) -> bool:
    if not arg:
        session.error("usage: /load FILE")
        return True
    path = Path(arg).expanduser()
    try:
        conversation, settings = Conversation.load(path)
    except OSError as exc:
        session.error(f"cannot read {path}: {exc.strerror or exc}")
        return True
    except (ValueError, TypeError) as exc:
        session.error(str(exc))
        return True
    session.conversation, session.unanswered = conversation, None
    if settings is not None:
        session.settings = settings
    session.console.print(Text(f"Loaded {len(conversation.turns)} messages from {path}.", style="dim"))
    return True


@command("/models", "list the chat models the server offers")
def _models(session: ChatSession, arg: str) -> bool:
    try:
        names = session.backend.list_models()
    except ChatError as exc:
        session.error(str(exc))
        return True
    for name in names:
        marker = "*" if name == session.backend.model else " "
        session.console.print(Text(f"{marker} {name}"))
    return True


@command("/model NAME", "switch to another model (the conversation stays)")
def _model(session: ChatSession, arg: str) -> bool:
    if not arg:
        session.console.print(Text(str(session.backend.model)))
        return True
    try:
        names = session.backend.list_models()
    except ChatError as exc:
        session.error(str(exc))
        return True
    if arg not in names:
        session.error(f"no model {arg!r} here; /models lists them")
        return True
    session.backend.model = arg
    session.console.print(Text(f"Model: {arg}", style="dim"))
    return True


@command("/stats", "tokens, speed and time to first token over this session")
def _stats(session: ChatSession, arg: str) -> bool:
    stats = session.stats
    table = Table.grid(padding=(0, 2))
    table.add_row("replies", f"{stats.num_replies} ({stats.num_cancelled} cancelled, {stats.num_errors} failed)")
    table.add_row("tokens generated", str(stats.num_completion_tokens))
    if stats.num_context_tokens is not None:
        table.add_row("context", f"{stats.num_context_tokens} tokens")
    if stats.ttfts_s:
        ttfts = sorted(stats.ttfts_s)
        table.add_row("TTFT", f"median {ttfts[len(ttfts) // 2] * 1000:.0f} ms, last {stats.ttfts_s[-1] * 1000:.0f} ms")
    if stats.decode_s > 0:
        num_decoded = stats.num_completion_tokens - len(stats.ttfts_s)
        table.add_row("speed", f"{num_decoded / stats.decode_s:.1f} tok/s")
    session.console.print(table)
    return True
