"""Token logprobs in the two OpenAI shapes: chat (`{"content": [{token, logprob, bytes, top_logprobs}]}`)
and legacy completions (`{tokens, token_logprobs, top_logprobs, text_offset}`, the prompt's tokens first with
`echo`); and vLLM's `prompt_logprobs` (per prompt token `{token_id: {logprob, rank, decoded_token}}`).

A token's string is its own bytes decoded (a byte-level token that is half of a character shows as
U+FFFD, as OpenAI's do); `bytes` are the true bytes, so a client can join them back into the text.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import lru_cache
from typing import Any

from tfserve.server.errors import bad_request
from tfserve.server.protocol import field

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte fallback


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def shown(entries: list[dict] | None, output: Any) -> list[dict] | None:
    """An output's logprob entries without the EOS / stop token's that ended it: that token is not part of the
    text (unless include_stop_str_in_output), so its logprob is not shown either."""
    if (entries and output.finish_reason == "stop" and isinstance(output.stop_reason, int)
            and not output.stop_token_shown):
        return entries[:-1]
    return entries


class TokenTexts:
    """token id -> (string, bytes), cached; one per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._text(token_id)
        return hit

    def _text(self, token_id: int) -> tuple[str, bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", b""
        table = _byte_decoder()
        if self.byte_level and all(c in table for c in piece):
            raw = bytes(table[c] for c in piece)
        elif (match := _BYTE_TOKEN.match(piece)) is not None:
            raw = bytes([int(match.group(1), 16)])
        elif piece in self.tokenizer.all_special_tokens:
            raw = piece.encode()
        else:
            raw = self.tokenizer.decode([token_id]).encode()
        return raw.decode("utf-8", errors="replace"), raw


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    # the decoder's own JSON, not the whole tokenizer's: Gemma 3's 262k tokens took a second of every start
    try:
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    except Exception:  # a decoder tokenizers cannot serialize alone (a custom one): the tokenizer's JSON says
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" in kinds


def chat_logprobs(entries: list[dict], texts: TokenTexts, num_top: int) -> list[dict]:
    """Engine logprob entries -> the items of a chat choice's `logprobs.content`."""
    items = []
    for entry in entries:
        token, raw = texts(entry["token_id"])
        top = []
        for token_id, logprob in entry["top"][:num_top]:
            top_token, top_raw = texts(token_id)
            top.append({"token": top_token, "logprob": _finite(logprob), "bytes": list(top_raw)})
        items.append({"token": token, "logprob": _finite(entry["logprob"]), "bytes": list(raw), "top_logprobs": top})
    return items


class TextOffsets:
    """Where each token of a legacy completion starts in the choice's text (`text_offset`), in the text's own
    characters: the tokens' bytes are decoded incrementally, so the tokens of one character that byte-level BPE
    splits (an emoji, CJK) all start where it does, and a stream's chunks count as the whole response does."""

    def __init__(self, start: int = 0) -> None:
        self.position = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset of the token whose bytes are `raw`; moves past it."""
        offset = self.position
        self.position += len(self._decoder.decode(raw))
        return offset


def legacy_token(texts: TokenTexts, token_id: int) -> str:
    """A token as OpenAI's legacy API writes it: its text, or, for bytes that are no whole UTF-8 (part of a
    character), `bytes:\\xe2\\x98` (so two such tokens never show as the same U+FFFD)."""
    token, raw = texts(token_id)
    if "\ufffd" in token and token.encode() != raw:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
    return token


def completion_logprobs(entries: list[dict], texts: TokenTexts, offsets: TextOffsets) -> dict[str, list]:
    """Engine logprob entries -> a legacy completion choice's `logprobs` (`offsets` carried across a stream's
    chunks)."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        token = legacy_token(texts, entry["token_id"])
        result["tokens"].append(token)
        result["token_logprobs"].append(_finite(entry["logprob"]))
        result["top_logprobs"].append(_legacy_top(token, entry, texts))
        result["text_offset"].append(offsets.advance(texts(entry["token_id"])[1]))
    return result


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the alternatives shown per token


def top_count(body: dict[str, Any], name: str) -> int | None:
    """A field that counts the top tokens to show per token (`top_logprobs`, legacy `logprobs`,
    `prompt_logprobs`): an integer in [0, 20], or None when absent."""
    num_top = field(body, name, int)
    if num_top is not None and not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name} must be in [0, {MAX_TOP_LOGPROBS}] (got {num_top})", name)
    return num_top


def requested_prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: how many top tokens to show at each prompt position (0: only the prompt's own),
    or None. As in vLLM, not with `stream` (a stream chunk has no place for them)."""
    num_top = top_count(body, "prompt_logprobs")
    if num_top is None:
        return None
    if stream:
        raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    return num_top


def prompt_logprobs(entries: list[dict | None], texts: TokenTexts, num_top: int) -> list[dict | None]:
    """Engine prompt logprob entries -> vLLM's `prompt_logprobs`: None for the first token, then for each
    token a mapping of token id to `{"logprob", "rank", "decoded_token"}`, the prompt's own token first and
    then the `num_top` likeliest (rank 1 first)."""
    result: list[dict | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        shown = {entry["token_id"]: (entry["logprob"], entry["rank"])}
        for rank, (token_id, logprob) in enumerate(entry["top"][:num_top], start=1):
            shown.setdefault(token_id, (logprob, rank))
        result.append({str(token_id): {"logprob": _finite(logprob), "rank": rank, "decoded_token": texts(token_id)[0]}
                       for token_id, (logprob, rank) in shown.items()})
    return result


def echo_logprobs(prompt_ids: list[int], entries: list[dict | None], texts: TokenTexts,
                  num_top: int) -> dict[str, list]:
    """A legacy completion's `logprobs` for its echoed prompt, as OpenAI's API gave them: the first token's
    logprob and top logprobs null, offsets from 0."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offsets = TextOffsets()
    for token_id, entry in zip(prompt_ids, entries):
        token = legacy_token(texts, token_id)
        result["tokens"].append(token)
        result["text_offset"].append(offsets.advance(texts(token_id)[1]))
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(_finite(entry["logprob"]))
        result["top_logprobs"].append(_legacy_top(token, entry, texts, num_top))
    return result


def _legacy_top(token: str, entry: dict, texts: TokenTexts, num_top: int | None = None) -> dict[str, float]:
    """A legacy `top_logprobs` entry: string -> logprob of the `num_top` likeliest tokens (of two that show as the
    same string, the likelier), then the token itself, which OpenAI always adds (up to logprobs + 1 entries)."""
    top: dict[str, float] = {}
    for token_id, logprob in entry["top"][:num_top]:
        top.setdefault(legacy_token(texts, token_id), _finite(logprob))
    top.setdefault(token, _finite(entry["logprob"]))
    return top


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI clamps to a large negative number too
    return max(float(logprob), -9999.0)
