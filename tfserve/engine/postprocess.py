"""After a step: each request's new tokens appended, its grammar advanced, its stops checked, its text
detokenized, and the `RequestOutput` a caller receives. Functions of one request each; the engine
(`Engine._postprocess`) finishes the requests they end and frees their blocks."""

from __future__ import annotations

import logging
import time

from tfserve.engine.request import Request, RequestMetrics, RequestOutput, RequestStatus
from tfserve.engine.structured import grammar_error_line
from tfserve.errors import GrammarFailed

logger = logging.getLogger(__name__)


def take_tokens(request: Request, token_ids: list[int], max_model_len: int) -> tuple[list[int], str, RequestStatus | None]:
    """Append `token_ids` (one, or several from speculative decoding) to `request` one at a time until one of
    them finishes it. Returns the tokens taken, their text, and the status that finishes the request (None
    while it goes on)."""
    delta, status, taken = "", None, []
    detok = request.detokenizer
    if request.error is not None:  # its grammar's mask overran the step's budget (apply_grammars)
        logger.error("request %s: %s", request.request_id, request.error)
        return taken, delta, RequestStatus.FINISHED_ERROR
    for token_id in token_ids:
        request.token_ids.append(token_id)
        taken.append(token_id)
        if request.matcher is not None and not request.matcher.consume_token(token_id):
            # the mask allowed only what the grammar accepts: the grammar engine failed (a bug, or a
            # limit it met only now); the rest of the output could not be held to the grammar
            error = grammar_error_line(request.matcher.get_error())  # (the whole of it quotes the grammar)
            logger.error("request %s: grammar rejected token %d: %s", request.request_id, token_id, error)
            request.error = GrammarFailed(error)
            status = RequestStatus.FINISHED_ERROR
            break
        status = check_stop(request, token_id, max_model_len)
        if detok is not None:
            # the EOS or stop token that ended it gives no text, unless asked for (as vLLM's)
            hides_token = (status == RequestStatus.FINISHED_STOPPED and request.stop_reason is not None
                           and not detok.include_stop_str_in_output)
            text, stop_str = detok.step([] if hides_token else [token_id])
            delta += text
            if stop_str is not None:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
                if (request.logprobs and not detok.include_stop_str_in_output
                        and len(request.logprobs) == len(detok.token_ids)):
                    # the text ends before the stop string: so do its tokens' logprobs (as OpenAI's)
                    del request.logprobs[detok.num_tokens_of_text():]
            elif status is not None:
                delta += detok.flush()
        if status is not None:
            break
    return taken, delta, status


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The status `token_id` finishes `request` with (a stop token, EOS, its length), or None."""
    params = request.params
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    if not params.ignore_eos and token_id in request.eos_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def logprobs_to_send(request: Request, final: bool) -> list | None:
    """The logprobs a stream sends with this output: those of the tokens whose text is out (all of them once
    the request ends), so a chunk's logprobs go with its text and a stop string's tokens never show."""
    if request.logprobs is None:
        return None
    detok = request.detokenizer
    if not final and detok is not None and detok.holds_text:
        return None
    sent, request.num_logprobs_sent = request.num_logprobs_sent, len(request.logprobs)
    return request.logprobs[sent:] or None


def make_output(request: Request, delta_tokens: list[int], delta_text: str, final: bool,
                delta_logprobs: list | None = None) -> RequestOutput:
    """What a caller receives for `request` now: its tokens and text so far, this step's delta, and once
    `final`, its finish reason and timings."""
    metrics = None
    if final:
        finish = request.finish_time or time.perf_counter()
        arrival = request.arrival_time
        metrics = RequestMetrics(
            arrival_time=arrival,
            queue_s=None if request.scheduled_time is None else request.scheduled_time - arrival,
            ttft_s=None if request.first_token_time is None else request.first_token_time - arrival,
            e2e_s=finish - arrival,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
        )
    detok = request.detokenizer
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        generated_tokens=request.output_token_ids,
        text=detok.text if detok is not None else "",
        finish_reason=request.status.finish_reason if final else None,
        logprobs=request.logprobs,
        metrics=metrics,
        delta_text=delta_text,
        delta_tokens=delta_tokens,
        delta_logprobs=delta_logprobs,
        stop_reason=request.stop_reason,
        stop_token_shown=isinstance(request.stop_reason, int) and request.params.include_stop_str_in_output,
        error=request.error,
        prompt_logprobs=None if request.needs_prompt_logits else request.prompt_logprobs,
    )
