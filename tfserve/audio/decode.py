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
    """`data` (a whole file) -> [num_samples] float32 in [-1, 1] (a float file louder than that scaled down), mono,
    at `sample_rate`. AudioError for an empty, truncated or non-audio file, or one longer than `max_seconds`."""
    import av

    if not data:
        raise AudioError("the file is empty")
    _check_whole(data)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError) as exc:
        raise AudioError(f"not an audio file tfserve can read ({_reason(exc)})") from None
    with container:
        if not container.streams.audio:
            raise AudioError("the file has no audio stream")
        stream = container.streams.audio[0]
        resampler, source = None, None
        chunks, num_samples = [], 0
        limit = None if max_seconds is None else int(max_seconds * sample_rate)
        try:
            for frame in _frames(container, stream):
                # a resampler takes one input format; a stream may change it midway (joined files, MP3
                # frames at another rate): what the old one holds is flushed and a new one goes on
                kind = (frame.format.name, frame.layout.name, frame.sample_rate)
                if kind != source:
                    held = _flush(resampler)
                    chunks += held
                    num_samples += sum(chunk.shape[0] for chunk in held)
                    resampler, source = av.AudioResampler(format="flt", layout="mono", rate=sample_rate), kind
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    num_samples += chunks[-1].shape[0]
                if limit is not None and num_samples > limit:
                    raise AudioError(f"the audio is longer than {max_seconds:g} s (see --max-audio-seconds)")
            chunks += _flush(resampler)
        except av.error.FFmpegError as exc:
            raise AudioError(f"the audio could not be decoded ({_reason(exc)}); is the file whole?") from None
        declared = _declared_seconds(container, stream)
    held = num_samples / sample_rate
    if declared is not None and held < declared - max(0.1, 0.02 * declared):
        raise AudioError(f"the file is truncated: its header says {declared:.2f} s of audio, it holds {held:.2f} s")
    samples = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise AudioError("the file holds no audio samples (empty or truncated?)")
    if not np.isfinite(samples).all():  # a float WAV can hold NaN or infinity: every feature would be NaN
        raise AudioError("the audio holds samples that are not finite numbers (NaN or infinity)")
    peak = float(np.abs(samples).max())
    if peak > 1.0:  # a float file past full scale (its log-mel power overflows float32 from ~1e19): scaled to it
        samples = samples / np.float32(peak)
    if limit is not None and samples.shape[0] > limit:
        raise AudioError(f"the audio is longer than {max_seconds:g} s (see --max-audio-seconds)")
    return samples


def _declared_seconds(container, stream) -> float | None:
    """How long the file's headers say the audio is, where they say it (FLAC's stream info, MP4's sample tables,
    Matroska's segment duration), else None. Not an MP3's: files of frames that are often joined or cut on purpose,
    whose first Xing header (or FFmpeg's estimate from the bitrate) need not describe the whole; an MP3 is read up
    to its last whole frame, as players do."""
    if container.format.name == "mp3":
        return None
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if "matroska" in container.format.name and container.duration:
        return container.duration / 1e6
    return None


def _check_whole(data: bytes) -> None:
    """AudioError for a cut WAV or Ogg file, whose decoders read up to the cut without a word: a RIFF header states
    the file's size (0 or 0xFFFFFFFF where a stream writer could not know it), and an Ogg stream's last page is
    marked as its end and holds the bytes its header counts."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE" and len(data) >= 12:
        size = int.from_bytes(data[4:8], "little") + 8
        if size not in (8, 0xFFFFFFFF + 8) and len(data) < size:
            raise AudioError(f"the file is truncated: its header says {size} bytes, it has {len(data)}")
    elif data[:4] == b"OggS":
        pos, last_flags = 0, 0
        while pos + 27 <= len(data) and data[pos:pos + 4] == b"OggS":
            num_segments = data[pos + 26]
            end = pos + 27 + num_segments + sum(data[pos + 27:pos + 27 + num_segments])
            if pos + 27 + num_segments > len(data) or end > len(data):
                raise AudioError("the file is truncated: its last Ogg page is cut")
            last_flags, pos = data[pos + 5], end
        if pos == len(data) and not last_flags & 0x04:  # pages to the end, the last not marked end of stream
            raise AudioError("the file is truncated: its Ogg stream has no end-of-stream page")


MAX_BAD_PACKETS = 0.1  # of a stream's packets, skipped as FFmpeg's own tools skip them; more: not this audio


def _frames(container, stream):
    """The decoded frames of `stream`, packet by packet: a packet the decoder refuses (a joined file's header, a
    damaged frame) is skipped, as the ffmpeg command does, unless more than MAX_BAD_PACKETS of them are."""
    import av

    num_packets = num_bad = 0
    for packet in container.demux(stream):
        num_packets += 1
        try:
            frames = packet.decode()
        except av.error.InvalidDataError:
            num_bad += 1
            continue
        yield from frames
    if num_bad > MAX_BAD_PACKETS * num_packets:
        raise AudioError(f"the audio could not be decoded ({num_bad} of its {num_packets} packets are damaged); "
                         "is the file whole?")


def _flush(resampler) -> list[np.ndarray]:
    """What `resampler` (or None) still holds."""
    return [] if resampler is None else [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]


def _reason(exc: Exception) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text.split(":")[-1].strip() if text.startswith("[Errno") else text
