"""The tool side of the MCP agent loop: each call a reply ends with is shown as a panel, approved by the user
(unless approval is automatic), run on its MCP server, and its result shown and handed back to the model as a
`tool` message. `ChatSession` streams the replies and loops (at most MAX_TOOL_ROUNDS rounds of calls); this module
knows it only as a `ToolHost`, so the session imports the loop and nothing here imports the session."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console, RenderableType
from rich.json import JSON
from rich.panel import Panel
from rich.text import Text

from tfserve.chat.render import no_echo

if TYPE_CHECKING:
    from tfserve.chat.mcp_tools import McpToolbox

MAX_TOOL_ROUNDS = 10  # rounds of calls for one message; then the chat stops and says so
MAX_SHOWN_LINES = 20  # of a result on screen (the model gets all of it, up to the toolbox's byte cap)
MAX_SHOWN_CHARS = 2000
APPROVE_QUESTION = "Run tool? [y/N/a(lways)] "
DECLINED = "The user declined to run this tool."
CANCELLED = "Cancelled by the user."
NOT_RUN = "Not run: the user stopped the tool calls."


class ToolHost(Protocol):
    """What running a reply's tool calls needs of the chat around it (`ChatSession` is one)."""

    console: Console  # panels and results
    error_console: Console
    tools: McpToolbox | None
    auto_approve: bool  # run without asking; "a(lways)" at the question sets it
    confirm: Callable[[str], str] | None  # asks the user; None: nobody to ask (pipes)


def run_tool_calls(session: ToolHost, calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Show, approve and run each call in order. Returns one `tool` message per call whatever happened (declined,
    failed, cancelled), so the conversation stays valid; False when Ctrl-C stopped them (the rest are not run)."""
    messages = []
    stopped = False
    for call in calls:
        if stopped:
            content = NOT_RUN
        else:
            try:
                content = _run_call(session, call)
            except KeyboardInterrupt:
                stopped = True
                session.console.print(Text("[cancelled]", style="yellow"))
                content = CANCELLED
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return messages, not stopped


def _run_call(session: ToolHost, call: dict[str, Any]) -> str:
    """One call: its panel, approval, the run and its result panel; the text the model gets back."""
    name, raw_arguments = call["function"]["name"], call["function"]["arguments"] or "{}"
    tool = session.tools.tools.get(name) if session.tools is not None else None
    try:
        arguments = json.loads(raw_arguments)
    except json.JSONDecodeError as exc:
        arguments, problem = None, f"the arguments are not JSON ({exc.msg}): {raw_arguments[:200]}"
    else:
        problem = None if isinstance(arguments, dict) else "the arguments must be a JSON object"
    session.console.print(call_panel(name, tool.label if tool else "unknown tool", arguments, raw_arguments))
    if tool is None:
        known = ", ".join(session.tools.tools) if session.tools is not None else ""
        problem = f"there is no tool named {name!r} (the tools are: {known or 'none'})"
    if problem is not None:
        session.console.print(result_panel(problem, is_error=True))
        return f"Error: {problem}"
    if not _approved(session, name):
        session.console.print(Text("Declined.", style="dim"))
        return DECLINED
    with no_echo(), session.console.status(Text(f"Running {name}…", style="dim")):  # no "^C" under the spinner
        result = session.tools.call(tool, arguments)
    text = (result.error or "") if result.is_error else result.output
    session.console.print(result_panel(text, is_error=result.is_error, truncated=result.truncated))
    return f"Error: {text}" if result.is_error else text


def _approved(session: ToolHost, name: str) -> bool:
    if session.auto_approve:
        return True
    if session.confirm is None:  # piped input: nobody to ask
        session.error_console.print(Text(f"Declined {name}: without a terminal, tools run only with --yes.",
                                         style="yellow"), soft_wrap=True)
        return False
    try:
        answer = session.confirm(APPROVE_QUESTION).strip().lower()
    except EOFError:
        answer = ""
    if answer in ("a", "always"):
        session.auto_approve = True
        session.console.print(Text("Tools run without asking from now on (/set approve ask to ask again).",
                                   style="dim"))
        return True
    return answer in ("y", "yes")


def call_panel(name: str, where: str, arguments: Any, raw_arguments: str) -> Panel:
    """The call: the tool's name and server in the title, its arguments as pretty JSON."""
    body: RenderableType = Text(raw_arguments) if arguments is None else JSON.from_data(arguments)
    return Panel(body, title=Text.assemble((name, "bold cyan"), (f" · {where}", "dim")), title_align="left",
                 border_style="cyan", expand=False)


def result_panel(text: str, *, is_error: bool, truncated: bool = False) -> Panel:
    """A result (dim border) or an error (red), cut to MAX_SHOWN_LINES lines on screen."""
    shown, num_hidden = _cut(text)
    body = Text(shown or "(no output)", style="red" if is_error else "")
    notes = [f"{num_hidden} more line{'s' if num_hidden != 1 else ''} not shown"] if num_hidden else []
    if truncated:
        notes.append("cut to the output cap")
    if notes:
        body.append(f"\n… {'; '.join(notes)}", style="dim")
    title = Text("error", style="bold red") if is_error else Text("result", style="green")
    return Panel(body, title=title, title_align="left", border_style="red" if is_error else "dim", expand=False)


def _cut(text: str) -> tuple[str, int]:
    lines = text[:MAX_SHOWN_CHARS].splitlines()
    num_lines = len(text.splitlines())
    shown = "\n".join(lines[:MAX_SHOWN_LINES])
    if len(text) > MAX_SHOWN_CHARS and num_lines <= MAX_SHOWN_LINES:
        return shown + "…", 0
    return shown, num_lines - min(len(lines), MAX_SHOWN_LINES)
