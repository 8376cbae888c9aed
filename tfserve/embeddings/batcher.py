"""Many callers, one forward: embedding requests from the event loop queue here, and the encoder's work thread
runs every request waiting (up to `max_batch_inputs` inputs) in one `Encoder.encode`. Requests that arrive while a
forward runs make the next batch; a request still being tokenized when a batch forms is waited for, at most
`batch_wait_ms`, so that a burst of concurrent requests is not cut into a lone first one and the rest. A lone
request never waits.

The event loop never runs torch: tokenizing a large request goes to a thread, the forward to the work thread
(`tfserve.engine.threads.WorkThread`, which ends when idle, so an idle encoder keeps no OpenMP pool beside a busy
chat engine).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass

from tfserve.embeddings.encoder import EmbeddingInputError, Embeddings, Encoder
from tfserve.engine.threads import WorkThread

_INLINE_TOKENIZE_CHARS = 8192  # smaller requests are tokenized on the loop: a thread hop would cost more


@dataclass(slots=True)
class _Job:
    token_ids: list[list[int]]
    dimensions: int | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class EncoderBatcher:
    """Batches the embedding requests of an event loop into forwards of `encoder` on a thread of its own."""

    def __init__(self, encoder: Encoder, max_batch_inputs: int = 256, batch_wait_ms: float = 2.0) -> None:
        self.encoder = encoder
        self.max_batch_inputs = max_batch_inputs  # inputs one forward pass takes at most (whole requests)
        self.batch_wait_s = batch_wait_ms / 1000  # how long a batch waits for requests still being tokenized
        self.num_arriving = 0  # requests tokenizing, about to queue
        self.num_batches = 0  # forwards run, for tests and metrics
        self._waiting: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._worker = WorkThread(f"tfserve-encoder-{encoder.name}", self._step, lambda: bool(self._waiting),
                                  on_stop=self._fail_all)

    @property
    def name(self) -> str:
        return self.encoder.name

    def start(self) -> EncoderBatcher:
        self._worker.start()
        return self

    def stop(self) -> None:
        self._worker.stop()

    async def embed(self, inputs: list[str] | list[list[int]], *, truncate: bool = False,
                    dimensions: int | None = None, max_tokens: int | None = None) -> Embeddings:
        """Embed `inputs` (texts, or token id lists taken as given); EmbeddingInputError for one that is too long
        (unless `truncate`: cut to the model's limit), for more than `max_tokens` tokens in all, or for a
        `dimensions` the model cannot cut its vectors to."""
        dimensions = self.encoder.check_dimensions(dimensions)
        self.num_arriving += 1
        try:
            if inputs and isinstance(inputs[0], str):
                if sum(len(text) for text in inputs) <= _INLINE_TOKENIZE_CHARS:
                    token_ids = self.encoder.tokenize(inputs, truncate)
                else:
                    token_ids = await asyncio.to_thread(self.encoder.tokenize, inputs, truncate)
            else:
                token_ids = self.encoder.check_ids(inputs, truncate)
        finally:
            self.num_arriving -= 1
        num_tokens = sum(len(ids) for ids in token_ids)
        if max_tokens is not None and num_tokens > max_tokens:
            raise EmbeddingInputError(f"input holds {num_tokens} tokens, more than the {max_tokens} one request may "
                                      "hold; send fewer inputs per request", code="too_many_tokens")
        vectors = await self.embed_ids(token_ids, dimensions)
        return Embeddings(vectors=vectors, num_tokens=num_tokens)

    async def embed_ids(self, token_ids: list[list[int]], dimensions: int | None = None):
        """Vectors [len(token_ids), dimensions] of inputs already checked, from the next batch's forward."""
        if not self._worker.is_running:
            raise RuntimeError(f"the encoder of {self.name} has stopped")
        loop = asyncio.get_running_loop()
        job = _Job(token_ids, dimensions, loop.create_future(), loop)
        with self._lock:
            self._waiting.append(job)
        self._worker.wake()
        return await job.future

    # -- the work thread ----------------------------------------------------------------------------------

    def _step(self) -> None:
        deadline = time.monotonic() + self.batch_wait_s
        while self.num_arriving and self._num_waiting_inputs() < self.max_batch_inputs and time.monotonic() < deadline:
            time.sleep(0.0002)
        jobs = self._take()
        by_size: dict[int | None, list[_Job]] = {}  # one forward per vector size asked for (almost always one)
        for job in jobs:
            by_size.setdefault(job.dimensions, []).append(job)
        for dimensions, group in by_size.items():
            try:
                vectors = self.encoder.encode([ids for job in group for ids in job.token_ids], dimensions)
            except Exception as exc:  # the batch's requests fail; the thread goes on
                for job in group:
                    job.loop.call_soon_threadsafe(_settle, job.future, None, exc)
                continue
            self.num_batches += 1
            start = 0
            for job in group:
                end = start + len(job.token_ids)
                job.loop.call_soon_threadsafe(_settle, job.future, vectors[start:end], None)
                start = end

    def _num_waiting_inputs(self) -> int:
        with self._lock:
            return sum(len(job.token_ids) for job in self._waiting)

    def _take(self) -> list[_Job]:
        """Whole requests from the front of the queue, up to `max_batch_inputs` inputs (at least one request);
        those whose caller has gone are dropped."""
        jobs, num_inputs = [], 0
        with self._lock:
            while self._waiting and (not jobs or num_inputs + len(self._waiting[0].token_ids) <= self.max_batch_inputs):
                job = self._waiting.popleft()
                if not job.future.cancelled():
                    jobs.append(job)
                    num_inputs += len(job.token_ids)
        return jobs

    def _fail_all(self) -> None:
        with self._lock:
            jobs, self._waiting = list(self._waiting), deque()
        for job in jobs:
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, None, RuntimeError("the encoder stopped"))
            except RuntimeError:  # its loop has closed: nobody waits
                pass


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():  # the caller left
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
