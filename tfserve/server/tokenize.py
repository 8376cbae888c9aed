"""POST /tokenize and POST /detokenize in vLLM's shapes: a `prompt` (or chat `messages`, rendered as
/v1/chat/completions renders them) -> `{count, max_model_len, tokens}`, and `{tokens}` -> `{prompt}`. Agents
use them to budget their context; the limits are the ones generation has (a text past any context is a 400)."""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web

from tfserve.server.chat import parse_messages
from tfserve.server.chat_prompt import (INLINE_PROMPT_CHARS, parse_tools, render_chat, render_options, template_kwargs,
                                        text_chars)
from tfserve.server.errors import bad_request
from tfserve.server.generation import check_text_fits
from tfserve.server.protocol import MAX_INT64, field, read_json, shorten, use_model
from tfserve.server.state import STATE
from tfserve.server.threads import in_daemon_thread

MAX_DETOKENIZE_TOKENS = 1 << 20  # token ids in one /detokenize (a few MB of JSON; any context is shorter)


async def tokenize(request: web.Request) -> web.Response:
    """`prompt` or `messages` (with `add_generation_prompt`, `continue_final_message`, `tools`,
    `chat_template_kwargs`) -> its token ids; `add_special_tokens` (default: true for a prompt, false for
    messages, whose template writes them); `return_token_strs` adds each token's text."""
    state = request.app[STATE]
    body = await read_json(request)
    await use_model(request, body, state)
    state.check_available()
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("send either prompt or messages", "prompt")
    tokenizer = state.engine.tokenizer
    if "prompt" in body:
        prompt = field(body, "prompt", str, required=True)
        add_special = field(body, "add_special_tokens", bool, True)
        check_text_fits(state, len(prompt), "prompt")
        if len(prompt) < INLINE_PROMPT_CHARS:
            ids = tokenizer.encode(prompt, add_special_tokens=add_special)
        else:  # megabytes of text: on a thread, the event loop serving the others meanwhile
            ids = await in_daemon_thread(functools.partial(tokenizer.encode, prompt, add_special_tokens=add_special))
    else:
        ids = await _chat_ids(state, body)
    ids = list(ids)
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
                             "token_strs": None}
    if field(body, "return_token_strs", bool, False):
        reply["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return web.json_response(reply)


async def _chat_ids(state: Any, body: dict[str, Any]) -> list[int]:
    messages, images = parse_messages(body)
    if images:
        raise bad_request("tokenize takes text messages only; an image's tokens depend on its pixels",
                          images[0].where)
    check_text_fits(state, text_chars(messages), "messages")
    tools = parse_tools(body)
    ids = await render_chat(state.engine.tokenizer, messages, tools, template_kwargs(state, body),
                            **render_options(body))
    bos = state.engine.tokenizer.bos_token_id
    if field(body, "add_special_tokens", bool, False) and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


async def detokenize(request: web.Request) -> web.Response:
    """`tokens` (ids in the vocabulary) -> `prompt`, their text with special tokens as written."""
    state = request.app[STATE]
    body = await read_json(request)
    await use_model(request, body, state)
    state.check_available()
    tokens = field(body, "tokens", list, required=True)
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
