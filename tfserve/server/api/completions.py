"""POST /v1/completions: the legacy prompt-in, text-out API (`echo`, legacy `logprobs`, both together as
OpenAI's API had them; vLLM's `prompt_logprobs`), whole or streamed."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from tfserve.server.api.logprobs import TextOffsets, completion_logprobs, echo_logprobs, prompt_logprobs, shown
from tfserve.server.chat_prompt import INLINE_PROMPT_CHARS
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.generation import Reply, admit, check_sequences, check_text_fits, run_choices
from tfserve.server.protocol import field, make_params, read_json, shorten, use_model
from tfserve.server.requests.completions import CompletionRequest
from tfserve.server.runtime.request_limits import check_num_sequences
from tfserve.server.runtime.state import STATE
from tfserve.server.runtime.threads import in_daemon_thread
from tfserve.server.sse import EventStream
from tfserve.server.tools.response_format import compile_grammar


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    completion = CompletionRequest.parse(body)
    model = await use_model(request, completion.model, state)
    _check_size(state, completion)
    args = (completion.prompt, state.engine.tokenizer, state.engine.vocab_size)
    if len(str(completion.prompt)) < INLINE_PROMPT_CHARS:
        prompts = parse_prompts(*args)
    else:  # megabytes of text to tokenize: on a thread, the event loop serving the others meanwhile
        prompts = await in_daemon_thread(parse_prompts, *args)
    kwargs = completion.to_sampling_kwargs()
    if completion.constraint is not None:  # vLLM takes response_format and structured_outputs here too
        await compile_grammar(state.engine, *completion.constraint)
        kwargs["grammar"] = completion.constraint[0]
    names = completion.names
    params = make_params(kwargs, max(len(p) for p, _ in prompts), state.engine, names)
    usage, engine_requests = admit(state, request, [p for p, _ in prompts], params, names)
    reply = _Reply(state, model, completion.logprobs, [text for _, text in prompts] if completion.echo else None,
                   params.n)
    reply.num_prompt_top = completion.prompt_logprobs
    reply.stop_token_ids = frozenset(params.stop_token_ids)
    if completion.continuous_usage:
        reply.continuous = usage
    choices = run_choices(state, usage, engine_requests)
    async with aclosing(_prompt_only(choices, usage) if completion.score_only else choices) as outputs:
        if completion.stream:
            return await reply.stream(request, outputs, usage, completion.include_usage)
        return await reply.complete(outputs, usage)


def _check_size(state: Any, completion: CompletionRequest) -> None:
    """What can be told before tokenizing: a text past any context, more prompts than the queue takes."""
    prompt = completion.prompt
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    for text in texts:
        if isinstance(text, str):
            check_text_fits(state, len(text), "prompt")
    check_num_sequences(state.limits, completion.n)
    n = completion.n or 1
    if isinstance(prompt, list) and prompt and not all(_is_token(t) for t in prompt):
        check_sequences(state, len(prompt) * n, "n" if n > 1 else "prompt")


def parse_prompts(prompt: Any, tokenizer: Any, vocab_size: int) -> list[tuple[list[int], str]]:
    """`prompt` (text, token ids, or a list of either) -> [(token ids, text)]; token ids must be in
    [0, vocab_size)."""
    prompt = field({"prompt": prompt}, "prompt", (str, list), required=True)
    if isinstance(prompt, str) or (prompt and all(_is_token(t) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    result = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=True)
            result.append((ids, item))
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            _check_vocabulary(item, vocab_size)
            result.append((item, tokenizer.decode(item)))
        else:
            raise bad_request(f"prompt[{i}] must be a string or a non-empty array of token ids", "prompt")
        if not result[-1][0]:
            raise bad_request("prompt must not be empty", "prompt")
    return result


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_vocabulary(token_ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"prompt has token id {shorten(bad)}, outside the vocabulary [0, {vocab_size})", "prompt")


class _Reply(Reply):
    chunk_object = "text_completion"
    null_usage = False
    num_prompt_top: int | None = None  # vLLM's prompt_logprobs: the top tokens shown per prompt token

    def __init__(self, state: Any, model: str, num_top: int | None, echo_texts: list[str] | None, n: int) -> None:
        super().__init__(model, "cmpl")
        self.state, self.num_top, self.echo_texts, self.n = state, num_top, echo_texts, n

    def _echo(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts is not None else ""

    def _logprobs(self, entries: list[dict] | None, offsets: TextOffsets) -> dict | None:
        if self.num_top is None:
            return None
        return completion_logprobs(entries or [], self.state.token_texts, offsets)

    def _echo_logprobs(self, output: Any) -> dict | None:
        """The echoed prompt's logprobs (`echo` with `logprobs`), or None."""
        if self.num_top is None or self.echo_texts is None or output.prompt_logprobs is None:
            return None
        return echo_logprobs(output.prompt_token_ids, output.prompt_logprobs, self.state.token_texts, self.num_top)

    def _choice_logprobs(self, index: int, output: Any) -> dict | None:
        """A whole choice's `logprobs`: the echoed prompt's tokens, then the generated ones."""
        generated = self._logprobs(shown(output.logprobs, output), TextOffsets(len(self._echo(index))))
        echoed = self._echo_logprobs(output)
        if generated is None or echoed is None:
            return generated
        return {key: echoed[key] + generated[key] for key in generated}

    def _prompt_logprobs(self, output: Any) -> dict:
        """vLLM's `prompt_logprobs` field of a choice, when asked for."""
        if self.num_prompt_top is None:
            return {}
        entries = output.prompt_logprobs or []
        return {"prompt_logprobs": prompt_logprobs(entries, self.state.token_texts, self.num_prompt_top)}

    async def complete(self, outputs, usage) -> web.Response:
        finals: dict[int, Any] = {}
        async for index, output in outputs:
            if output.finished:
                finals[index] = output
        choices = [{"index": i, "text": self._echo(i) + finals[i].text,
                    "logprobs": self._choice_logprobs(i, finals[i]),
                    "finish_reason": finals[i].finish_reason, **self.stop_reason(finals[i]),
                    **self._prompt_logprobs(finals[i])}
                   for i in sorted(finals)]
        return web.json_response(self.envelope("text_completion", choices, usage=usage.to_openai()))

    async def stream(self, request: web.Request, outputs, usage, include_usage: bool) -> web.StreamResponse:
        sse = EventStream(request)
        offsets: dict[int, TextOffsets] = {}
        try:
            async for index, output in outputs:
                if index not in offsets:  # text_offset counts in the choice's whole text
                    offsets[index] = TextOffsets(len(self._echo(index)))
                    if self.echo_texts is not None:
                        await sse.send(self.chunk([{"index": index, "text": self._echo(index),
                                                     "logprobs": self._echo_logprobs(output),
                                                     "finish_reason": None}], include_usage))
                entries = shown(output.delta_logprobs, output)
                if output.delta_text or entries:
                    logprobs = self._logprobs(entries, offsets[index])
                    await sse.send(self.chunk([{"index": index, "text": output.delta_text, "logprobs": logprobs,
                                                 "finish_reason": None}], include_usage))
                if output.finished:
                    await sse.send(self.chunk([{"index": index, "text": "", "logprobs": None,
                                                 "finish_reason": output.finish_reason,
                                                 **self.stop_reason(output)}], include_usage))
            if include_usage:
                await sse.send(self.chunk([], True, usage.to_openai()))
        except ApiError as exc:
            if not sse.is_open:
                raise
            await sse.send_error(exc)
        return await sse.done()


async def _prompt_only(outputs, usage):
    """The outputs of a prompt read alone (max_tokens 0), without the one token generated to finish it."""
    async for index, output in outputs:
        if output.finished:
            usage.completion_tokens -= len(output.generated_tokens)
            yield index, replace(output, generated_tokens=[], text="", delta_text="", delta_tokens=[],
                                 logprobs=[], delta_logprobs=[], finish_reason="length", stop_reason=None)

