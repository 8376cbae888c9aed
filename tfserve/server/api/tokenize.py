"""POST /tokenize and POST /detokenize in vLLM's shapes: a `prompt` (or chat `messages`, rendered as
/v1/chat/completions renders them) -> `{count, max_model_len, tokens}`, and `{tokens}` -> `{prompt}`. Agents
use them to budget their context; the limits are the ones generation has (a text past any context is a 400)."""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web

from tfserve.server.chat_prompt import INLINE_PROMPT_CHARS, render_chat, template_kwargs, text_chars
from tfserve.sampling_params import MAX_INT64
from tfserve.server.errors import bad_request
from tfserve.server.generation import check_text_fits
from tfserve.server.protocol import read_json, shorten, use_model
from tfserve.server.requests.tokenize import DetokenizeRequest, TokenizeRequest
from tfserve.server.runtime.state import STATE
from tfserve.server.runtime.threads import in_daemon_thread

MAX_DETOKENIZE_TOKENS = 1 << 20  # token ids in one /detokenize (a few MB of JSON; any context is shorter)


async def tokenize(request: web.Request) -> web.Response:
    """`prompt` or `messages` (with `add_generation_prompt`, `continue_final_message`, `tools`,
    `chat_template_kwargs`) -> its token ids; `add_special_tokens` (default: true for a prompt, false for
    messages, whose template writes them); `return_token_strs` adds each token's text."""
    state = request.app[STATE]
    typed = TokenizeRequest.parse(await read_json(request))
    await use_model(request, typed.model, state)
    state.check_available()
    tokenizer = state.engine.tokenizer
    if typed.chat is None:
        prompt, add_special = typed.prompt, typed.add_special_tokens is not False
        check_text_fits(state, len(prompt), "prompt")
        if len(prompt) < INLINE_PROMPT_CHARS:
            ids = tokenizer.encode(prompt, add_special_tokens=add_special)
        else:  # megabytes of text: on a thread, the event loop serving the others meanwhile
            ids = await in_daemon_thread(functools.partial(tokenizer.encode, prompt, add_special_tokens=add_special))
    else:
        ids = await _chat_ids(state, typed)
    ids = list(ids)
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
                             "token_strs": None}
    if typed.return_token_strs:
        reply["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return web.json_response(reply)


async def _chat_ids(state: Any, typed: TokenizeRequest) -> list[int]:
    messages = typed.chat
    if messages.image_refs:
        raise bad_request("tokenize takes text messages only; an image's tokens depend on its pixels",
                          messages.image_refs[0].where)
    check_text_fits(state, text_chars(messages.rendered), "messages")
    ids = await render_chat(state.engine.tokenizer, messages.rendered, typed.function_tools,
                            template_kwargs(state, {"chat_template_kwargs": typed.chat_template_kwargs}),
                            **typed.render_options)
    bos = state.engine.tokenizer.bos_token_id
    if typed.add_special_tokens and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


async def detokenize(request: web.Request) -> web.Response:
    """`tokens` (ids in the vocabulary) -> `prompt`, their text with special tokens as written."""
    state = request.app[STATE]
    typed = DetokenizeRequest.parse(await read_json(request))
    await use_model(request, typed.model, state)
    state.check_available()
    tokens = typed.tokens
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise bad_request(f"tokens may hold at most {MAX_DETOKENIZE_TOKENS} ids (got {len(tokens)})", "tokens")
    vocab_size = state.engine.vocab_size
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < min(vocab_size, MAX_INT64):
            raise bad_request(f"tokens[{i}] must be a token id in [0, {vocab_size}) (got {shorten(token)})",
                              f"tokens[{i}]")
    tokenizer = state.engine.tokenizer
    if len(tokens) < INLINE_PROMPT_CHARS:
        text = tokenizer.decode(tokens)
    else:
        text = await in_daemon_thread(tokenizer.decode, tokens)
    return web.json_response({"prompt": text})
