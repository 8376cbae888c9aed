"""Audio bytes in any container people send (wav, flac, mp3, ogg/opus, m4a, webm...) -> mono float32 samples at
the rate a speech model takes, through PyAV (FFmpeg's demuxers, decoders and resampler). Nothing here parses a
format by hand; every failure is an `AudioError` with one readable line."""

from __future__ import annotations

import io

import numpy as np

WHISPER_SAMPLE_RATE = 16_000


class AudioError(ValueError):
    """The bytes are not audio tfserve can decode, or too long: one readable line."""


def decode_audio(data: bytes, *, sample_rate: int = WHISPER_SAMPLE_RATE, max_seconds: float | None = None
                 ) -> np.ndarray:
    """`data` (a whole file) -> [num_samples] float32 in [-1, 1], mono, at `sample_rate`. AudioError for an empty,
    truncated or non-audio file, or one longer than `max_seconds`."""
    import av

    if not data:
        raise AudioError("the file is empty")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError) as exc:
        raise AudioError(f"not an audio file tfserve can read ({_reason(exc)})") from None
    with container:
        if not container.streams.audio:
            raise AudioError("the file has no audio stream")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
        chunks, num_samples = [], 0
        limit = None if max_seconds is None else int(max_seconds * sample_rate)
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    num_samples += chunks[-1].shape[0]
                if limit is not None and num_samples > limit:
                    raise AudioError(f"the audio is longer than {max_seconds:g} s (see --max-audio-seconds)")
            for out in resampler.resample(None):  # what the resampler still holds
                chunks.append(out.to_ndarray().reshape(-1))
        except av.error.FFmpegError as exc:
            raise AudioError(f"the audio could not be decoded ({_reason(exc)}); is the file whole?") from None
    samples = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise AudioError("the file holds no audio samples (empty or truncated?)")
    if limit is not None and samples.shape[0] > limit:
        raise AudioError(f"the audio is longer than {max_seconds:g} s (see --max-audio-seconds)")
    return samples


def _reason(exc: Exception) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text.split(":")[-1].strip() if text.startswith("[Errno") else text
