"""Constrained decoding on a tiny random llama: whatever the weights, the output follows the grammar. Schemas of
every feature the JSON path supports, regexes, choices and Lark grammars, at several temperatures and seeds;
mixed batches; preemption; cut by max_tokens; compile errors; logit_bias and min_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tfserve import SamplingParams
from tfserve.engine.structured import GrammarError, unpack_bitmask
from tfserve.errors import GrammarFailed
from tfserve.sampling_params import Grammar
from tiny import run_engine as run
from tiny import slow_masks

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64]

SCHEMAS = {
    "enums_and_nesting": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "fox"]},
            "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                      "required": ["name"], "additionalProperties": False},
        },
        "required": ["kind", "owner"], "additionalProperties": False,
    },
    "arrays_with_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False,
    },
    "any_of_and_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "note": {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "integer", "minimum": 10}]},
        },
        "required": ["age", "score", "note"], "additionalProperties": False,
    },
    "refs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 99},
                                                            "y": {"type": "integer", "maximum": 5, "minimum": 0}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 2, "maxItems": 2,
    },
}


def schema_params(schema, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 300)
    return SamplingParams(grammar=Grammar.json_schema(schema), **kwargs)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_at_every_temperature(make_engine, name):
    schema = SCHEMAS[name]
    engine = make_engine()
    items = [(PROMPT, schema_params(schema, temperature=0))]
    items += [(PROMPT, schema_params(schema, temperature=t, seed=s)) for t in (0.7, 1.5) for s in (1, 2)]
    for output in run(engine, items):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)


def test_json_object_regex_choice_and_lark(make_engine):
    engine = make_engine()
    lark = 'start: "id=" /[0-9]{2,3}/ ";" ("on" | "off")'
    outputs = run(engine, [
        # the random model closes the object within max_tokens for 7 of seeds 3-14
        (PROMPT, SamplingParams(grammar=Grammar.json_object(), max_tokens=200, temperature=1.0, seed=4)),
        (PROMPT, SamplingParams(grammar=Grammar.regex(r"[a-z]{3}-[0-9]{2}"), max_tokens=40, temperature=1.0, seed=4)),
        (PROMPT, SamplingParams(grammar=Grammar.choice(["yes", "no", "maybe"]), max_tokens=10, temperature=1.2,
                                seed=5)),
        (PROMPT, SamplingParams(grammar=Grammar.lark(lark), max_tokens=30, temperature=1.0, seed=6)),
    ])
    assert all(o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    assert isinstance(json.loads(outputs[0].text), dict)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", outputs[1].text)
    assert outputs[2].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"id=[0-9]{2,3};(on|off)", outputs[3].text)


def test_a_choice_among_thousands(make_engine):
    """More choices than llguidance's parser takes in one rule (2,000): they are one lexeme instead."""
    choices = [f"w{i}" for i in range(5000)]
    outputs = run(make_engine(), [(PROMPT, SamplingParams(grammar=Grammar.choice(choices), max_tokens=10,
                                                          temperature=1.0, seed=seed)) for seed in (1, 2, 3)])
    assert all(o.finish_reason == "stop" and o.text in choices for o in outputs), [o.text for o in outputs]


def test_a_grammar_that_fails_midway_ends_its_request_with_an_error(make_engine, monkeypatch):
    """A matcher that refuses a token its own mask allowed (llguidance meeting a limit only at run time): that
    request ends with an error naming the grammar; the others in its batch go on."""
    from tfserve.engine.structured import StructuredOutputs

    class Failing:
        def __init__(self, matcher):
            self.matcher, self.num_consumed = matcher, 0

        def consume_token(self, token_id):
            self.num_consumed += 1
            return self.num_consumed < 3 and self.matcher.consume_token(token_id)

        def get_error(self):
            return "Parser Error: a limit\n<state>..."

        def __getattr__(self, name):
            return getattr(self.matcher, name)

    make = StructuredOutputs.matcher
    monkeypatch.setattr(StructuredOutputs, "matcher", lambda self, grammar: Failing(make(self, grammar)))
    failing, free = run(make_engine(), [(PROMPT, SamplingParams(grammar=Grammar.json_object(), max_tokens=50)),
                                        (PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert failing.finish_reason == "error" and isinstance(failing.error, GrammarFailed)
    assert "grammar failed: Parser Error: a limit" in str(failing.error)
    assert len(failing.generated_tokens) == 3
    assert free.finish_reason == "length" and len(free.generated_tokens) == 12


def test_constrained_and_free_requests_share_a_batch_without_changing_each_other(make_engine):
    schema = SCHEMAS["any_of_and_numbers"]
    free = SamplingParams(max_tokens=12, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=11)
    constrained = schema_params(schema, temperature=0.8, seed=7)
    alone = [run(make_engine(), [(PROMPT, p)])[0] for p in (free, seeded, constrained)]
    together = run(make_engine(), [(PROMPT, free), (PROMPT, constrained), (PROMPT, seeded),
                                   (PROMPT[:5], schema_params(schema, temperature=0))])
    assert together[0].generated_tokens == alone[0].generated_tokens
    assert together[2].generated_tokens == alone[1].generated_tokens
    assert together[1].generated_tokens == alone[2].generated_tokens  # seeded sampling stays reproducible
    jsonschema.validate(json.loads(together[3].text), schema)


def test_preemption_in_the_middle_of_a_constrained_request_keeps_its_grammar(make_engine):
    schema = SCHEMAS["enums_and_nesting"]
    items = [(PROMPT + [i], schema_params(schema, temperature=0.8, seed=i, max_tokens=80)) for i in range(6)]
    roomy = run(make_engine(), items)
    engine = make_engine(num_blocks=32, block_size=4)  # 6 sequences of ~40 tokens cannot all stay
    tight = run(engine, items)
    assert engine.scheduler.num_preemptions > 0
    assert [o.generated_tokens for o in tight] == [o.generated_tokens for o in roomy]
    for output in tight:
        jsonschema.validate(json.loads(output.text), schema)


def test_cut_by_max_tokens_is_length_not_a_claimed_complete_document(make_engine):
    output = run(make_engine(), [(PROMPT, schema_params(SCHEMAS["refs"], max_tokens=5, temperature=0))])[0]
    assert output.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.text)


@pytest.mark.parametrize("grammar, message", [
    (Grammar.json_schema({"type": "nope"}), "Invalid type"),
    (Grammar.json_schema({"type": "object", "if": {"type": "object"}, "then": {}}), "Unimplemented keys"),
    (Grammar("json_schema", "{not json"), "not valid JSON"),
    (Grammar.regex("(("), "regex"),
    (Grammar.lark("start: undefined_rule"), "undefined_rule"),
    (Grammar.json_schema({"enum": [2**64]}), "cannot be compiled"),  # past what llguidance reads
    # every instance nests forever: it compiles, and fails at its first mask (a limit met only then)
    (Grammar.json_schema({"$defs": {"a": {"type": "object", "properties": {"n": {"$ref": "#/$defs/a"}},
                                          "required": ["n"]}}, "$ref": "#/$defs/a"}), "Too many items"),
])
def test_a_grammar_that_does_not_compile_is_a_value_error_at_add_request(make_engine, grammar, message):
    engine = make_engine()
    with pytest.raises(GrammarError, match=message):
        engine.add_request(PROMPT, SamplingParams(grammar=grammar))
    assert not engine.has_unfinished


def test_grammars_compile_once(make_engine, monkeypatch):
    engine = make_engine()
    grammar = Grammar.json_schema(SCHEMAS["refs"])
    first = engine.structured.compile(grammar)
    monkeypatch.setattr("tfserve.engine.structured._to_llguidance", lambda g: pytest.fail("compiled again"))
    assert engine.structured.compile(Grammar.json_schema(json.loads(json.dumps(SCHEMAS["refs"])))) is first


def test_speculative_decoding_gives_constrained_requests_their_own_tokens(make_engine):
    schema = SCHEMAS["arrays_with_bounds"]
    plain = run(make_engine(), [(PROMPT, schema_params(schema, temperature=0))])[0]
    spec = run(make_engine(speculative="ngram", num_speculative_tokens=4), [(PROMPT, schema_params(schema, temperature=0))])[0]
    assert spec.generated_tokens == plain.generated_tokens


def test_unpack_bitmask_reads_llguidance_bit_order():
    import torch

    bitmask = torch.tensor([[-(1 << 31) | 0b101, 0], [0, 1]], dtype=torch.int32)  # bit 31: the sign
    allowed = unpack_bitmask(bitmask, 33)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 31]
    assert allowed[1].nonzero().flatten().tolist() == [32]


def test_logit_bias_and_min_tokens(make_engine):
    engine = make_engine()
    eos = 2
    favoured = run(engine, [(PROMPT, SamplingParams(max_tokens=4, temperature=0, logit_bias={77: 100}))])[0]
    assert favoured.generated_tokens == [77, 77, 77, 77]
    greedy = run(engine, [(PROMPT, SamplingParams(max_tokens=1, temperature=0))])[0].generated_tokens[0]
    banned = run(engine, [(PROMPT, SamplingParams(max_tokens=1, temperature=0, logit_bias={greedy: -100}))])[0]
    assert banned.generated_tokens[0] != greedy
    held = run(engine, [(PROMPT, SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100}, min_tokens=5))])[0]
    assert held.generated_tokens[-1] == eos and len(held.generated_tokens) == 6
    assert held.finish_reason == "stop"
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(PROMPT, SamplingParams(logit_bias={10**6: 1.0}))


def test_a_finished_grammar_ends_the_reply_whatever_holds_it_open(make_engine):
    """min_tokens (or a bias) keeps the EOS tokens out, a finished grammar allows nothing else: the grammar wins
    and the reply stops where it is complete, instead of running on with tokens the grammar refuses."""
    outputs = run(make_engine(), [(PROMPT, SamplingParams(grammar=Grammar.choice(["yes", "no"]), max_tokens=12,
                                                          temperature=0, min_tokens=8, logprobs=0)),
                                  (PROMPT, SamplingParams(grammar=Grammar.regex("ab"), max_tokens=12, min_tokens=8,
                                                          logit_bias={2: -100}, temperature=0.8, seed=1))])
    for output in outputs:
        assert output.finish_reason == "stop" and output.error is None, output
    assert outputs[0].text in ("yes", "no") and outputs[1].text == "ab"


def test_the_mask_kernel_equals_torch():
    import torch

    from tfserve.engine import kernels

    torch.manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 32), dtype=torch.int32)
    bitmask[0, :5], bitmask[1, 3:9] = 0, -1  # the words the kernel fills or skips whole
    logits = torch.randn(5, vocab)
    rows = torch.tensor([4, 0, 2])
    expected = logits.clone()
    expected[rows] = torch.where(unpack_bitmask(bitmask, vocab), logits[rows], float("-inf"))
    kernels.cpu_ops().apply_token_bitmask_(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_a_constrained_request_sent_to_another_process_is_held_to_its_grammar_there(make_engine):
    """A replica's request crosses a pipe pickled: without its matcher (which cannot be pickled) and detokenizer
    (a tokenizer is megabytes); the receiving engine makes both (`Engine.attach`), and the output is the one the
    sending engine gives."""
    import pickle

    front, replica = make_engine(), make_engine()
    params = SamplingParams(grammar=Grammar.choice(["yes", "no", "maybe"]), stop=["zz"], max_tokens=10,
                            temperature=1.2, seed=5)
    request = front.make_requests(PROMPT, params)[0]
    assert request.matcher is not None and request.detokenizer is not None
    crossed = pickle.loads(pickle.dumps(request))
    assert crossed.matcher is None and crossed.detokenizer is None and crossed.prompt_token_ids == request.prompt_token_ids
    replica.enqueue(replica.attach(crossed))
    outputs = []
    while replica.has_unfinished:
        outputs += [o for o in replica.step() if o.finished]
    expected = run(make_engine(), [(PROMPT, params)])[0]
    assert outputs[0].finish_reason == "stop" and outputs[0].text == expected.text in ("yes", "no", "maybe")


def test_a_grammar_whose_mask_overruns_its_budget_ends_its_request_and_only_it(make_engine, monkeypatch):
    """A mask slower than MAX_MASK_S (a hostile regex on a large vocabulary) ends that request with a grammar
    error after one step, rather than stalling every step of the batch; the free request goes on."""
    from tfserve.engine import structured

    slow_masks(monkeypatch, 0.03)
    monkeypatch.setattr(structured, "MAX_MASK_S", 0.01)
    slow, free = run(make_engine(), [(PROMPT, SamplingParams(grammar=Grammar.regex("(.*a){30}"), max_tokens=50)),
                                     (PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert slow.finish_reason == "error" and isinstance(slow.error, GrammarFailed)
    assert "mask took" in str(slow.error) and "grammar failed" in str(slow.error)
    assert len(slow.generated_tokens) <= 2  # (its first mask, warming the grammar, has FIRST_MASK_TIMES the budget)
    assert free.finish_reason == "length" and len(free.generated_tokens) == 12
