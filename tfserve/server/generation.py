"""The part every generating endpoint shares: admit (build the engine requests once through
`Engine.make_requests`, which also fans out `n` samples per prompt; 400/429/503), run them concurrently, and
yield `(choice index, output)` as tokens arrive.

Leaving the iteration early (client gone, error, handler cancelled) cancels every sample's task, which
aborts its engine request and frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tfserve import __version__
from tfserve.errors import GrammarFailed
from tfserve.server.errors import ApiError, from_value_error
from tfserve.server.protocol import too_many
from tfserve.server.runtime.state import ServerState


@dataclass(slots=True)
class Usage:
    """True token counts of one HTTP request; also what the access log prints."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # of the first sequence to produce a token
    num_cached_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    outputs: list[Any] = field(default_factory=list)  # each sequence's final RequestOutput (for telemetry)
    generated: dict[int, int] = field(default_factory=dict)  # tokens each choice has generated so far

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens read from the prefix cache (n sequences of one prompt count it once)."""
        return min(self.num_cached_tokens, self.prompt_tokens)

    def to_openai(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def so_far(self) -> dict[str, Any]:
        """The counts while the choices run (vLLM's `continuous_usage_stats`): the tokens generated so far."""
        completion = sum(self.generated.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


USAGE = web.RequestKey("tfserve_usage", Usage)  # request[USAGE]: what the access logger prints


def usage_of(request: web.Request) -> Usage:
    """The request's Usage, made on first use."""
    usage = request.get(USAGE)
    if usage is None:
        usage = request[USAGE] = Usage()
    return usage


def admit(state: ServerState, request: web.Request, prompts: list[list[int]], params: Any,
          names: dict[str, str] | None = None, mm: Any = None) -> tuple[Usage, list[Any]]:
    """Check everything that can fail before a response starts and build the engine requests, once:
    availability (503), each prompt against the context and the KV cache (400, naming the fields as `names`
    says the client sent them), and the queue limit (429). Counts the prompt tokens.

    Returns the request's Usage and its engine requests in choice order: `params.n` samples of each prompt
    (sample `j` seeded `seed + j`), so choice `i * n + j` is sample `j` of prompt `i`. `mm`: what the engine's
    `render_multimodal` made of a chat prompt's images, handed on to `make_requests` (None: a text prompt)."""
    state.check_available()
    names = names or {}
    requests = []
    for prompt_ids in prompts:
        try:
            if mm is None:
                requests.extend(state.engine.make_requests(prompt_ids, params))
            else:
                requests.extend(state.engine.make_requests(prompt_ids, params, mm=mm))
        except ValueError as exc:
            raise from_value_error(exc, names.get("prompt", "messages"), names) from None
    check_sequences(state, len(requests), "n" if params.n > 1 else names.get("prompt", "messages"))
    waiting = state.num_waiting + len(state.admitted)
    if state.max_queued and waiting + len(requests) > state.max_queued:
        raise too_many(f"the server has {waiting} sequences waiting for their first token (--max-queued "
                       f"{state.max_queued}); retry shortly")
    state.admitted.update(requests)
    usage = usage_of(request)
    usage.prompt_tokens += sum(len(p) for p in prompts)
    state.metrics.prompt_tokens.inc(usage.prompt_tokens)
    return usage, requests


def check_sequences(state: ServerState, num_sequences: int, param: str) -> None:
    """A 400 for a request that alone makes more sequences than the server queues: retrying cannot help."""
    if state.max_queued and num_sequences > state.max_queued:
        raise ApiError(400, f"this request makes {num_sequences} sequences (prompts times n), more than the server "
                            f"queues at once (--max-queued {state.max_queued}); send fewer prompts or a smaller n",
                       param=param)


def check_text_fits(state: ServerState, num_chars: int, param: str) -> None:
    """A 400 `context_length_exceeded` for text so long that no tokenization of it fits the model's context,
    before tokenizing it (15 MB of text took 10 s of a core to be told so). A token covers at most the longest
    entry of the vocabulary's characters; four times that, for normalizers that merge characters."""
    engine = state.engine
    longest = _longest_entry(engine.tokenizer)
    if longest and num_chars > 4 * longest * engine.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {engine.max_model_len} tokens. However, the "
                            f"{param} holds {num_chars} characters of text, more than that many tokens can take: "
                            "shorten it", param=param, code="context_length_exceeded")  # OpenAI's words: clients
        # (litellm, LangChain) tell an overflow by them


# characters of each tokenizer's longest vocabulary entry, while it lives (a model loaded on demand brings its own)
_LONGEST_ENTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _longest_entry(tokenizer: Any) -> int:
    if tokenizer not in _LONGEST_ENTRY:
        try:
            _LONGEST_ENTRY[tokenizer] = max(map(len, tokenizer.get_vocab()), default=0)
        except Exception:  # a tokenizer without a vocabulary to list: no bound (tokenized as before)
            _LONGEST_ENTRY[tokenizer] = 0
    return _LONGEST_ENTRY[tokenizer]


async def run_choices(state: ServerState, usage: Usage, requests: list[Any],
                      stopped: set[int] | None = None) -> AsyncIterator[tuple[int, Any]]:
    """Run the engine requests `admit` built, concurrently, and yield `(index, output)` as tokens arrive; the
    index is the request's place in `requests` (its choice index). Raises ApiError 500 for a sequence the
    engine failed, 503 for one it aborted (shutdown).

    A consumer may end a choice early by adding its index to `stopped` (e.g. a reply that repeats a tool
    call): its engine request is aborted, no more of its outputs come, and its tokens so far are counted."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(state, index, engine_request, queue))
             for index, engine_request in enumerate(requests)]
    num_left = len(tasks)
    last_token_time: dict[int, float] = {}
    last_output: dict[int, Any] = {}
    ended: set[int] = set()  # finished, or stopped by the consumer
    try:
        while num_left:
            index, output = await queue.get()
            if index in ended:  # queued before the consumer stopped it
                continue
            if isinstance(output, BaseException):
                raise output
            now = time.perf_counter()
            if index in last_token_time and output.delta_tokens:
                state.metrics.inter_token.observe(now - last_token_time[index])
            last_token_time[index] = now
            last_output[index] = output
            usage.generated[index] = len(output.generated_tokens)
            if usage.ttft_s is None and output.delta_tokens:
                usage.ttft_s = now - usage.started
            if output.finished:
                num_left -= 1
                ended.add(index)
                # counted before an aborted or failed one raises: its streamed tokens are in the access log
                usage.completion_tokens += len(output.generated_tokens)
                usage.outputs.append(output)
                if output.metrics is not None:
                    usage.num_cached_tokens += output.metrics.num_cached_tokens
                state.metrics.observe_finished(output)
                _check_finished(output)
            yield index, output
            for index in sorted((stopped or set()) - ended):
                ended.add(index)
                num_left -= 1
                tasks[index].cancel()  # aborts its engine request
                _count_cut(state, usage, last_output.get(index))
    finally:
        for index in set(last_output) - ended:  # cut short (the client left, another choice failed)
            _count_cut(state, usage, last_output[index])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _count_cut(state: ServerState, usage: Usage, output: Any) -> None:
    """Count the tokens a sequence ended before its end generated (the usage, the access log, /metrics)."""
    if output is not None:
        usage.completion_tokens += len(output.generated_tokens)
        state.metrics.generation_tokens.inc(len(output.generated_tokens))


async def _pump(state: ServerState, index: int, engine_request: Any, queue: asyncio.Queue) -> None:
    state.admitted.discard(engine_request)
    state.num_waiting += 1
    waiting = True
    try:
        async for output in state.generate(engine_request):
            if waiting:
                state.num_waiting -= 1
                waiting = False
            queue.put_nowait((index, output))
    except ValueError as exc:
        queue.put_nowait((index, from_value_error(exc)))
    except Exception as exc:  # one failed sequence fails its own HTTP request only
        queue.put_nowait((index, ApiError(500, f"{type(exc).__name__}: {exc}")))
    finally:
        if waiting:
            state.num_waiting -= 1


def _check_finished(output: Any) -> None:
    if output.finish_reason == "error" and isinstance(output.error, GrammarFailed):  # the request's grammar
        raise ApiError(400, f"{output.error} while generating; simplify the schema or grammar", code="invalid_grammar")
    if output.finish_reason == "error":
        raise ApiError(500, f"generation failed: {output.error or 'unknown error'}", code="generation_error")
    if output.finish_reason == "abort":
        raise ApiError(503, "the request was aborted: the server is shutting down", code="server_draining")


# OpenAI's schema wants a string; ours names the server build that answered
SYSTEM_FINGERPRINT = f"fp_tfserve_{__version__}"


class Reply:
    """What one request's response objects share: id, creation time, model, and the envelope around the
    choices (`chat.completion`, `text_completion` and their stream chunks)."""

    chunk_object = ""  # the `object` of a stream chunk
    # with include_usage, chat's chunks say `"usage": null` until the last (as OpenAI's do); a completion chunk's
    # schema types usage as an object only, so there it is left out until the last
    null_usage = True

    def __init__(self, model: str, id_prefix: str) -> None:
        self.model = model
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.continuous: Usage | None = None  # vLLM's continuous_usage_stats: every chunk says the counts so far
        self.stop_token_ids: frozenset[int] = frozenset()  # the request's own (not EOS), for stop_reason

    def stop_reason(self, output: Any) -> dict[str, Any]:
        """vLLM's `stop_reason` of a finished choice, as a field to add: the stop string or stop token id of the
        request's that ended it. Left out otherwise (the end of text, a length cut), so a choice is shaped as
        OpenAI's unless the request's own stop fired."""
        reason = output.stop_reason if output.finish_reason == "stop" else None
        return {"stop_reason": reason} if isinstance(reason, str) or reason in self.stop_token_ids else {}

    def envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices, **extra}

    def chunk(self, choices: list[dict], include_usage: bool, usage: dict | None = None) -> dict:
        body = self.envelope(self.chunk_object, choices)
        if include_usage and usage is None and choices and self.continuous is not None:
            usage = self.continuous.so_far()
        if include_usage and (usage is not None or self.null_usage):
            body["usage"] = usage
        return body
