"""Speech benchmark: audio files transcribed at a given concurrency, in-process (tfserve's transcriber, or
transformers' own ASR pipeline for comparison) or against any OpenAI-compatible /v1/audio/transcriptions.
Reported as wall time, real-time factor (seconds of compute per second of audio) and request latencies."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tfserve.bench.metrics import latency_summary

SAMPLE_RATE = 16000


@dataclass(slots=True)
class AudioRecord:
    """One transcription: whether it succeeded, its audio length, its latency, its text."""

    ok: bool
    audio_s: float
    latency_s: float = 0.0
    text: str = ""
    error: str | None = None


def clips(audio: list[np.ndarray], num_requests: int, clip_seconds: float | None) -> list[np.ndarray]:
    """`num_requests` clips taken in turn from `audio`; with `clip_seconds`, each is that long (the files played
    one after another, from a different start for each clip)."""
    if clip_seconds is None:
        return [audio[i % len(audio)] for i in range(num_requests)]
    stream = np.concatenate(audio)
    length = int(clip_seconds * SAMPLE_RATE)
    repeats = int(np.ceil((length + len(stream)) / len(stream))) + 1
    looped = np.tile(stream, repeats)
    step = max(len(stream) // max(num_requests, 1), 1)
    return [looped[i * step:i * step + length] for i in range(num_requests)]


def run_offline(transcribe: Callable[[np.ndarray], str], inputs: list[np.ndarray], concurrency: int,
                on_done: Callable[[AudioRecord], None] | None = None) -> tuple[list[AudioRecord], float]:
    """Call `transcribe` on every input from `concurrency` threads; the records (in input order) and wall time."""
    records: list[AudioRecord | None] = [None] * len(inputs)
    next_index = iter(range(len(inputs)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            audio = inputs[index]
            start = time.perf_counter()
            try:
                text = transcribe(audio)
                record = AudioRecord(True, len(audio) / SAMPLE_RATE, time.perf_counter() - start, text)
            except Exception as exc:  # a failed request is a record, not the end of the run
                record = AudioRecord(False, len(audio) / SAMPLE_RATE, time.perf_counter() - start,
                                     error=f"{type(exc).__name__}: {exc}")
            records[index] = record
            if on_done is not None:
                on_done(record)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(inputs)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return records, time.perf_counter() - start


async def run_online(base_url: str, model: str, inputs: list[np.ndarray], concurrency: int, api_key: str = "EMPTY",
                     on_done: Callable[[AudioRecord], None] | None = None) -> tuple[list[AudioRecord], float]:
    """POST every input (as a WAV file) to `base_url`/audio/transcriptions, `concurrency` at a time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)
    limit = asyncio.Semaphore(concurrency)

    async def one(audio: np.ndarray) -> AudioRecord:
        async with limit:
            start = time.perf_counter()
            try:
                result = await client.audio.transcriptions.create(model=model, file=("clip.wav", to_wav(audio)))
                record = AudioRecord(True, len(audio) / SAMPLE_RATE, time.perf_counter() - start, result.text)
            except openai.OpenAIError as exc:
                record = AudioRecord(False, len(audio) / SAMPLE_RATE, time.perf_counter() - start, error=str(exc))
        if on_done is not None:
            on_done(record)
        return record

    start = time.perf_counter()
    records = await asyncio.gather(*(one(audio) for audio in inputs))
    await client.close()
    return list(records), time.perf_counter() - start


def transformers_pipeline(whisper) -> Callable[[np.ndarray], str]:
    """transformers' own `pipeline("automatic-speech-recognition")` over the same loaded model (a
    `WhisperModel`: same weights, device and dtype as tfserve's), long audio in 30 s chunks: the baseline."""
    from transformers import pipeline

    asr = pipeline("automatic-speech-recognition", model=whisper.model, tokenizer=whisper.processor.tokenizer,
                   feature_extractor=whisper.processor.feature_extractor, device=whisper.device, chunk_length_s=30)
    lock = threading.Lock()  # the pipeline is not made for concurrent calls: they take turns

    def transcribe(audio: np.ndarray) -> str:
        with lock:
            return asr({"raw": audio, "sampling_rate": SAMPLE_RATE})["text"]

    return transcribe


def summarize(records: list[AudioRecord], wall_s: float) -> dict:
    """The run's figures: audio seconds, wall time, real-time factor, latencies (ms)."""
    done = [r for r in records if r.ok]
    audio_s = sum(r.audio_s for r in done)
    return {"num_requests": len(records), "num_failed": len(records) - len(done), "audio_s": round(audio_s, 2),
            "wall_s": round(wall_s, 3), "rtf": round(wall_s / audio_s, 4) if audio_s else None,
            "x_realtime": round(audio_s / wall_s, 2) if wall_s else None,
            "latency_ms": latency_summary([r.latency_s for r in done]),
            "errors": sorted({r.error for r in records if r.error})[:5]}


def to_wav(audio: np.ndarray) -> bytes:
    """16-bit PCM WAV bytes of float32 mono 16 kHz samples."""
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes((np.clip(audio, -1, 1) * 32767).astype(np.int16).tobytes())
    return buffer.getvalue()
