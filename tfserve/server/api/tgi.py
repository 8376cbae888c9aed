"""Text Generation Inference's own API, which huggingface_hub's `InferenceClient.text_generation` speaks:
POST /generate (`{generated_text, details}`), POST /generate_stream (SSE as TGI sends it, one event per token:
`data:{"index":..,"token":{..},"generated_text":null,"details":null}`), POST / (either, by `stream`; the
client posts there when given a bare URL), GET /info. `parameters` map onto the same engine requests
/v1/completions makes; one that changes the output and is not honoured is a 422, as TGI's validation says."""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

from aiohttp import web

from tfserve import __version__
from tfserve.server.chat_prompt import INLINE_PROMPT_CHARS
from tfserve.server.errors import ApiError, bad_request, error_for
from tfserve.server.generation import admit, check_text_fits, run_choices
from tfserve.server.protocol import make_params, read_json, use_model
from tfserve.server.requests.tgi import TgiRequest
from tfserve.server.runtime.state import STATE
from tfserve.server.runtime.threads import in_daemon_thread
from tfserve.server.sse import EventStream
from tfserve.server.tools.response_format import compile_grammar



def add_routes(app: web.Application) -> None:
    """TGI's routes on `app`."""
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/", compat_generate)
    app.router.add_get("/info", info)


async def info(request: web.Request) -> web.Response:
    """GET /info: the served model and the limits a request meets."""
    state = request.app[STATE]
    state.check_available()
    max_model_len = state.engine.max_model_len
    return web.json_response({
        "model_id": state.model_name, "model_sha": None, "model_pipeline_tag": "text-generation",
        "model_dtype": str(getattr(state.engine, "dtype", "")).removeprefix("torch.") or None,
        "max_concurrent_requests": state.max_queued or 128, "max_best_of": 1, "max_stop_sequences": 16,
        "max_input_tokens": max_model_len - 1, "max_total_tokens": max_model_len, "max_client_batch_size": 1,
        "validation_workers": 1, "router": "tfserve", "version": __version__, "sha": None, "docker_label": None})


async def generate(request: web.Request) -> web.Response:
    """POST /generate: `{generated_text, details}`."""
    return await _answer(request, stream=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """POST /generate_stream: one SSE event per token."""
    return await _answer(request, stream=True)


async def compat_generate(request: web.Request) -> web.StreamResponse:
    """POST /: TGI's route for either; a whole answer is a list of one."""
    return await _answer(request, stream=None)


async def _answer(request: web.Request, stream: bool | None) -> web.StreamResponse:
    state = request.app[STATE]
    tgi = TgiRequest.parse(await read_json(request))
    await use_model(request, None, state)
    inputs, parameters = tgi.inputs, tgi.parameters
    if stream is None:
        stream = bool(tgi.stream)
    check_text_fits(state, len(inputs), "inputs")
    if len(inputs) < INLINE_PROMPT_CHARS:
        ids = state.engine.tokenizer.encode(inputs)
    else:  # megabytes of text to tokenize: on a thread, the event loop serving the others meanwhile
        ids = await in_daemon_thread(state.engine.tokenizer.encode, inputs)
    if parameters.truncate is not None:
        ids = ids[-parameters.truncate:]
    if not ids:
        raise bad_request("inputs must not be empty", "inputs")
    kwargs = parameters.to_sampling_kwargs()
    if parameters.constraint is not None:
        await compile_grammar(state.engine, parameters.constraint[0], "parameters.grammar")
        kwargs["grammar"] = parameters.constraint[0]
    params = make_params(kwargs, len(ids), state.engine, tgi.names)
    prefix = inputs if parameters.return_full_text else ""
    usage, engine_requests = admit(state, request, [ids], params, {"prompt": "inputs"})
    reply = _Reply(state, bool(parameters.details), params.seed if kwargs.get("temperature") != 0 else None, prefix)
    async with aclosing(run_choices(state, usage, engine_requests)) as outputs:
        if stream:
            return await reply.stream(request, outputs)
        result = await reply.complete(outputs, bool(parameters.decoder_input_details))
        return web.json_response(result if request.path != "/" else [result])


class _Reply:
    """TGI's answer objects for one request."""

    def __init__(self, state: Any, details: bool, seed: int | None, prefix: str) -> None:
        self.state, self.details, self.seed, self.prefix = state, details, seed, prefix
        self.special = set(state.engine.tokenizer.all_special_ids)

    def token(self, entry: dict[str, Any], text: str | None = None) -> dict[str, Any]:
        token_id = entry["token_id"]
        special = token_id in self.special
        if text is None:
            text = "" if special else self.state.token_texts(token_id)[0]
        return {"id": token_id, "text": text, "logprob": _finite(entry.get("logprob")), "special": special}

    def top_tokens(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        return [self.token({"token_id": t, "logprob": lp}) for t, lp in entry.get("top", ())]

    def finish_reason(self, output: Any) -> str:
        if output.finish_reason == "stop":
            return "stop_sequence" if isinstance(output.stop_reason, str) else "eos_token"
        return output.finish_reason  # "length"

    async def complete(self, outputs: Any, prefill: bool) -> dict[str, Any]:
        final = None
        async for _, output in outputs:
            final = output
        result: dict[str, Any] = {"generated_text": self.prefix + final.text}
        if self.details:
            entries = final.logprobs or []
            details = {"finish_reason": self.finish_reason(final), "generated_tokens": len(final.generated_tokens),
                       "seed": self.seed, "prefill": [], "tokens": [self.token(e) for e in entries],
                       "best_of_sequences": None}
            if any(e.get("top") for e in entries):
                details["top_tokens"] = [self.top_tokens(e) for e in entries]
            if prefill:
                details["prefill"] = [
                    {"id": token_id, "text": self.state.token_texts(token_id)[0],
                     "logprob": None if entry is None else _finite(entry["logprob"])}
                    for token_id, entry in zip(final.prompt_token_ids, final.prompt_logprobs or [])]
            result["details"] = details
        return result

    async def stream(self, request: web.Request, outputs: Any) -> web.StreamResponse:
        sse = _TgiEvents(request)
        pending = None  # the last token's event, held back: the final output may bring no token of its own
        try:
            async for _, output in outputs:
                # logprobs come with their tokens' text (held back while it may be a stop string's): one event each
                entries = output.delta_logprobs or []
                for i, entry in enumerate(entries):
                    if pending is not None:
                        await sse.send(pending)
                    # the step's text on its last token, so that the tokens' texts join into generated_text
                    pending = {"index": pending["index"] + 1 if pending else 1,
                               "token": self.token(entry, output.delta_text if i == len(entries) - 1 else ""),
                               "top_tokens": self.top_tokens(entry) if entry.get("top") else None,
                               "generated_text": None, "details": None}
                if not entries and pending is not None:
                    pending["token"]["text"] += output.delta_text
                if output.finished:
                    if pending is None:  # ended before any token: the event says so all the same
                        pending = {"index": 1, "token": {"id": 0, "text": "", "logprob": None, "special": True},
                                   "top_tokens": None, "details": None}
                    pending["generated_text"] = self.prefix + output.text
                    if self.details:
                        pending["details"] = {"finish_reason": self.finish_reason(output), "seed": self.seed,
                                              "generated_tokens": len(output.generated_tokens),
                                              "input_length": len(output.prompt_token_ids)}
                    await sse.send(pending)
        except ApiError as exc:
            if not sse.is_open:
                raise
            await sse.send(error_for("/generate", exc)[0])
        return await sse.close()


class _TgiEvents(EventStream):
    """TGI's server-sent events: `data:{json}` (no space), no closing [DONE]."""

    async def send(self, data: dict[str, Any], event: str | None = None) -> None:
        await self.open()
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data:{payload}\n\n".encode())


def _finite(value: float | None) -> float | None:
    return None if value is None or value != value or value in (float("inf"), float("-inf")) else value
