"""A decoded window -> its segments: split at its timestamps, each with its text, timing and confidence, its words
timed where the job asks for them; and where the job's next window starts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tfserve.audio.job import Segment, Word
from tfserve.audio.timestamps import ends_with_single_timestamp, split_window
from tfserve.audio.whisper_model import FRAMES_PER_SECOND, WhisperModel
from tfserve.audio.window import Attempt, Window
from tfserve.audio.words import word_times

Alignment = Callable[[list[int]], torch.Tensor]  # token ids -> their cross-attention scores over the window's audio


def window_segments(whisper: WhisperModel, window: Window, attempt: Attempt, alignment: Alignment) -> list[Segment]:
    """The segments of `window`'s accepted `attempt`, added to its job (text, timing and confidence, words when
    asked for: `alignment` scores the window's tokens against its audio); the job's seek moves to where its next
    window starts."""
    job, tokens = window.job, whisper.tokens
    raw, advance = split_window(attempt.tokens, window.num_frames, tokens.timestamp_begin)
    offset = window.seek / FRAMES_PER_SECOND
    new = []
    for piece in raw:
        text = whisper.decode_text(piece.tokens)
        if not text.strip():
            continue
        # the segment's own tokens (timestamps included), not the window's: segments differ in confidence
        logprobs = attempt.logprobs[piece.first:piece.first + len(piece.tokens)]
        new.append(Segment(id=len(job.segments), seek=window.seek, start=round(offset + piece.start, 2),
                           end=round(min(offset + piece.end, job.duration_s), 2), text=text, tokens=piece.tokens,
                           temperature=attempt.temperature, avg_logprob=sum(logprobs) / len(logprobs),
                           compression_ratio=attempt.compression_ratio, no_speech_prob=attempt.no_speech_prob))
        job.segments.append(new[-1])
        job.all_tokens += piece.tokens
    if new and job.options.word_timestamps:
        _time_words(whisper, window, new, alignment)
        # as openai-whisper: unless the window's text ended, the next one starts at the last word's end (not
        # at the last timestamp, which can be before it: the words of both windows would overlap)
        last_end = next((w.end for segment in reversed(new) for w in reversed(segment.words)), None)
        if (not ends_with_single_timestamp(attempt.tokens, tokens.timestamp_begin)
                and last_end is not None and last_end > offset):
            advance = round(last_end * FRAMES_PER_SECOND) - window.seek
    if attempt.temperature > 0.5:  # a hot decode is not worth conditioning on
        job.prompt_reset_since = len(job.all_tokens)
    job.seek += max(advance, 1)
    return new


def _time_words(whisper: WhisperModel, window: Window, segments: list[Segment], alignment: Alignment) -> None:
    """Give each of `segments` (just decoded in `window`, whose slot still holds its encoder output) its words."""
    job, tokens = window.job, whisper.tokens
    eot = tokens.eot
    texts = [[t for t in s.tokens if t < eot] for s in segments]
    text_tokens = [t for text in texts for t in text]
    language = job.language_code
    prompt = tokens.sot_sequence(language, job.options.task) + [tokens.no_timestamps]
    scores = alignment(prompt + text_tokens + [eot])
    timed = word_times(scores, text_tokens, window.num_frames, whisper.decode_text, language)
    offset = window.seek / FRAMES_PER_SECOND
    words = iter(timed)
    for segment, text in zip(segments, texts):
        segment.words, remaining = [], len(text)  # a segment takes words until its tokens are used
        while remaining > 0 and (word := next(words, None)) is not None:
            text_word, start, end, num_tokens = word
            segment.words.append(Word(text_word.strip(), round(min(offset + start, job.duration_s), 2),
                                      round(min(offset + end, job.duration_s), 2)))
            remaining -= num_tokens
