"""A conversation: the messages so far, the system prompt and the sampling settings, as JSON on disk."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tfserve.sampling_params import RANGES, SamplingParams

FORMAT = "tfserve-chat/1"
# a reply's cap when max_tokens is not set, or less where the context leaves less (a small model sampling
# freely can otherwise run to the end of its context)
DEFAULT_MAX_TOKENS = 1024


@dataclass(slots=True)
class Settings:
    """Sampling settings sent with every turn; None leaves the choice to the server (or the model), except
    max_tokens, whose None is a cap of DEFAULT_MAX_TOKENS."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, or what the context leaves if less
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def __post_init__(self) -> None:
        # raises ValueError naming the field (max_tokens None is a default, 0 is not)
        if isinstance(self.temperature, (int, float)):  # what servers take (the API's range): else every turn fails
            RANGES["temperature"].check("temperature", self.temperature, api=True)
        SamplingParams(**self.sampling_kwargs(max_tokens=1 if self.max_tokens is None else self.max_tokens))

    def sampling_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """The settings that are set, as SamplingParams / OpenAI keyword arguments."""
        kwargs = {name: value for name, value in asdict(self).items() if value is not None}
        kwargs.update(overrides)
        return kwargs

    def set(self, key: str, text: str) -> Settings:
        """A copy with `key` parsed from `text` ("none" unsets it); ValueError says what is wrong."""
        types = {f.name: f.type for f in fields(self)}
        key = key.replace("-", "_")
        if key not in types:
            raise ValueError(f"unknown setting {key!r}; one of {', '.join(types)}")
        if text.lower() in ("none", "default", "off"):
            value = None
        else:
            parse = int if "int" in str(types[key]) else float
            try:
                value = parse(text)
            except ValueError:
                kind = "an integer" if parse is int else "a number"
                raise ValueError(f"{key} must be {kind} (got {text!r})") from None
        values = asdict(self)
        values[key] = value
        return Settings(**values)


@dataclass(slots=True)
class Conversation:
    """The turns so far. The system prompt is kept apart so /clear keeps it and /system changes it in place."""

    system: str | None = None
    # {"role": "user" | "assistant", "content": ...}; a user's content with images is a list of OpenAI content
    # parts (image_url data URLs, then text); with MCP tools also an assistant's {"tool_calls": [...]}
    # (content may be None) and one {"role": "tool", "tool_call_id", "content"} per call
    turns: list[dict[str, Any]] = field(default_factory=list)

    def messages(self) -> list[dict[str, Any]]:
        """What the next request sends: the system prompt, then every turn."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(turn) for turn in self.turns]

    def add(self, role: str, content: str | list[dict[str, Any]] | None, **extra: Any) -> None:
        """Append a message; `extra` holds `tool_calls` (assistant) or `tool_call_id` (tool)."""
        self.turns.append({"role": role, "content": content, **extra})

    def pop_reply(self) -> str | list[dict[str, Any]] | None:
        """Drop the turns after the last user message (its answer) and return that message's content, for
        /retry."""
        for i in range(len(self.turns) - 1, -1, -1):
            if self.turns[i]["role"] == "user":
                text = self.turns[i]["content"]
                del self.turns[i:]
                return text
        return None

    def save(self, path: Path, settings: Settings, model: str | None) -> None:
        data = {"format": FORMAT, "model": model, "settings": asdict(settings), "messages": self.messages()}
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> tuple[Conversation, Settings | None]:
        """Read a file written by `save` (or a bare list of OpenAI messages); ValueError if it is neither."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}), so not a saved chat") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON ({exc.msg}, line {exc.lineno})") from None
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list) or not all(_is_message(m) for m in messages):
            raise ValueError(f"{path} has no list of messages with role and content")
        conversation = cls()
        for message in messages:
            if message["role"] == "system":
                conversation.system = message["content"]
            else:
                extra = {key: message[key] for key in ("tool_calls", "tool_call_id") if key in message}
                conversation.add(message["role"], message.get("content"), **extra)
        settings = data.get("settings") if isinstance(data, dict) else None
        if isinstance(settings, dict):
            known = {f.name for f in fields(Settings)}
            settings = Settings(**{k: v for k, v in settings.items() if k in known})
        return conversation, settings


def _is_message(message: Any) -> bool:
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
        return False
    if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
        return message.get("content") is None or isinstance(message["content"], str)
    content = message.get("content")
    if message["role"] == "user" and isinstance(content, list):  # with images: content parts
        return all(isinstance(part, dict) and isinstance(part.get("type"), str) for part in content)
    return isinstance(content, str)
