"""POST /v1/chat/completions: messages -> the model's chat template -> the engine; the reply's choices, whole or
streamed as OpenAI sends them, are built by `chat_reply.ChatReply`."""

from __future__ import annotations

from contextlib import aclosing
from aiohttp import web

from tfserve.protocol.reasoning import reasoning_for
from tfserve.protocol.tool_formats import detect_format
from tfserve.server.api.chat_reply import ChatReply
from tfserve.server.chat_prompt import render_chat, render_multimodal, template_kwargs, text_chars
from tfserve.server.generation import admit, check_text_fits, run_choices
from tfserve.server.media import gather_images
from tfserve.server.protocol import make_params, read_json, use_model
from tfserve.server.requests.chat import ChatCompletionRequest
from tfserve.server.runtime.request_limits import check_messages, check_num_sequences
from tfserve.server.runtime.state import STATE
from tfserve.server.tools.chat_mcp import chat_with_mcp
from tfserve.server.tools.output_spec import apply_spec, output_spec


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    # on the raw body, before parsing, on purpose: the counts alone refuse 400,000 messages or n=10**6 cheaply
    check_messages(state.limits, body.get("messages"))
    check_num_sequences(state.limits, body.get("n"))
    chat = ChatCompletionRequest.parse(body)
    model = await use_model(request, chat.model, state)
    messages, image_refs = chat.messages.rendered, chat.messages.image_refs
    if chat.has_mcp_tools:  # the server runs those tools' calls: a loop of turns
        return await chat_with_mcp(request, state, model, messages, image_refs, typed=chat)
    kwargs = chat.to_sampling_kwargs()
    tokenizer = state.engine.tokenizer
    tools = chat.function_tools
    spec = output_spec(chat.constraint, tools, chat.tool_choice, chat.parallel, detect_format(tokenizer), tokenizer)
    await apply_spec(state.engine, kwargs, spec, tokenizer, parameters_fields=chat.parameters_fields)
    variables = template_kwargs(state, {"chat_template_kwargs": chat.chat_template_kwargs})
    check_text_fits(state, text_chars(messages), "messages")
    images = await gather_images(state, image_refs)  # every field checked first: a bad one fetches nothing
    if images:
        prompt_ids, mm = await render_multimodal(state, messages, images, tools, variables, **chat.render_options)
    else:
        prompt_ids, mm = await render_chat(tokenizer, messages, tools, variables, **chat.render_options), None
    params = make_params(kwargs, len(prompt_ids), state.engine, chat.names)
    usage, engine_requests = admit(state, request, [prompt_ids], params, chat.names, mm=mm)
    reply = ChatReply(state, model, chat.num_top_logprobs, parse_tools_enabled=spec.parses_calls,
                      tool_format=spec.tool_format, legacy=chat.legacy)
    reply.reasoning = reasoning_for(tokenizer, prompt_ids)
    reply.num_prompt_top = chat.prompt_logprobs
    reply.stop_token_ids = frozenset(params.stop_token_ids)
    reply.echo = chat.echoed()
    if chat.continuous_usage:
        reply.continuous = usage
    async with aclosing(run_choices(state, usage, engine_requests, reply.stopped)) as outputs:
        if chat.stream:
            return await reply.stream(request, outputs, usage, chat.include_usage, params.n)
        return await reply.complete(outputs, usage, params.n)
