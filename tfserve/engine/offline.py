"""Offline batches: every prompt of a list run to its end on the calling thread (`Engine.generate_batch`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tfserve.engine.admission import is_token_id
from tfserve.engine.request import RequestOutput
from tfserve.sampling_params import SamplingParams


def generate_batch(engine: Any, inputs: Iterable[list[int] | str], params: SamplingParams | Any | None = None,
                   progress: bool = False) -> dict[str, RequestOutput]:
    """Generate on `engine` for every input (a prompt alone, a string or a list of token ids, is one input);
    returns request id -> final output, in input order. Every input is validated before any is queued; a step
    that raises (or Ctrl-C) aborts what is left, and the engine stays usable."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and is_token_id(inputs[0])) \
            or getattr(inputs, "ndim", None) == 1:  # one prompt (a 1-D array or tensor of ids too)
        inputs = [inputs]
    if not isinstance(inputs, Iterable) or isinstance(inputs, (dict, bytes)):
        raise ValueError(f"inputs must be a list of prompts (strings or lists of token ids), not "
                         f"{type(inputs).__name__}")
    requests = [request for prompt in inputs for request in engine.make_requests(prompt, params)]
    for request in requests:
        engine.enqueue(request)
    order = [request.request_id for request in requests]
    results: dict[str, RequestOutput] = {}
    pending = set(order)
    bar = _progress(len(order)) if progress else None
    try:
        while pending:
            for output in engine.step():
                if output.finished and output.request_id in pending:
                    results[output.request_id] = output
                    pending.discard(output.request_id)
                    if bar is not None:
                        bar.update(1)
    except BaseException:  # a step that raised, Ctrl-C: these requests go, the engine stays usable
        for request_id in pending:
            engine.abort(request_id)
        raise
    finally:
        if bar is not None:
            bar.close()
    return {request_id: results[request_id] for request_id in order}


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate_batch", unit="req")
