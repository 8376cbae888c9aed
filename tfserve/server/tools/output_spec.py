"""What a reply must look like, decided once per request: its output constraint and its tool policy (the tools
offered, the ones forced, parallel calls, the model's call format), and the one grammar that enforces both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tfserve.protocol.tool_formats import ToolCallFormat
from tfserve.sampling_params import Grammar
from tfserve.server.tools.tool_choice import apply_constraint, callable_tools, forced_tools, reply_constraint


@dataclass(slots=True)
class OutputSpec:
    """A request's output, as the engine and the reply parser need it. Built once by `output_spec`."""

    grammar: tuple[Grammar, str] | None  # what the reply follows, and the field that set it (None: free text)
    tools: list[dict[str, Any]] | None = None  # the function tools the prompt shows
    offered: list[dict[str, Any]] = field(default_factory=list)  # the functions a reply may call
    forced: list[dict[str, Any]] | None = None  # the functions a reply must call one of (None: it may answer)
    parallel: bool = True  # more than one call in a reply
    tool_format: ToolCallFormat | None = None  # how this model writes calls

    @property
    def parses_calls(self) -> bool:
        """True when the reply is read for tool calls."""
        return bool(self.tools)


def output_spec(constraint: tuple[Grammar, str] | None, tools: list[dict[str, Any]] | None, tool_choice: Any,
                parallel: bool, tool_format: ToolCallFormat | None, tokenizer: Any,
                mcp_names: Any = None) -> OutputSpec:
    """The spec of a reply given `constraint` (the response format's, from the typed request), `tools` and a
    checked `tool_choice`: calls of the forced tools, the format widened to let the reply call, or text or
    calls (`tool_choice.reply_constraint`). 400 for a tool_choice naming a function not in `tools`."""
    if not tools:
        return OutputSpec(constraint, tools, parallel=parallel, tool_format=tool_format)
    forced = forced_tools(tools, tool_choice, mcp_names=mcp_names)
    offered = callable_tools(tools, tool_choice, mcp_names)
    grammar = reply_constraint(constraint, tool_format, offered, forced, parallel, tokenizer)
    return OutputSpec(grammar, tools, offered, forced, parallel, tool_format)


async def apply_spec(engine: Any, kwargs: dict[str, Any], spec: OutputSpec, tokenizer: Any,
                     body_tools: list | None = None, parameters_fields: dict[str, str] | None = None) -> None:
    """Into a reply's sampling `kwargs`: the spec's grammar, compiled (a 400 naming its field when it does not),
    and what its tool calls need (`tool_choice.apply_constraint`)."""
    await apply_constraint(engine, kwargs, spec.grammar, spec.forced, spec.tools, spec.tool_format, tokenizer,
                           body_tools, parameters_fields)
