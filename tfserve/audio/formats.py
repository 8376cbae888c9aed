"""A finished transcription in each of OpenAI's response formats: json, text, srt, vtt, verbose_json."""

from __future__ import annotations

from typing import Any

from tfserve.audio.job import Segment, TranscriptionResult

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
CONTENT_TYPES = {"json": "application/json", "verbose_json": "application/json", "text": "text/plain",
                 "srt": "application/x-subrip", "vtt": "text/vtt"}


def language_name(code: str) -> str:
    """"en" -> "english", as OpenAI's verbose_json names languages."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES.get(code, code)


def usage(result: TranscriptionResult) -> dict[str, Any]:
    """OpenAI's usage of a transcription: the seconds of audio."""
    return {"type": "duration", "seconds": round(result.duration_s, 2)}


# Whisper's encoder: 1500 positions per 30-second window, the audio's tokens as the decoder attends to them
ENCODER_POSITIONS_PER_SECOND = 50


def token_usage(result: TranscriptionResult) -> dict[str, Any]:
    """OpenAI's token usage, the only kind its SDK reads on a streamed transcription's last event: the audio as
    encoder positions (50 a second), the text as the tokens decoded."""
    audio = round(result.duration_s * ENCODER_POSITIONS_PER_SECOND)
    text = sum(len(segment.tokens) for segment in result.segments)
    return {"type": "tokens", "input_tokens": audio, "input_token_details": {"text_tokens": 0, "audio_tokens": audio},
            "output_tokens": text, "total_tokens": audio + text}


def to_json(result: TranscriptionResult, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"text": result.text}
    if usage is not None:
        body["usage"] = usage
    return body


def to_verbose_json(result: TranscriptionResult, task: str, include_words: bool = False,
                    include_segments: bool = True, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"task": task, "language": language_name(result.language),
                            "duration": round(result.duration_s, 2), "text": result.text}
    if include_segments:
        body["segments"] = [segment_json(s) for s in result.segments]
    if include_words:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end}
                         for s in result.segments for w in (s.words or ())]
    if usage is not None:
        body["usage"] = usage
    return body


def segment_json(segment: Segment) -> dict[str, Any]:
    return {"id": segment.id, "seek": segment.seek, "start": segment.start, "end": segment.end, "text": segment.text,
            "tokens": segment.tokens, "temperature": round(segment.temperature, 2),
            "avg_logprob": round(segment.avg_logprob, 4), "compression_ratio": round(segment.compression_ratio, 4),
            "no_speech_prob": round(segment.no_speech_prob, 4)}


def to_text(result: TranscriptionResult) -> str:
    return result.text + "\n"


def to_srt(segments: list[Segment], by_word: bool = False) -> str:
    """SubRip: numbered cues, `HH:MM:SS,mmm --> HH:MM:SS,mmm`; a cue per segment, or per word."""
    cues = [f"{i}\n{_clock(start, ',')} --> {_clock(end, ',')}\n{text}\n"
            for i, (start, end, text) in enumerate(_cues(segments, by_word), start=1)]
    return "\n".join(cues)


def to_vtt(segments: list[Segment], by_word: bool = False) -> str:
    """WebVTT: a header, then `HH:MM:SS.mmm --> HH:MM:SS.mmm` cues; a cue per segment, or per word."""
    cues = [f"{_clock(start, '.')} --> {_clock(end, '.')}\n{text}\n" for start, end, text in _cues(segments, by_word)]
    return "WEBVTT\n\n" + "\n".join(cues)


def _cues(segments: list[Segment], by_word: bool) -> list[tuple[float, float, str]]:
    """(start, end, text) of each segment, or with `by_word` of each timed word (whisper.cpp's `-ml 1`)."""
    if by_word:
        return [(w.start, w.end, w.word.strip()) for s in segments for w in (s.words or ())]
    return [(s.start, s.end, s.text.strip()) for s in segments]


def render(result: TranscriptionResult, response_format: str, task: str = "transcribe",
           include_words: bool = False, include_segments: bool = True,
           usage: dict[str, Any] | None = None) -> str | dict[str, Any]:
    """The body of `result` in `response_format`: a dict for the JSON formats, text for the others. With
    `include_words`, verbose_json gets a `words` list and srt and vtt a cue per word."""
    if response_format == "json":
        return to_json(result, usage)
    if response_format == "verbose_json":
        return to_verbose_json(result, task, include_words, include_segments, usage)
    if response_format == "text":
        return to_text(result)
    if response_format == "srt":
        return to_srt(result.segments, include_words)
    if response_format == "vtt":
        return to_vtt(result.segments, include_words)
    raise ValueError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}")


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"
