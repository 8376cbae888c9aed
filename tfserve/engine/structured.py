"""Constrained decoding with llguidance: a request's `Grammar` compiles once (cached by value), each request
carries its own matcher, and each step the allowed tokens of every constrained row are computed together and
masked into the logits for the whole batch at once (`apply_grammars`).

Why llguidance: on this project's 2-core CPU it compiled a nested JSON schema in 3 ms where xgrammar took
300 ms and outlines-core 800 ms, which is what lets a new schema never stall the server; a mask costs
~80 us per token (xgrammar ~15 us, outlines-core ~155 us), small beside a decode step; it has no dependencies
(xgrammar pulls triton), speaks JSON schema, regex and a Lark dialect that embeds JSON schemas (how tool calls
are enforced), and llama.cpp and vLLM run it too.

The matcher advances only in `postprocess.take_tokens`, on tokens that were kept; preemption keeps a request's
tokens and so its matcher, and recompute never samples again what the matcher has consumed.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from tfserve.errors import GrammarFailed
from tfserve.sampling_params import Grammar

# JSON as models write it (json.dumps' separators, no free whitespace): free whitespace lets a small model
# pad forever; a schema may still ask for other layouts with llguidance's "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256
# fresh matchers kept to copy (~0.1 ms) rather than build (a large grammar's takes as long as its compile, on
# the caller's thread: the server's event loop); fewer, as each holds its grammar's lexer
_FRESH_SIZE = 32


# one token's mask of one request, at most, in CPU time of the thread computing it (not wall time: a busy
# machine must not fail grammars): past it the request ends rather than stall every other request's step (a
# nested JSON schema's mask costs ~0.1 ms; llguidance's own fuel limits stop far later). A request's first
# mask warms its grammar's lexer (80 ms seen for a legitimate schema on a busy machine): it gets FIRST_MASK_TIMES
# the budget.
MAX_MASK_S = 0.05
FIRST_MASK_TIMES = 20


class GrammarError(ValueError):
    """A grammar that does not compile: the message says why (an invalid schema, an unsupported keyword)."""


class StructuredOutputs:
    """One engine's grammar compiler: its tokenizer as llguidance sees it (built on first use, ~0.5 s), compiled
    grammars by value, and matchers for new requests. Thread-safe: the server compiles off the step loop."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._compiled: OrderedDict[Grammar, str] = OrderedDict()
        self._fresh: OrderedDict[Grammar, Any] = OrderedDict()  # a matcher at the start of each, never advanced
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> str:
        """llguidance's form of `grammar`, validated; GrammarError when it does not compile."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        compiled = _to_llguidance(grammar)
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(compiled, self.ll_tokenizer)
        if not error:  # some limits show only in the masks: a schema whose every instance nests forever fails
            # right after its forced opening, so the probe takes the first forced token and computes the mask
            fresh = LLMatcher(self.ll_tokenizer, compiled, log_level=0)
            matcher = fresh.deep_copy()
            for token in matcher.compute_ff_tokens()[:1] if not matcher.is_error() else []:
                matcher.consume_token(token)
            if not matcher.is_error():
                matcher.compute_bitmask()
            error = matcher.get_error() if matcher.is_error() else None
        if error:
            raise GrammarError(grammar_error_line(error))
        with self._lock:
            self._compiled[grammar], self._fresh[grammar] = compiled, fresh
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
            while len(self._fresh) > _FRESH_SIZE:
                self._fresh.popitem(last=False)
        return compiled

    def is_compiled(self, grammar: Grammar) -> bool:
        """Whether `grammar` is in the cache (a `compile` of it returns at once)."""
        with self._lock:
            return grammar in self._compiled

    def matcher(self, grammar: Grammar) -> Any:
        """A fresh matcher (one per request: it holds that request's position in the grammar)."""
        from llguidance import LLMatcher

        compiled = self.compile(grammar)
        with self._lock:
            fresh = self._fresh.get(grammar)
            if fresh is not None:
                self._fresh.move_to_end(grammar)
        matcher = fresh.deep_copy() if fresh is not None else LLMatcher(self.ll_tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise GrammarError(grammar_error_line(matcher.get_error()))
        return matcher

    @property
    def has_ll_tokenizer(self) -> bool:
        """Whether `ll_tokenizer` is built (its first use takes ~0.5 s)."""
        return self._ll_tokenizer is not None

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise GrammarError("constrained decoding needs the model's tokenizer")
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise GrammarError(f"constrained decoding needs a fast tokenizer: {exc}") from None
            return self._ll_tokenizer


def _to_llguidance(grammar: Grammar) -> str:
    from llguidance import LLMatcher

    if grammar.kind == "json_schema":
        try:
            schema = grammar.parsed_schema()
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:  # what llguidance cannot read: an integer past 64 bits, ...
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
    if grammar.kind == "regex":
        return LLMatcher.grammar_from_regex(grammar.source)
    if grammar.kind == "choice":
        choices = json.loads(grammar.source)
        # one terminal (a lexeme), not a rule of alternatives: the parser takes at most 2,000 items in a row
        return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices))
    return LLMatcher.grammar_from_lark(grammar.source)


def grammar_error_line(error: str) -> str:
    # llguidance appends the grammar source with a caret; the first lines say what is wrong
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "the grammar does not compile"


def apply_grammars(logits: torch.Tensor, requests: list[Any], cpu_ops: Any = None,
                   max_mask_s: float | None = None) -> torch.Tensor:
    """`logits` [num_rows, vocab] (float32, contiguous) with every token a constrained row's grammar forbids at
    -inf, in place. A row whose grammar allows nothing left (finished, and held open by min_tokens) keeps its
    EOS tokens. With the CPU kernels one pass writes the masks; otherwise torch ops do. A request whose mask took
    longer than `max_mask_s` (default MAX_MASK_S) gets its `error` set: the engine ends it after this step."""
    rows = [i for i, r in enumerate(requests) if r.matcher is not None]
    if not rows:
        return logits
    max_mask_s = MAX_MASK_S if max_mask_s is None else max_mask_s
    vocab_size = logits.shape[-1]
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for slot, i in enumerate(rows):  # ~10 us a row once a grammar's lexer is warm; llguidance drops the GIL
        started = time.thread_time()
        requests[i].matcher.unsafe_compute_mask_ptr(bitmask[slot].data_ptr(), words * 4)
        mask_s = time.thread_time() - started
        allowed_s = max_mask_s * (FIRST_MASK_TIMES if _first_mask(requests[i]) else 1)
        if mask_s > allowed_s and getattr(requests[i], "error", None) is None:
            requests[i].error = GrammarFailed(f"one token's mask took {mask_s * 1000:.0f} ms, more than the "
                                              f"{allowed_s * 1000:.0f} ms a step allows it")
    dead = (~bitmask.any(dim=1)).tolist()
    eos_ids = {i: [t for t in requests[i].eos_token_ids if t < vocab_size] for i in rows}
    saved = {i: logits[i, eos_ids[i]].clone() for slot, i in enumerate(rows) if dead[slot]}
    # a grammar that allows only its end ends the reply, whatever else holds it open (min_tokens, a bias)
    ending = [i for slot, i in enumerate(rows) if not dead[slot] and requests[i].matcher.is_accepting()
              and _only_eos(bitmask[slot], eos_ids[i], vocab_size)]
    index = torch.tensor(rows, dtype=torch.long)
    if cpu_ops is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        cpu_ops.apply_token_bitmask_(logits, bitmask, index)
    else:
        index = index.to(logits.device)
        allowed = unpack_bitmask(bitmask, vocab_size).to(logits.device)
        logits[index] = torch.where(allowed, logits[index], float("-inf"))
    for i, kept in saved.items():
        logits[i, eos_ids[i]] = kept
    for i in ending:
        logits[i] = float("-inf")
        logits[i, eos_ids[i]] = 0.0
    return logits


def _first_mask(request: Any) -> bool:
    """True for a request none of whose tokens was sampled yet (its grammar's first mask)."""
    return getattr(request, "num_output_tokens", None) == 0


def _only_eos(mask: torch.Tensor, eos_ids: list[int], vocab_size: int) -> bool:
    """Whether the tokens a packed mask row allows are all among `eos_ids`."""
    allowed = unpack_bitmask(mask[None], vocab_size)[0]
    allowed[eos_ids] = False
    return not bool(allowed.any())


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed masks [rows, words] (bit j of word w allows token 32 w + j) -> bool [rows, vocab]."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [rows, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
