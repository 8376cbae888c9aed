"""The Whisper batcher: transcriptions share encoder passes and decoder steps, continuously.

A job moves through its audio one 30-second window at a time (where the next window starts depends on the
timestamps the last one ended with, as openai-whisper's long-form decoding does). Every step admits windows
into free slots (their encoder passes run as one batch), then runs one decoder step for every window in flight;
a window that ends hands its segments to its job's sink and frees its slot for the job's next window or another
job's. One step reads: `admit() -> spread() -> decode() -> finish()`.

A window whose greedy decode fails the thresholds (a repetition loop, or unlikely text) is decoded again at
temperatures 0.2, 0.4, ... 1.0 and the first that passes is taken, as openai-whisper does one after another;
here the hotter decodes also run side by side in slots no waiting job needs (`spread`), each from the window's
one encoder pass and with a generator of its own, so the transcript is the same either way and the slowest
window of a batch no longer takes six decodes' time.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tfserve.audio.job import (Segment, Sink, TranscriptionJob, TranscriptionOptions, TranscriptionResult,
                               compression_ratio)
from tfserve.audio.segments import window_segments
from tfserve.audio.timestamps import TimestampRules
from tfserve.audio.whisper_forward import WhisperSlots
from tfserve.audio.whisper_model import HOP_LENGTH, WINDOW_FRAMES, WhisperModel
from tfserve.audio.window import Attempt, Fallback, Window, hotter, sample
from tfserve.engine.threads import WorkThread, run_in_fresh_thread

logger = logging.getLogger("tfserve.audio")


@dataclass(slots=True)
class TranscriberStats:
    """Counters for /metrics."""

    num_jobs: int = 0
    num_windows: int = 0  # encoder passes, one per window (fallbacks reuse theirs)
    num_steps: int = 0  # decoder steps
    num_tokens: int = 0  # sampled
    num_cut: int = 0  # hotter decodes stopped early: whatever came next, they could not change the transcript
    audio_seconds: float = 0.0  # of finished jobs


class Transcriber:
    """Batches the transcriptions of one Whisper model on a thread of its own (`start`/`submit`/`stop`)."""

    def __init__(self, whisper: WhisperModel, max_num_windows: int = 8, cpu_kernels: bool | None = None) -> None:
        self.whisper = whisper
        self.tokens = whisper.tokens
        if cpu_kernels is None:  # as the chat engine: on unless TFSERVE_CPU_KERNELS=0
            cpu_kernels = os.environ.get("TFSERVE_CPU_KERNELS", "1") != "0"
        ops = None
        if cpu_kernels and whisper.model.device.type == "cpu":
            from tfserve.engine.kernels import cpu_ops

            ops = cpu_ops()  # None where they cannot be built (logged): the torch path
        # torch work off the thread that steps runs on a thread that ends (`tfserve.engine.threads`)
        self.slots, self.rules = run_in_fresh_thread(lambda: (
            WhisperSlots(whisper.model, max_num_windows, ops),
            TimestampRules(self.tokens, whisper.model.config.vocab_size)))
        self.max_sample_len = self.tokens.max_len // 2  # tokens sampled in one window, at most
        self.windows: list[Window] = []  # in flight; windows[i] is in slot i
        self.waiting: deque[TranscriptionJob] = deque()  # jobs whose next window is not in flight
        self.stats = TranscriberStats()
        self._lock = threading.Lock()  # guards `waiting`, which submit() appends to from other threads
        self._worker = WorkThread(f"tfserve-whisper-{whisper.name}", self.step, self._has_work,
                                  on_stop=self._fail_all)

    # -- the thread ---------------------------------------------------------------------------------------

    def start(self) -> Transcriber:
        self._worker.start()
        return self

    def stop(self) -> None:
        self._worker.stop()

    def _fail_all(self) -> None:
        for job in [w.job for w in self.windows] + list(self.waiting):
            job.sink("error", RuntimeError("the transcriber stopped"))
        self.windows, self.waiting = [], deque()

    def make_job(self, audio, options: TranscriptionOptions, sink: Sink) -> TranscriptionJob:
        """A job for `audio` (float32 mono 16 kHz); its features are computed on the transcriber's thread, when
        its first window is admitted (torch work stays on the threads that step: `tfserve.engine.threads`)."""
        prompt = self.whisper.encode_text(" " + options.prompt.strip()) if options.prompt else []
        return TranscriptionJob(audio=audio, num_frames=len(audio) // HOP_LENGTH, options=options, sink=sink,
                                prompt_tokens=prompt)

    def submit(self, job: TranscriptionJob) -> None:
        """Queue `job`; its sink hears of it from the transcriber's thread."""
        if not self._worker.is_running:
            raise RuntimeError("the transcriber has stopped")
        with self._lock:
            self.stats.num_jobs += 1
            self.waiting.append(job)
        self._worker.wake()

    def transcribe(self, audio, options: TranscriptionOptions | None = None,
                   on_segments: Callable[[TranscriptionJob, list[Segment]], None] | None = None) -> TranscriptionResult:
        """Transcribe `audio` (float32 mono 16 kHz) and wait for it, from any thread but the transcriber's own.
        `on_segments(job, segments)` hears of each window's segments as they come (`job.seek` tells how far)."""
        events: queue.Queue = queue.Queue()
        job = self.make_job(audio, options or TranscriptionOptions(), lambda kind, payload: events.put((kind, payload)))
        self.submit(job)
        try:
            while True:
                kind, payload = events.get()
                if kind == "segments" and on_segments is not None:
                    on_segments(job, payload)
                elif kind == "done":
                    return payload
                elif kind == "error":
                    raise payload
        finally:
            job.abort()  # a no-op once done; an interrupted caller frees its slot

    @property
    def num_running(self) -> int:
        return len(self.windows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _has_work(self) -> bool:
        return bool(self.windows or self.waiting)

    # -- one step -----------------------------------------------------------------------------------------

    def step(self) -> None:
        """Admit windows into free slots, run one decoder step, finish the windows that ended."""
        try:
            self._drop_aborted()
            self.admit()
            self.spread()
            if self.windows:
                ended = self.decode()
                self.finish(ended)
        except Exception as exc:  # the model failed: these jobs end with the error, the next ones go on
            logger.exception("transcription step failed")
            for job in {w.job for w in self.windows}:
                job.sink("error", exc)
            self.windows = []

    def _drop_aborted(self) -> None:
        with self._lock:
            self.waiting = deque(job for job in self.waiting if not job.aborted.is_set())
        for window in [w for w in self.windows if w.job.aborted.is_set()]:
            self._free(window)

    def admit(self) -> None:
        """Start the next window of waiting jobs while slots are free (taking back those of hotter decodes run
        ahead: `spread`); their encoder passes run in the same step."""
        self._make_room()
        new: list[Window] = []
        while len(self.windows) < self.slots.num_slots:
            with self._lock:
                if not self.waiting:
                    break
                job = self.waiting.popleft()
            try:
                if job.features is None:
                    job.features, job.audio = self.whisper.features(job.audio), None
                window = self._window(job)
            except Exception as exc:  # this job ends with the error; the others go on
                self._fail(job, exc)
                continue
            self.windows.append(window)
            new.append(window)
        if not new:
            return
        first = len(self.windows) - len(new)
        features = torch.stack([w.job.features[:, w.seek:w.seek + WINDOW_FRAMES] for w in new])
        self.slots.encode(list(range(first, len(self.windows))), features)
        self.stats.num_windows += len(new)

    def _make_room(self) -> None:
        """Free the slots of hotter decodes run ahead of their turn (`spread`), the hottest first, while jobs wait
        for a slot: a decode that may not be needed never holds up one that is."""
        with self._lock:
            wanted = len(self.waiting)
        while wanted > self.slots.num_slots - len(self.windows):
            ahead = [w for group in self._fallbacks() for w in group.ahead()]
            if not ahead:
                return
            window = max(ahead, key=lambda w: w.temperature)
            window.fallback.give_back(window)
            self._free(window)

    def _fallbacks(self) -> list[Fallback]:
        """The windows' fallbacks under way, oldest first."""
        return list(dict.fromkeys(w.fallback for w in self.windows if w.fallback is not None))

    def spread(self) -> None:
        """Start the hotter decodes of failed windows in the slots left free once every waiting job has one (the
        oldest window's first): each copies its window's encoder output, not another encoder pass."""
        for group in self._fallbacks():
            while len(self.windows) < self.slots.num_slots and (temperature := group.take()) is not None:
                source = group.windows[0]
                window = self._window(source.job, temperature)
                window.fallback = group
                self.windows.append(window)
                group.windows.append(window)
                self.slots.copy_encoding(self.windows.index(source), len(self.windows) - 1)

    def _window(self, job: TranscriptionJob, temperature: float | None = None) -> Window:
        tokens, options = self.tokens, job.options
        if temperature is None:
            temperature = options.temperature
        previous = job.prompt_tokens + job.all_tokens[job.prompt_reset_since:] \
            if options.condition_on_previous_text else job.prompt_tokens[:]
        previous = previous[-(self.max_sample_len - 1):]
        prompt = [tokens.sot_prev] + previous if previous else []
        sot_index = len(prompt)
        language = job.language or options.language
        detect = tokens.multilingual and language is None
        prompt += [tokens.sot] if detect else tokens.sot_sequence(language, options.task)
        job.num_windows += 1
        return Window(job, job.seek, min(WINDOW_FRAMES, job.num_frames - job.seek), prompt, temperature,
                      pending=list(prompt), sot_index=sot_index, detect_language=detect)

    @torch.inference_mode()  # the rules mask the step's logits (inference tensors) in place
    def decode(self) -> list[Window]:
        """One decoder step for every window in flight; returns those that ended."""
        windows = self.windows
        logits, sot_logits = self.slots.decode([w.pending for w in windows], [w.position for w in windows],
                                               [w.sot_index for w in windows])
        self.stats.num_steps += 1
        for b, window in enumerate(windows):
            window.position += len(window.pending)
            if window.sot_index >= 0:
                window.no_speech_prob = sot_logits[b].softmax(-1)[self.tokens.no_speech].item()
                window.sot_index = -1
        sampling: list[int] = []
        broken = torch.isnan(logits.sum(dim=-1)).tolist()  # a NaN anywhere in a row (20x cheaper than isnan.any)
        for b, window in enumerate(windows):
            if broken[b]:  # this window's job ends (its slot is freed next step); the others' rows are theirs
                if not window.job.aborted.is_set():
                    self._fail(window.job, RuntimeError("the model's output for this audio is not a number"))
            elif window.detect_language:
                self._pick_language(window, logits[b])
            else:
                sampling.append(b)
        ended = []
        if not sampling:
            return ended
        rows = logits if len(sampling) == len(windows) else logits[sampling]  # (rules mask in place: ours)
        logprobs = self.rules.apply(rows, [windows[b].sampled for b in sampling])
        chosen = sample(rows, [windows[b] for b in sampling])
        for i, b in enumerate(sampling):
            window, token = windows[b], int(chosen[i])
            window.sampled.append(token)
            window.logprobs.append(float(logprobs[i, token]))
            window.sum_logprob += window.logprobs[-1]
            window.pending = [token]
            self.stats.num_tokens += 1
            if (token == self.tokens.eot or len(window.sampled) >= self.max_sample_len
                    or window.position + 1 >= self.tokens.max_len):
                ended.append(window)
            elif window.fallback is not None and window.fallback.hopeless(window, self.max_sample_len):
                ended.append(window)  # judged as it stands: it can neither pass nor be the likeliest
                self.stats.num_cut += 1
        return ended

    def _pick_language(self, window: Window, logits: torch.Tensor) -> None:
        codes = list(self.tokens.languages)
        ids = torch.tensor([self.tokens.languages[c] for c in codes])
        language = codes[int(logits[ids].argmax())]
        window.job.language = language
        window.detect_language = False
        window.pending = self.tokens.sot_sequence(language, window.job.options.task)[1:]
        window.prompt += window.pending

    def finish(self, ended: list[Window]) -> None:
        """Judge each ended window: decode it again hotter, skip it as silence, or take its segments."""
        for window in ended:
            if window not in self.windows:  # a hotter decode freed as a cooler one of its window was taken
                continue
            try:
                self._finish(window)
            except Exception as exc:  # this job ends with the error (its slot is freed next step); the others go on
                self._fail(window.job, exc)

    def _fail(self, job: TranscriptionJob, exc: Exception) -> None:
        logger.exception("transcription job %d failed", job.id)
        job.abort()
        job.sink("error", exc)

    def _finish(self, window: Window) -> None:
        job = window.job
        attempt = self._attempt(window)
        group = window.fallback
        if group is not None:
            group.attempts[window.temperature] = attempt
        elif not attempt.accepted and job.options.temperature == 0 and window.temperature < 1.0 - 1e-6:
            group = window.fallback = Fallback(attempt, hotter(window.temperature), windows=[window])
        if group is not None:
            chosen = group.decide()
            if chosen is None:  # a cooler temperature is still decoding: this slot decodes the next, or frees
                temperature = group.take()
                if temperature is not None:  # the same window again, keeping its encoder output
                    self._restart(window, temperature)
                else:
                    group.windows.remove(window)
                    self._free(window)
                return
            for other in group.windows:  # hotter decodes no longer needed
                if other is not window:
                    self._free(other)
            attempt = chosen  # its words are timed in this window's slot: every slot of the group holds the same
        if attempt.silent or not any(t < self.tokens.eot for t in attempt.tokens):
            job.seek += window.num_frames
            new = []
        else:
            new = self._segments(window, attempt)
        if new:
            job.sink("segments", new)
        self._free(window)
        if job.done:
            self._complete(job)
        else:
            with self._lock:
                self.waiting.appendleft(job)  # a job under way goes before new ones

    def _attempt(self, window: Window) -> Attempt:
        tokens = window.sampled[:-1] if window.sampled[-1] == self.tokens.eot else window.sampled
        text = self.whisper.decode_text(tokens)
        return Attempt(tokens, window.logprobs[:len(tokens)], window.temperature,
                       window.sum_logprob / (len(window.sampled) + 1), compression_ratio(text), window.no_speech_prob)

    def _segments(self, window: Window, attempt: Attempt) -> list[Segment]:
        slot = self.windows.index(window)  # still holding the window's encoder output, for its words' times
        return window_segments(self.whisper, window, attempt,
                               lambda ids: self.slots.alignment(slot, ids, self.whisper.alignment_heads))

    def _restart(self, window: Window, temperature: float) -> None:
        fresh = self._window(window.job, temperature)
        window.prompt, window.pending, window.temperature = fresh.prompt, list(fresh.prompt), temperature
        window.position, window.sampled, window.logprobs, window.sum_logprob = 0, [], [], 0.0
        window.sot_index, window.detect_language, window.generator = fresh.sot_index, fresh.detect_language, None

    def _free(self, window: Window) -> None:
        """Free `window`'s slot, moving the last window into it so the slots stay dense."""
        index = self.windows.index(window)
        last = len(self.windows) - 1
        if index != last:
            self.slots.move(last, index)
            self.windows[index] = self.windows[last]
        self.windows.pop()

    def _complete(self, job: TranscriptionJob) -> None:
        text = "".join(s.text for s in job.segments).strip()
        self.stats.audio_seconds += job.duration_s
        job.sink("done", TranscriptionResult(text=text, segments=job.segments,
                                             language=job.language_code,
                                             duration_s=job.duration_s, num_windows=job.num_windows))
