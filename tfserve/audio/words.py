"""Word timestamps, as openai-whisper finds them: the cross-attention of the alignment heads over a window's
text, normalised and median-filtered, aligned to the audio frames by dynamic time warping; a word starts where
the path reaches its first token."""

from __future__ import annotations

import string

import numpy as np
import torch

from tfserve.audio.whisper_model import TIME_PRECISION

MEDIAN_FILTER_WIDTH = 7
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
NO_SPACE_LANGUAGES = ("zh", "ja", "th", "lo", "my", "yue")


def median_filter(x: torch.Tensor, width: int = MEDIAN_FILTER_WIDTH) -> torch.Tensor:
    """Median over a sliding window of the last dimension, reflected at the edges."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    shape = x.shape
    padded = torch.nn.functional.pad(x.reshape(-1, 1, shape[-1]), (pad, pad), mode="reflect").reshape(
        *shape[:-1], shape[-1] + 2 * pad)
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `cost` [N, M] from (0, 0) to (N-1, M-1): its row and column indices.
    Each row is filled at once: a step right adds the cell's cost, so the row's totals are a running minimum
    over prefix sums."""
    num_rows, num_cols = cost.shape
    total = np.full((num_rows + 1, num_cols + 1), np.inf)
    total[0, 0] = 0.0
    trace = np.zeros((num_rows + 1, num_cols + 1), dtype=np.int8)  # 0: diagonal, 1: from above, 2: from the left
    for i in range(1, num_rows + 1):
        diagonal, above = total[i - 1, :-1], total[i - 1, 1:]
        from_above = above < diagonal
        best = np.where(from_above, above, diagonal) + cost[i - 1]  # arriving from the row above, [M]
        prefix = np.cumsum(cost[i - 1])
        running = np.minimum.accumulate(best - prefix)
        total[i, 1:] = running + prefix
        trace[i, 1:] = np.where(running < best - prefix, 2, np.where(from_above, 1, 0))
    i, j, rows, cols = num_rows, num_cols, [], []
    while i > 0 and j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    return np.array(rows[::-1]), np.array(cols[::-1])


def split_words(tokens: list[int], decode, language: str) -> tuple[list[str], list[list[int]]]:
    """`tokens` as words (each with its leading space) and the tokens of each; a character split by code point
    for languages written without spaces."""
    pieces, piece_tokens, current = [], [], []
    for token in tokens:
        current.append(token)
        text = decode(current)
        if "\ufffd" not in text:  # a whole UTF-8 character (or more)
            pieces.append(text)
            piece_tokens.append(current)
            current = []
    if language in NO_SPACE_LANGUAGES:
        return pieces, piece_tokens
    words, word_tokens = [], []
    for piece, ids in zip(pieces, piece_tokens):
        if piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(ids))
        else:
            words[-1] += piece
            word_tokens[-1].extend(ids)
    return words, word_tokens


def word_times(scores: torch.Tensor, text_tokens: list[int], num_frames: int, decode,
               language: str) -> list[tuple[str, float, float, int]]:
    """Words of a window as (word, start, end, number of tokens), in seconds from the window's start. `scores` are the alignment
    heads' cross-attention scores [heads, tokens, frames] for the tokens `[<|sot|>..., <|notimestamps|>,
    *text_tokens, <|eot|>]`; `num_frames` the window's mel frames."""
    words, word_tokens = split_words(text_tokens, decode, language)
    if not words:
        return []
    weights = scores[:, :, :max(num_frames // 2, 1)].softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / (std + 1e-9))
    # the rows that predict each text token and the end of text: <|notimestamps|> and the text
    matrix = weights.mean(dim=0)[-(len(text_tokens) + 2):-1]
    rows, cols = dtw(-matrix.double().numpy())
    jumps = np.pad(np.diff(rows), (1, 0), constant_values=1).astype(bool)
    jump_times = cols[jumps] * TIME_PRECISION
    boundaries = np.pad(np.cumsum([len(t) for t in word_tokens]), (1, 0))
    last = len(jump_times) - 1
    timed = [(word, float(jump_times[min(start, last)]), float(jump_times[min(end, last)]), int(end - start))
             for word, start, end in zip(words, boundaries[:-1], boundaries[1:])]
    return _merge_punctuation(timed)


def _merge_punctuation(words: list[tuple[str, float, float, int]]) -> list[tuple[str, float, float, int]]:
    """Opening marks join the next word, closing marks the previous one (their times are not their own)."""
    merged: list[list] = []
    carry, carry_tokens = "", 0
    for word, start, end, num_tokens in words:
        stripped = word.strip()
        if stripped and all(c in PREPEND_PUNCTUATIONS for c in stripped):
            carry, carry_tokens = carry + word, carry_tokens + num_tokens
            continue
        if merged and stripped and all(c in APPEND_PUNCTUATIONS for c in stripped):
            merged[-1][0] += word
            merged[-1][3] += num_tokens
            continue
        merged.append([carry + word, start, end, carry_tokens + num_tokens])
        carry, carry_tokens = "", 0
    return [tuple(word) for word in merged]
