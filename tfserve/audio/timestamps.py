"""Whisper's timestamp grammar, as openai-whisper decodes: what may be sampled next in a window, and how a
decoded window splits into segments and tells where the next window starts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tfserve.audio.whisper_model import FRAMES_PER_SECOND, TIME_PRECISION, WhisperTokens

NEG_INF = float("-inf")


class TimestampRules:
    """Masks a batch of logits so every window decodes as `<|t0|> text <|t1|><|t1|> text <|t2|> ... <|eot|>`."""

    def __init__(self, tokens: WhisperTokens, vocab_size: int) -> None:
        self.tokens = tokens
        suppress = torch.zeros(vocab_size, dtype=torch.bool)
        suppress[[t for t in tokens.suppress if t < vocab_size]] = True
        suppress[tokens.eot + 1:tokens.timestamp_begin] = True  # every special token but the end of text
        self.suppress = suppress.nonzero()[:, 0]  # as indices: index_fill_ is ~4x faster than a boolean mask
        self.begin_suppress = [t for t in tokens.begin_suppress if t < vocab_size]

    def apply(self, logits: torch.Tensor, sampled: list[list[int]]) -> torch.Tensor:
        """Mask `logits` [B, vocab] in place, row b having sampled `sampled[b]` so far in its window; returns the
        masked logits' log-probabilities."""
        ts, eot = self.tokens.timestamp_begin, self.tokens.eot
        logits.index_fill_(1, self.suppress, NEG_INF)
        for b, row in enumerate(sampled):
            if not row:  # a window starts with a timestamp, at most max_initial_timestamp
                logits[b, self.begin_suppress] = NEG_INF
                logits[b, :ts] = NEG_INF
                logits[b, ts + self.tokens.max_initial_timestamp_index + 1:] = NEG_INF
                continue
            last_was_timestamp = row[-1] >= ts
            penultimate_was_timestamp = len(row) < 2 or row[-2] >= ts
            if last_was_timestamp:
                if penultimate_was_timestamp:  # a pair closed a segment: text (or the end) comes next
                    logits[b, ts:] = NEG_INF
                else:  # a segment's end: its pair, or the end of text
                    logits[b, :eot] = NEG_INF
            last = next((t for t in reversed(row) if t >= ts), None)
            if last is not None:  # timestamps never go back, and a segment is never empty
                limit = last if last_was_timestamp and not penultimate_was_timestamp else last + 1
                logits[b, ts:limit] = NEG_INF
        # a timestamp when the timestamps together are likelier than any one text token
        logprobs = torch.log_softmax(logits, dim=-1)
        force = logprobs[:, ts:].logsumexp(dim=-1) > logprobs[:, :ts].amax(dim=-1)  # amax: 9x max().values
        if force.any():
            logits[force, :ts] = NEG_INF
            logprobs[force] = torch.log_softmax(logits[force], dim=-1)
        return logprobs


@dataclass(slots=True)
class RawSegment:
    """A segment of one window: its times in seconds from the window's start and its tokens (with timestamps)."""

    start: float
    end: float
    tokens: list[int]
    first: int = 0  # where `tokens` start in the window's tokens


def ends_with_single_timestamp(tokens: list[int], timestamp_begin: int) -> bool:
    """The window's text ends with one timestamp, not a pair: nothing more is said in it."""
    return len(tokens) >= 2 and tokens[-2] < timestamp_begin <= tokens[-1]


def split_window(tokens: list[int], num_frames: int, timestamp_begin: int) -> tuple[list[RawSegment], int]:
    """Segments of a decoded window (its sampled tokens without the end of text) and how many mel frames the next
    window starts after this one's start. `num_frames` is the window's length in frames (<= 3000)."""
    is_ts = [t >= timestamp_begin for t in tokens]
    single_timestamp_ending = ends_with_single_timestamp(tokens, timestamp_begin)
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]  # between the pair
    segments = []
    if cuts:
        if single_timestamp_ending:
            cuts.append(len(tokens))
        last = 0
        for cut in cuts:
            piece = tokens[last:cut]
            segments.append(RawSegment((piece[0] - timestamp_begin) * TIME_PRECISION,
                                       (piece[-1] - timestamp_begin) * TIME_PRECISION, piece, last))
            last = cut
        if single_timestamp_ending:  # nothing is said after the last timestamp
            return segments, num_frames
        # the last segment did not end in this window: the next window starts where it began
        return segments, (tokens[last - 1] - timestamp_begin) * round(TIME_PRECISION * FRAMES_PER_SECOND)
    duration = num_frames / FRAMES_PER_SECOND
    stamps = [t for t in tokens if t >= timestamp_begin]
    if stamps and stamps[-1] != timestamp_begin:
        duration = (stamps[-1] - timestamp_begin) * TIME_PRECISION
    start = (stamps[0] - timestamp_begin) * TIME_PRECISION if stamps else 0.0
    if any(t < timestamp_begin for t in tokens):
        segments.append(RawSegment(min(start, duration), duration, tokens))
    return segments, num_frames

