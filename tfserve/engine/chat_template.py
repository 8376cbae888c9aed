"""Chat messages -> prompt token ids through the model's chat template: the one renderer behind the server's
chat endpoints and the in-process chat. Errors are `ChatTemplateError`s (a ValueError) for the caller to
word: the server answers 400, the chat prints one line."""

from __future__ import annotations

from typing import Any

from tfserve.errors import ChatTemplateError

__all__ = ["RENDER_ARGUMENTS", "ChatTemplateError", "has_chat_template", "render_chat"]

# arguments of `apply_chat_template` (and the template's own `messages`): never template variables
RENDER_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer carries a chat template (base models often have none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[dict], tools: list | None = None,
                template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> list[int]:
    """The prompt's token ids: `messages` (and `tools`) through the model's chat template, ending with the
    assistant's generation prompt (unless `add_generation_prompt` is False), or with `continue_final_message`
    the last message left open for the model to continue (an assistant prefill; transformers' argument, which
    leaves out the generation prompt). `template_kwargs` become template variables; they cannot change how the
    prompt is rendered to ids (a caller should reject RENDER_ARGUMENTS among them)."""
    from jinja2 import TemplateError

    if not has_chat_template(tokenizer):
        raise ChatTemplateError("the model has no chat template")
    kwargs = {**(template_kwargs or {}), "tools": tools,
              "add_generation_prompt": add_generation_prompt and not continue_final_message,
              "continue_final_message": continue_final_message, "tokenize": True, "return_dict": True,
              "return_tensors": None, "chat_template": None}
    try:
        rendered = tokenizer.apply_chat_template(messages, **kwargs)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
