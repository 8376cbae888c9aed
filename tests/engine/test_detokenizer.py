"""IncrementalDetokenizer against `tokenizer.decode`, with tokenizers trained in-process (no downloads).

Three tokenizer kinds: byte-level BPE (GPT-2/Qwen style, splits multibyte characters across tokens),
Metaspace BPE (sentencepiece style, "▁" marks a space and the first one is dropped on decode) and llama
style (normalizer-added "▁", byte-fallback tokens, Strip decoder).
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tfserve.engine.detokenizer import IncrementalDetokenizer

SPECIAL_TOKENS = ["<unk>", "<s>", "<|im_end|>"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld ünïcödé 日本語 emoji 🎉🚀 and more text",
    "Stop here. Then STOP there; the end!",
] * 5
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog.",
    "héllo wörld ünïcödé 日本語 emoji 🎉🚀",
    "  leading spaces and   runs of spaces ",
    "日本語🎉🚀日本語",
    "mixed: café → naïve, 東京 🎉 done",
]


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>"
    )


def _byte_level() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # A vocab barely above the 256 bytes leaves most multibyte characters split across tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return _wrap(tokenizer)


def _metaspace() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL_TOKENS))
    return _wrap(tokenizer)


def _llama_style() -> PreTrainedTokenizerFast:
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE())
    base.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIAL_TOKENS, limit_alphabet=30)
    base.train_from_iterator(CORPUS, trainer)
    vocab = base.get_vocab()
    merges = [tuple(m) for m in json.loads(base.to_str())["model"]["merges"]]
    for byte in range(256):  # characters outside the trained alphabet fall back to these byte tokens
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _wrap(tokenizer)


_BUILDERS = {"byte_level": _byte_level, "metaspace": _metaspace, "llama_style": _llama_style}
_CACHE: dict[str, PreTrainedTokenizerFast] = {}


def _tokenizer(kind: str) -> PreTrainedTokenizerFast:
    if kind not in _CACHE:
        _CACHE[kind] = _BUILDERS[kind]()
    return _CACHE[kind]


def _stream(
    tokenizer, token_ids: list[int], rng: random.Random | None = None, **kwargs
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `token_ids` 1..3 at a time (1 without rng); return the detokenizer, deltas (flush last), stop."""
    detok = IncrementalDetokenizer(tokenizer, [1, 5, 6], **kwargs)
    deltas, matched, pos = [], None, 0
    while pos < len(token_ids) and matched is None:
        num_tokens = rng.randint(1, 3) if rng else 1
        delta, matched = detok.step(token_ids[pos : pos + num_tokens])
        deltas.append(delta)
        pos += num_tokens
    deltas.append(detok.flush())
    return detok, deltas, matched


def _reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The text a stream should produce: cut at the stop match that completes first."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not matches:
        return text, None
    end, start, stop = min(matches)
    return text[: end if include else start], stop


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_stream_equals_decode(kind, skip_special_tokens):
    tokenizer = _tokenizer(kind)
    rng = random.Random(f"{kind}-{skip_special_tokens}")
    for _ in range(300):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        full_text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        detok, deltas, _ = _stream(tokenizer, token_ids, rng, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == full_text == detok.text, token_ids
        if "\ufffd" not in full_text:
            assert not any("\ufffd" in d for d in deltas), token_ids


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "llama_style"])
def test_real_texts_stream_equals_decode(kind):
    tokenizer = _tokenizer(kind)
    rng = random.Random(kind)
    for text in TEXTS:
        token_ids = tokenizer.encode(text)
        for _ in range(5):
            for start in (0, 1, 2):  # generation may begin mid-word or mid-character
                full_text = tokenizer.decode(token_ids[start:], skip_special_tokens=True)
                _, deltas, _ = _stream(tokenizer, token_ids[start:], rng)
                assert "".join(deltas) == full_text
                if "\ufffd" not in full_text:
                    assert not any("\ufffd" in d for d in deltas)


def test_byte_level_splits_characters_but_never_emits_half_of_one():
    tokenizer = _tokenizer("byte_level")
    token_ids = tokenizer.encode("日本語 🎉🚀")
    assert any("\ufffd" in tokenizer.decode([i]) for i in token_ids)  # the setup really splits them
    _, deltas, _ = _stream(tokenizer, token_ids)
    assert "".join(deltas) == "日本語 🎉🚀"
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some steps had to wait for the rest of a character


def test_flush_renders_an_unfinished_character_as_decode_does():
    tokenizer = _tokenizer("byte_level")
    token_ids = tokenizer.encode("ab🚀")[:-1]
    detok, deltas, _ = _stream(tokenizer, token_ids)
    assert deltas[-1].endswith("\ufffd")  # only flush lets the replacement character out
    assert detok.text == tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["metaspace", "llama_style"])
def test_leading_space_matches_decode_of_generated_ids(kind):
    tokenizer = _tokenizer(kind)
    token_ids = tokenizer.encode("the quick brown fox")
    assert tokenizer.convert_ids_to_tokens(token_ids)[0].startswith("▁")
    _, deltas, _ = _stream(tokenizer, token_ids)
    assert deltas[0].startswith("t")  # the first "▁" is dropped, as decode drops it ...
    assert " " in "".join(deltas[1:])  # ... and later ones render as spaces (wherever training put them)
    assert "".join(deltas) == "the quick brown fox" == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_window_stays_small_however_long_the_output():
    tokenizer = _tokenizer("byte_level")
    decoded_lengths = []
    original_decode = tokenizer.decode

    class CountingTokenizer:
        def decode(self, token_ids, **kwargs):
            decoded_lengths.append(len(token_ids))
            return original_decode(token_ids, **kwargs)

    token_ids = tokenizer.encode(" ".join(TEXTS) * 20)
    _, deltas, _ = _stream(CountingTokenizer(), token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert len(token_ids) > 1000 and max(decoded_lengths) <= 8
    assert len(decoded_lengths) <= 2 * len(token_ids)


def test_stop_string_spanning_two_tokens_is_cut_and_never_emitted():
    tokenizer = _tokenizer("byte_level")
    token_ids = tokenizer.encode("hello world, the quick brown fox")
    pieces = [tokenizer.decode([i]) for i in token_ids]
    assert "o w" not in pieces and not any("o w" in p for p in pieces)  # it does span tokens
    detok, deltas, matched = _stream(tokenizer, token_ids, stop=["o w"])
    assert matched == "o w" == detok.matched_stop
    assert detok.text == "".join(deltas) == "hell"
    assert not any(set(d) & set("o w") for d in deltas)
    assert detok.finished and detok.step(token_ids[:3]) == ("", None) and detok.flush() == ""


def test_stop_string_at_the_very_beginning():
    tokenizer = _tokenizer("metaspace")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["hel"])
    assert detok.step(tokenizer.encode("hello world")) == ("", "hel")
    assert detok.text == "" and detok.flush() == ""


def test_earliest_completing_stop_wins_whatever_the_step_size():
    tokenizer = _tokenizer("byte_level")
    token_ids = tokenizer.encode("hello world, the quick brown fox")
    for stops, expected in [(["fox", "world"], "hello "), (["quick", "ui", "the"], "hello world, "),
                            (["quick brown", "ick"], "hello world, the qu")]:
        for rng in (None, random.Random(0), random.Random(1)):
            detok, _, matched = _stream(tokenizer, token_ids, rng, stop=stops)
            assert (detok.text, matched) == _reference_cut("hello world, the quick brown fox", stops, False)
            assert detok.text == expected


def test_include_stop_str_in_output():
    tokenizer = _tokenizer("metaspace")
    detok, deltas, matched = _stream(
        tokenizer, tokenizer.encode("hello world the fox"), stop=["world"], include_stop_str_in_output=True
    )
    assert matched == "world" and detok.text == "".join(deltas) == "hello world"


@pytest.mark.parametrize("rng_seed", [None, 0, 1])
def test_no_stop_string_ends_in_the_text_of_the_first_min_tokens(rng_seed):
    """vLLM's min_tokens: a stop string ending within the first min_tokens tokens' text does not count (one that
    starts there and ends after does), whatever the step sizes."""
    tokenizer = _tokenizer("byte_level")
    text = "hello world, the quick brown fox"
    token_ids = tokenizer.encode(text)
    rng = None if rng_seed is None else random.Random(rng_seed)
    for min_tokens in range(len(token_ids) + 1):
        zone = len(tokenizer.decode(token_ids[:min_tokens]))
        for stop in ("o", "he", "quick b"):
            start = next((i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > zone), None)
            expected = text if start is None else text[:start]
            detok, deltas, matched = _stream(tokenizer, token_ids, rng, stop=[stop], min_tokens=min_tokens)
            assert (detok.text, matched) == (expected, None if start is None else stop), (min_tokens, stop)
            assert "".join(deltas) == expected


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "llama_style"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_match_reference_and_deltas_are_never_taken_back(kind, include):
    tokenizer = _tokenizer(kind)
    rng = random.Random(f"{kind}-{include}")
    for _ in range(200):
        text = rng.choice(TEXTS)
        stops = []
        for _ in range(rng.randint(1, 3)):  # substrings of the text, or near misses
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 6)] + rng.choice(["", "", "#"]))
        token_ids = tokenizer.encode(text)
        full_text = tokenizer.decode(token_ids, skip_special_tokens=True)
        detok, deltas, matched = _stream(
            tokenizer, token_ids, rng, stop=stops, include_stop_str_in_output=include
        )
        assert (detok.text, matched) == _reference_cut(full_text, stops, include), (text, stops)
        assert "".join(deltas) == detok.text


def test_held_back_stop_prefix_is_released_by_flush():
    tokenizer = _tokenizer("byte_level")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world!"])
    delta, matched = detok.step(tokenizer.encode("hello wor"))
    assert matched is None and delta == "hello "
    assert detok.flush() == "wor" and detok.text == "hello wor" and detok.matched_stop is None


def test_stop_completed_by_the_flushed_tail_still_cuts():
    tokenizer = _tokenizer("byte_level")
    token_ids = tokenizer.encode("ab cd🚀")[:-1]  # ends inside the emoji, so all text waits for flush
    detok = IncrementalDetokenizer(tokenizer, [], stop=["cd"])
    assert detok.step(token_ids) == ("", None)
    assert detok.flush() == "ab " and detok.text == "ab " and detok.matched_stop == "cd"


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_skip_special_tokens(kind):
    tokenizer = _tokenizer(kind)
    token_ids = [tokenizer.bos_token_id, *tokenizer.encode("hello world"), tokenizer.eos_token_id]
    skipped, _, _ = _stream(tokenizer, token_ids, skip_special_tokens=True)
    kept, _, _ = _stream(tokenizer, token_ids, skip_special_tokens=False)
    assert skipped.text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert "<|im_end|>" not in skipped.text and "<s>" not in skipped.text
    assert kept.text == tokenizer.decode(token_ids, skip_special_tokens=False)
    assert kept.text.endswith("<|im_end|>") and "<s>" in kept.text


def test_stop_string_can_match_a_special_token_only_when_it_is_rendered():
    tokenizer = _tokenizer("byte_level")
    token_ids = [*tokenizer.encode("hi"), tokenizer.eos_token_id, *tokenizer.encode(" more")]
    kept, _, matched = _stream(tokenizer, token_ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert (kept.text, matched) == ("hi", "<|im_end|>")
    skipped, _, matched = _stream(tokenizer, token_ids, skip_special_tokens=True, stop=["<|im_end|>"])
    assert (skipped.text, matched) == ("hi more", None)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "llama_style"])
def test_unknown_token_ids_do_not_crash(kind):
    tokenizer = _tokenizer(kind)
    token_ids = tokenizer.encode("hello world")
    bad_ids = [10**6, -1, 2**40]
    detok = IncrementalDetokenizer(tokenizer, [], stop=["zz"])
    detok.step(bad_ids[:1])
    for token_id in token_ids:
        detok.step([token_id, *bad_ids])
    detok.flush()
    assert detok.text == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_no_tokens_and_empty_stop_strings():
    tokenizer = _tokenizer("byte_level")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["", "x"])
    assert detok.step([]) == ("", None)
    assert detok.flush() == "" and detok.text == ""


@pytest.mark.parametrize("kind", ["byte_level", "llama_style"])  # (metaspace's vocabulary lacks "→")
def test_the_tokens_of_the_text_before_a_stop_string(kind):
    """`num_tokens_of_text`: the fewest generated tokens whose decode gives the text emitted, a character split
    across tokens counted whole (the engine keeps that many tokens' logprobs)."""
    tokenizer = _tokenizer(kind)
    token_ids = tokenizer.encode("mixed: café → naïve, 東京 done", add_special_tokens=False)
    detok, _, matched = _stream(tokenizer, token_ids, stop=["→"])
    assert matched == "→" and detok.text.rstrip() == "mixed: café"
    k = detok.num_tokens_of_text()
    assert tokenizer.decode(token_ids[:k]).startswith(detok.text)
    assert not tokenizer.decode(token_ids[: k - 1]).startswith(detok.text)
