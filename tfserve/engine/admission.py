"""Requests in: a prompt and its sampling fields checked and turned into `Request`s, before anything is queued.

The one place the engine checks what a caller asks for against the model (the server checks the body's types
at the edge; `SamplingParams` checks its own fields and ranges wherever it is built, the edge included): the
prompt's tokens against the vocabulary, prompt and `max_tokens` against the context and the KV cache, the
model's generation_config defaults for fields left out, and the `n` fan-out into one request per sequence. Plain functions over the values they read, so the
engine (`Engine.make_requests`, `Engine.sampling_params`) calls them with what it holds at the time.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

from tfserve.errors import ContextLengthError, ParamError
from tfserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config field -> SamplingParams field, for the defaults a model's authors recommend
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model) -> dict[str, Any]:
    """The sampling fields the model's `generation_config` sets to other than transformers' defaults,
    as SamplingParams keyword arguments (empty when it sets none)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    diff = config.to_diff_dict()
    defaults = {ours: diff[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if diff.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:  # a broken generation_config must not break every request
        logger.warning("ignoring the model's generation_config sampling defaults %s: %s", defaults, exc)
        return {}
    return defaults


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The tokens that end a sequence: the model's generation_config's, else the tokenizer's EOS."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(ids)


def as_sampling_params(params: SamplingParams | Any | None) -> SamplingParams:
    """A caller's params as a checked SamplingParams (a transformers GenerationConfig converted)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params.replace()  # checked again: a caller may have changed a field since it was built
    if type(params).__name__ == "GenerationConfig":
        return SamplingParams.from_generation_config(params)
    raise ValueError(f"params must be a SamplingParams or a transformers GenerationConfig, not {type(params).__name__}")


def fill_params(num_prompt_tokens: int, kwargs: dict[str, Any], defaults: dict[str, Any], vocab_size: int,
                capacity: int) -> SamplingParams:
    """SamplingParams for a prompt of `num_prompt_tokens` (`Engine.sampling_params`): fields left out (or None)
    take `defaults`; a max_tokens still unset is what is left of `capacity` (the tokens a sequence may hold).
    ContextLengthError for a prompt that leaves no room, whatever max_tokens says."""
    room_for(num_prompt_tokens, capacity)
    kwargs = {**defaults, **{k: v for k, v in kwargs.items() if v is not None}}
    if isinstance(kwargs.get("top_k"), int) and kwargs["top_k"] >= vocab_size:
        kwargs["top_k"] = 0  # keeps every token: the same as no top-k
    if kwargs.get("max_tokens") is None:
        kwargs["max_tokens"] = capacity - num_prompt_tokens
    return SamplingParams(**kwargs)


def room_for(num_prompt_tokens: int, capacity: int) -> int:
    """`capacity` (the context, or the whole KV cache if smaller); ContextLengthError for a prompt that leaves
    no room to generate in it."""
    if num_prompt_tokens >= capacity:
        # OpenAI's words, which client libraries (litellm, LangChain) match to tell a context overflow apart
        raise ContextLengthError(
            f"This model's maximum context length is {capacity} tokens (prompt and output together). However, "
            f"the prompt is {num_prompt_tokens} tokens, which leaves no room to generate: the prompt is too long")
    return capacity


def encode_prompt(tokenizer: Any, prompt: list[int] | str) -> list[int]:
    """A prompt as token ids: text through `tokenizer` (special tokens added), ids as plain ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt is text but the engine has no tokenizer; pass token ids")
        return tokenizer.encode(prompt, add_special_tokens=True)
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", 1) == 1:  # a numpy array or torch tensor of ids
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(is_token_id(t) for t in prompt):
        raise ValueError("prompt must be a string or a list of token ids")
    return [int(t) for t in prompt]


def validate(prompt_ids: list[int], params: SamplingParams, vocab_size: int, capacity: int,
             has_tokenizer: bool) -> None:
    """ValueError naming what is wrong with a prompt and its params for this model: tokens outside the
    vocabulary, prompt and max_tokens past `capacity` (ContextLengthError), stop strings without a tokenizer,
    a logit_bias token outside the vocabulary."""
    if not prompt_ids:
        raise ParamError("prompt", "{prompt} must not be empty")
    if any(t < 0 or t >= vocab_size for t in prompt_ids):
        raise ParamError("prompt", f"{{prompt}} has token ids outside the vocabulary [0, {vocab_size})")
    room_for(len(prompt_ids), capacity)
    num_tokens = len(prompt_ids) + params.max_tokens
    if num_tokens > capacity:
        raise ContextLengthError(
            f"This model's maximum context length is {capacity} tokens. However, you requested "
            f"{num_tokens} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} in {{max_tokens}}): "
            f"lower {{max_tokens}} or shorten the prompt", param="max_tokens")
    if params.stop and not has_tokenizer:
        raise ParamError("stop", "{stop} strings need a tokenizer; use stop_token_ids")
    outside = [t for t in params.logit_bias if t >= vocab_size]
    if outside:
        raise ParamError(f"logit_bias.{outside[0]}", f"{{logit_bias}}.{outside[0]}: token id {outside[0]} is "
                         f"outside the vocabulary [0, {vocab_size})")


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The (id, params) of each sequence `params.n` asks for: the id itself for one; `id-i` with n=1 and
    seed+i (a seeded request stays repeatable, its sequences differ) for several. The children are copies of
    `params`, already checked, not checked again (`SamplingParams.sequence`)."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{request_id}-{i}", params.sequence(i)) for i in range(params.n)]


def is_token_id(value: Any) -> bool:
    """An integer token id: a Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
