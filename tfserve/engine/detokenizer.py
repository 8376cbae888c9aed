"""Incremental detokenization: a request's generated token ids become text a few tokens at a time.

Two problems make "decode the new token and append it" wrong:
- byte-level BPE splits multibyte characters across tokens, so one token alone may decode to half a
  character (rendered "\ufffd");
- sentencepiece-style decoders render a token differently by position (the first "▁word" loses its space).

So we use the prefix/read-offset window of vLLM and TGI: decode `tokens[prefix_offset:]` and
`tokens[prefix_offset:read_offset]`, and emit the difference, but only once it does not end in "\ufffd".
Both offsets sit on character boundaries and the window stays a few tokens long, so each step costs O(1)
decode work however long the output grows.

The window starts empty rather than seeded with prompt tokens: seeding makes a llama/Metaspace tokenizer
render the first generated "▁Hello" as " Hello", while `tokenizer.decode(generated_ids)` renders "Hello".
Starting at the first generated token keeps the streamed text equal to that HF decode.

Stop strings are matched on the text itself, across token boundaries. A stream never emits characters that
a later stop match would cut: the longest tail that could still begin a stop string is held back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_INCOMPLETE_CHAR = "\ufffd"
_MAX_TOKEN_ID = 2**32 - 1  # the Rust tokenizers take u32 ids; anything outside would raise


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, a few tokens at a time."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        # Kept for callers and debugging; deliberately not decode context (see the module docstring).
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)  # an empty stop string would match before any text
        self.include_stop_str_in_output = include_stop_str_in_output
        # vLLM's min_tokens: no stop string may end in the text of the first min_tokens tokens
        self.min_tokens = min_tokens if self.stop else 0
        self._min_text_end: int | None = 0 if not self.min_tokens else None  # chars of that text; None: not known yet
        self._num_chars = 0  # chars passed through the stop check (emitted, held, or cut)
        self.token_ids: list[int] = []  # generated ids, unknown/out-of-range ones dropped
        self.prefix_offset = 0  # window start: context that makes the next tokens render right
        self.read_offset = 0  # tokens before this are already turned into text
        self._prefix_text: str | None = ""  # decode(token_ids[prefix_offset:read_offset]); None = stale
        self._held_text = ""  # decoded text held back because it may begin a stop string
        self._emitted_chunks: list[str] = []
        self._matched_stop: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far (after the stop-string cut)."""
        if len(self._emitted_chunks) > 1:
            self._emitted_chunks = ["".join(self._emitted_chunks)]
        return self._emitted_chunks[0] if self._emitted_chunks else ""

    @property
    def holds_text(self) -> bool:
        """Some tokens' text is not emitted yet: a possible stop string's start, or half a character."""
        return bool(self._held_text) or self.read_offset < len(self.token_ids)

    def num_tokens_of_text(self) -> int:
        """How many of the generated tokens give the text emitted: the fewest whose decode covers it (after a stop
        string cut the text, the tokens of the stop string and past it give none of it)."""
        text = self.text
        lo, hi = 0, len(self.token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._decode(self.token_ids[:mid]).startswith(text):  # (half a character is not the character)
                hi = mid
            else:
                lo = mid + 1
        return lo

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._matched_stop

    @property
    def finished(self) -> bool:
        """True after a stop string matched or `flush` ran; later steps are ignored."""
        return self._finished

    def step(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Add new tokens; return (text delta safe to emit now, the stop string matched or None)."""
        if self._finished:
            return "", None
        self.token_ids.extend(i for i in new_token_ids if 0 <= i <= _MAX_TOKEN_ID)
        new_text = self._decode_new_text(final=False)
        if not new_text:
            return "", None
        delta = self._apply_stop(new_text, final=False)
        return delta, self._matched_stop

    def flush(self) -> str:
        """At finish (length/EOS): return whatever text was held back.

        That is an unfinished trailing character (rendered "\ufffd", as `tokenizer.decode` renders it) and
        the tail held back for stop strings. A stop string completed by that text still cuts it.
        """
        if self._finished:
            return ""
        delta = self._apply_stop(self._decode_new_text(final=True), final=True)
        self._finished = True
        return delta

    def _min_match_end(self) -> float:
        """Where in the text a stop string may end at the earliest: past the first min_tokens tokens' text."""
        if self._min_text_end is None:
            if len(self.token_ids) <= self.min_tokens:
                return float("inf")  # every token so far is one of the first min_tokens
            self._min_text_end = len(self._decode(self.token_ids[:self.min_tokens]))
        return self._min_text_end

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new_text(self, *, final: bool) -> str:
        """Text of the tokens after read_offset, once it ends on a whole character (always when final)."""
        if self.read_offset == len(self.token_ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(self._prefix_text):
            return ""  # e.g. only skipped special tokens so far: keep the window as it is
        if full_text.endswith(_INCOMPLETE_CHAR) and not final:
            return ""  # half a multibyte character: wait for the rest of its bytes
        new_text = full_text[len(self._prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = None  # decoded lazily: only the next step that brings tokens needs it
        return new_text

    def _apply_stop(self, new_text: str, *, final: bool) -> str:
        """Cut `new_text` at a stop string, hold back a possible stop prefix, and record what is emitted."""
        if not self.stop:
            delta = new_text
        else:
            # Held text never contains a whole stop string and emitted text never starts one, so only
            # (held + new) needs searching: at most max_stop_len - 1 characters of overlap.
            buffer = self._held_text + new_text
            buffer_start = self._num_chars - len(self._held_text)
            self._num_chars += len(new_text)
            match = _first_stop_match(buffer, self.stop, self._min_match_end() - buffer_start)
            if match is not None:
                start, stop_str = match
                delta = buffer[: start + len(stop_str) if self.include_stop_str_in_output else start]
                self._held_text = ""
                self._matched_stop = stop_str
                self._finished = True
            else:
                num_held_chars = 0 if final else _longest_stop_prefix_suffix(buffer, self.stop)
                delta = buffer[: len(buffer) - num_held_chars]
                self._held_text = buffer[len(buffer) - num_held_chars :]
        if delta:
            self._emitted_chunks.append(delta)
        return delta


def _first_stop_match(text: str, stops: tuple[str, ...], min_end: float = 0) -> tuple[int, str] | None:
    """(start, stop) of the match that completes first in `text`, ending past `min_end` characters; ties go to
    the earlier start.

    "Completes first" makes the result independent of how many tokens each step brings: it is the match
    a token-by-token stream would have hit.
    """
    if min_end >= len(text):
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop_str in stops:
        start = text.find(stop_str, max(0, int(min_end) - len(stop_str) + 1))
        if start >= 0:
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    return None if best is None else (best[1], best[2])


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop_str in stops:
        for num_chars in range(min(len(stop_str) - 1, len(text)), longest, -1):
            if text.endswith(stop_str[:num_chars]):
                longest = num_chars
                break
    return longest
