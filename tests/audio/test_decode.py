"""Audio decoding through PyAV: every container people send becomes mono float32 at 16 kHz, the right length and
level; anything else is one readable AudioError."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tfserve.audio.decode import AudioError, decode_audio


def encode(container: str, codec: str, *, rate: int = 44100, seconds: float = 1.5, layout: str = "stereo",
           frequency: float = 440.0) -> bytes:
    """A tone of `seconds` encoded with PyAV's own encoders (no files, no network)."""
    import av

    tone = (0.5 * np.sin(2 * np.pi * frequency * np.arange(int(rate * seconds)) / rate)).astype(np.float32)
    channels = 2 if layout == "stereo" else 1
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=rate, layout=layout)
        wanted = stream.codec_context.codec.audio_formats[0].name
        frame_size = stream.codec_context.frame_size or 1024
        resampler = av.AudioResampler(format=wanted, layout=layout, rate=rate)
        for start in range(0, tone.shape[0], frame_size):
            frame = av.AudioFrame.from_ndarray(np.stack([tone[start:start + frame_size]] * channels), format="fltp",
                                               layout=layout)
            frame.sample_rate = rate
            for resampled in resampler.resample(frame):
                for packet in stream.encode(resampled):
                    output.mux(packet)
        for packet in stream.encode(None):
            output.mux(packet)
    return buffer.getvalue()


@pytest.mark.parametrize("container, codec, rate", [
    ("wav", "pcm_s16le", 44100), ("flac", "flac", 22050), ("mp3", "libmp3lame", 44100), ("ogg", "libopus", 48000),
    ("webm", "libopus", 48000), ("ipod", "aac", 44100),  # ipod: an .m4a
])
def test_each_container_decodes_to_16khz_mono(container, codec, rate):
    samples = decode_audio(encode(container, codec, rate=rate))
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(samples.shape[0] - 24000) <= 800  # 1.5 s (AAC adds its priming samples)
    assert 0.3 < float(np.abs(samples).max()) <= 1.0
    spectrum = np.abs(np.fft.rfft(samples[4000:20000]))
    assert abs(np.argmax(spectrum) - 440) < 5  # 16000 samples at 16 kHz: 1 Hz a bin; the tone survives


def test_mono_input_and_another_rate():
    samples = decode_audio(encode("wav", "pcm_s16le", rate=8000, layout="mono"), sample_rate=8000)
    assert samples.shape == (12000,) and abs(float(np.abs(samples).max()) - 0.5) < 0.01


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"this is not audio at all", "not an audio file"),
    (b"RIFF\x00\x00\x00\x00WAVEfmt ", "not an audio file"),
])
def test_not_audio_is_one_line(data, message):
    with pytest.raises(AudioError, match=message):
        decode_audio(data)


@pytest.mark.parametrize("container, codec", [("wav", "pcm_s16le"), ("flac", "flac"), ("ogg", "libopus"),
                                             ("webm", "libopus"), ("ipod", "aac")])
@pytest.mark.parametrize("kept", [0.9, 0.5])
def test_a_cut_file_is_an_error_not_its_first_part(container, codec, kept):
    """Decoders read a cut file up to the cut without a word: the headers' sizes and durations (and an Ogg
    stream's end-of-stream page) tell that the rest is missing. (Not MP3: frames joined or cut on purpose, read to
    the last whole one, as players do.)"""
    whole = encode(container, codec, seconds=2.0, rate=48000 if codec == "libopus" else 44100)
    assert decode_audio(whole).shape[0] >= 31000
    with pytest.raises(AudioError, match="truncated|could not be decoded|not an audio file"):
        decode_audio(whole[: int(len(whole) * kept)])


def test_an_ogg_file_cut_between_pages_and_a_wav_of_unknown_size():
    whole = encode("ogg", "libopus", seconds=2.0, rate=48000)
    last_page = whole.rindex(b"OggS")  # the cut leaves whole pages, the last one not the end of the stream
    with pytest.raises(AudioError, match="no end-of-stream page"):
        decode_audio(whole[:last_page])
    wav = encode("wav", "pcm_s16le", seconds=1.0)
    streamed = wav[:4] + b"\xff\xff\xff\xff" + wav[8:]  # what a writer that could not seek back leaves
    assert decode_audio(streamed).shape[0] == 16000


def test_longer_than_the_limit():
    with pytest.raises(AudioError, match="longer than 1 s"):
        decode_audio(encode("wav", "pcm_s16le", seconds=1.5), max_seconds=1)
    assert decode_audio(encode("wav", "pcm_s16le", seconds=1.5), max_seconds=2).shape[0] == 24000


def test_a_stream_that_changes_rate_and_layout_midway_decodes_whole():
    """Two MP3 files joined (44.1 kHz stereo, then 16 kHz mono): FFmpeg's decoder changes its frames' format
    midway, which one resampler cannot take."""
    first = encode("mp3", "libmp3lame", rate=44100, seconds=1.0)
    second = encode("mp3", "libmp3lame", rate=16000, seconds=1.0, layout="mono", frequency=880.0)
    samples = decode_audio(first + second)
    assert abs(samples.shape[0] - 32000) <= 2000  # both seconds (MP3 adds its padding)
    spectrum = np.abs(np.fft.rfft(samples[-12000:-2000]))
    assert abs(np.argmax(spectrum) * 16000 / 10000 - 880) < 10  # the second file's tone, resampled right


def float_wav(samples: np.ndarray) -> bytes:
    """A float32 WAV (format 3) of `samples` at 16 kHz: a format whose samples may lie past full scale."""
    import struct

    data = samples.astype("<f4").tobytes()
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 3, 1, 16000, 64000, 4, 32) + b"data" + struct.pack("<I", len(data)) + data)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_samples_that_are_not_numbers_are_one_line(value):
    with pytest.raises(AudioError, match="not finite"):
        decode_audio(float_wav(np.full(16000, value)))


def test_samples_past_full_scale_are_scaled_to_it():
    tone = np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    samples = decode_audio(float_wav(1e30 * tone))
    assert np.isfinite(samples).all() and abs(float(np.abs(samples).max()) - 1.0) < 1e-6
    assert np.allclose(samples, tone, atol=1e-5)
    quiet = decode_audio(float_wav(0.5 * tone))  # within full scale: as it is
    assert np.allclose(quiet, 0.5 * tone, atol=1e-6)
