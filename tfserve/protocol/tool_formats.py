"""Each family of chat templates writes tool calls its own way (`ToolCallFormat`):

- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- Llama 3.x JSON: `{"name": ..., "parameters": {...}}` as the whole reply (or after `<|python_tag|>`),
  several separated by `;`.

`detect_format` reads which one a model's template asks for; `tool_calls.ToolCallStream` reads calls back in it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one family of chat templates writes calls."""

    name: str
    start: str  # opens a region of calls
    end: str  # closes it ("" when the region runs to the end of the reply)
    arguments_key: str  # the key the template writes ("arguments" or "parameters"); both are read
    list_of_calls: bool  # the region is a JSON array of calls (Mistral)
    bare_json_start: bool = False  # a reply that starts with `{` opens a region too (Llama 3.x)


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "arguments", list_of_calls=False)
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", "", "arguments", list_of_calls=True)
LLAMA3_JSON = ToolCallFormat("llama3_json", "<|python_tag|>", "", "parameters", list_of_calls=False,
                             bare_json_start=True)
FORMATS = {f.name: f for f in (HERMES, MISTRAL, LLAMA3_JSON)}


def detect_format(tokenizer) -> ToolCallFormat:
    """The format a model's chat template asks for (Hermes when it says nothing: what our parser always read)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    if "[TOOL_CALLS]" in template or _has_token(tokenizer, "[TOOL_CALLS]"):
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ('"parameters"' in template and "function" in template):
        return LLAMA3_JSON
    return HERMES


def _has_token(tokenizer, token: str) -> bool:
    """Whether `token` is one of the tokenizer's tokens (one lookup: `get_vocab()` builds a dict of the whole
    vocabulary, tens of milliseconds on every request that asked)."""
    to_id = getattr(tokenizer, "convert_tokens_to_ids", None)
    if to_id is None:
        return False
    token_id = to_id(token)
    return token_id is not None and token_id != getattr(tokenizer, "unk_token_id", None)
