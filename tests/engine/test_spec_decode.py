"""Speculative decoding by n-gram prompt lookup: the same greedy tokens as one at a time, several per step
where the text repeats, proposals only for greedy requests, and nothing left behind in the KV cache."""

import pytest

from tfserve.engine.spec_decode import accepted, propose_ngram


def test_proposals_follow_the_latest_earlier_occurrence_of_the_longest_tail():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 2) == [7, 8]  # "1 2 3" last seen at 4..6, followed by 7 8
    assert propose_ngram(tokens, 10) == [7, 8, 1, 2, 3]
    assert propose_ngram([5, 6, 7], 3) == []  # nothing repeats
    assert propose_ngram([4, 5, 4], 3) == []  # a lone repeated token proposes nothing by default (min_n=2)
    assert propose_ngram([4, 5, 4], 3, min_n=1) == [5, 4]
    assert propose_ngram([4], 3) == []


def test_a_step_keeps_the_agreed_proposals_and_one_token_more():
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accepted([], [3]) == [3]


torch = pytest.importorskip("torch")

from tfserve import SamplingParams  # noqa: E402


def _run(make_engine, prompts, params, **config):
    engine = make_engine(with_tokenizer=False, **config)
    outputs = engine.generate_batch(prompts, params)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return [o.generated_tokens for o in outputs.values()], engine


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_the_same_greedy_tokens_several_at_a_time(make_engine, llama, backend):
    gen = torch.Generator().manual_seed(0)
    vocab = llama.config.vocab_size
    phrase = torch.randint(3, vocab, (6,), generator=gen).tolist()
    prompts = [phrase * 4, torch.randint(3, vocab, (23,), generator=gen).tolist(), phrase * 2 + [5, 6]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(make_engine, prompts, params, forward_backend=backend)
    spec, engine = _run(make_engine, prompts, params, forward_backend=backend, speculative="ngram",
                        num_speculative_tokens=4, max_batch_tokens=24)
    assert spec == plain
    assert engine.num_draft_tokens > 0 and engine.num_accepted_tokens > 0
    assert engine.num_steps < 40 + 10  # fewer steps than tokens: several tokens in some steps
    assert 0 < engine.spec_acceptance_rate <= 1


def test_only_greedy_requests_propose_and_sampled_ones_are_unchanged(make_engine, llama):
    prompt = [7, 8, 9, 10] * 5
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    plain, _ = _run(make_engine, [prompt], sampled)
    spec, engine = _run(make_engine, [prompt], sampled, speculative="ngram")
    assert spec == plain and engine.num_draft_tokens == 0


def test_stops_and_max_tokens_cut_a_steps_tokens(make_engine, llama):
    prompt = [7, 8, 9, 10] * 5
    plain, _ = _run(make_engine, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stop_at = plain[0][5]
    for params in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_at])):
        ours, _ = _run(make_engine, [prompt], params)
        spec, _ = _run(make_engine, [prompt], params, speculative="ngram")
        assert spec == ours


def test_a_bad_setting_is_refused():
    from tfserve.config import EngineConfig

    with pytest.raises(ValueError, match="speculative must be ngram or draft"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="speculative_model is the draft model of speculative draft"):
        EngineConfig(speculative="ngram", speculative_model="x")
    with pytest.raises(ValueError, match="draft runs without tensor parallelism"):
        EngineConfig(speculative="draft", speculative_model="x", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)


# -- a draft model ---------------------------------------------------------------------------------------------

def _noisy_copy(model, scale: float):
    """The model with every weight nudged: a draft that agrees with it on most tokens, not all."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return draft


def _other_llama(vocab_size: int):
    """Another shape altogether: one layer, other heads (its KV cache is laid out differently)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(5)
    return LlamaForCausalLM(config).eval()


def _each(engine, prompts, params):
    """Each prompt's tokens under its own params, all in one batch."""
    ids = [engine.add_request(prompt, p)[0] for prompt, p in zip(prompts, params)]
    done = {}
    while len(done) < len(ids):
        done.update((o.request_id, o.generated_tokens) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def _prompts(vocab):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 23, 1, 40)]


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_a_draft_model_gives_the_same_greedy_tokens(make_engine, llama, backend):
    prompts = _prompts(llama.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain, _ = _run(make_engine, prompts, params, forward_backend=backend)
    for draft, agrees in ((llama, "all"), (_noisy_copy(llama, 0.3), "some"),
                          (_other_llama(llama.config.vocab_size), "any")):
        spec, engine = _run(make_engine, prompts, params, forward_backend=backend, speculative="draft",
                            num_speculative_tokens=3, draft_model=draft)
        assert spec == plain, agrees
        assert engine.num_draft_tokens > 0
        if agrees == "all":  # the model as its own draft: every proposal kept, 4 tokens a step
            assert engine.spec_acceptance_rate == 1
            assert engine.num_steps <= 2 * (30 // 4 + 2)
        elif agrees == "some":
            assert 0 < engine.spec_acceptance_rate < 1


def test_a_draft_model_beside_sampled_requests_stops_and_preemption(make_engine, llama):
    vocab = llama.config.vocab_size
    prompts = _prompts(vocab)
    draft = _noisy_copy(llama, 0.3)
    greedy = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=4, max_tokens=25, ignore_eos=True)
    plain, _ = _run(make_engine, prompts, greedy)
    stop_at = plain[1][6]
    stopping = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop_token_ids=[stop_at])
    mixed = [greedy, sampled, stopping, greedy]
    want = _each(make_engine(with_tokenizer=False), prompts, mixed)
    # a pool too small for all four at once: requests are preempted and recomputed, the draft's cache with them
    spec = make_engine(with_tokenizer=False, num_blocks=20, speculative="draft", draft_model=draft)
    assert _each(spec, prompts, mixed) == want
    assert spec.scheduler.num_preemptions > 0 and spec.num_draft_tokens > 0
    assert spec.block_pool.num_free_blocks == spec.block_pool.num_blocks


def test_a_draft_model_is_needed_and_must_share_the_tokenizer(make_engine, llama, tokenizer, tmp_path):
    from tfserve import Engine
    from tfserve.errors import ModelLoadError

    with pytest.raises(ValueError, match="needs a draft model"):
        make_engine(speculative="draft")
    target, same, other = tmp_path / "target", tmp_path / "same", tmp_path / "other"
    for path, model in ((target, llama), (same, _noisy_copy(llama, 0.3))):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["other words entirely"] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    other_tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    _other_llama(len(other_tokenizer)).save_pretrained(other)
    other_tokenizer.save_pretrained(other)
    with pytest.raises(ModelLoadError, match="has another tokenizer"):
        Engine.from_pretrained(str(target), speculative="draft", speculative_model=str(other), num_blocks=64)
    engine = Engine.from_pretrained(str(target), speculative="draft", speculative_model=str(same), num_blocks=64)
    prompt = _prompts(llama.config.vocab_size)[1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (out,) = engine.generate_batch([prompt], params).values()
    (want,) = make_engine(with_tokenizer=False).generate_batch([prompt], params).values()
    assert out.generated_tokens == want.generated_tokens and engine.num_draft_tokens > 0


def test_a_request_held_to_a_grammar_decodes_a_token_a_step_beside_speculating_ones():
    """Under speculation a request held to a grammar gets no proposals (checked under its grammar, proposals
    changed such replies: an outside audit saw a draft model break JSON output), so its tokens are one token a
    step's; a free request beside it in the batch still speculates."""
    from tfserve import Engine
    from tfserve.sampling_params import Grammar
    from tiny import build_llama, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_llama(tokenizer)
    grammar = Grammar.regex("(the cat sat |on the mat )+")
    prompts = [tokenizer.encode(text) for text in (
        "the cat sat on the mat the cat sat on the mat on the mat",  # the grammar's own words
        "hello world hello world hello world",
    )]
    constrained = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, grammar=grammar)
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outputs, drafted = {}, {}
    for speculative in (None, "ngram"):
        engine = Engine(model, tokenizer, block_size=8, num_blocks=64, speculative=speculative,
                        num_speculative_tokens=4)
        outputs[speculative] = [o.generated_tokens for o in engine.generate_batch(prompts, constrained).values()]
        drafted[speculative] = engine.num_draft_tokens
        (held,) = engine.add_request(prompts[0], constrained)  # and a free request beside it
        engine.add_request(prompts[1], free)
        finals = {}
        while engine.has_unfinished:
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert finals[held].generated_tokens == outputs[speculative][0]
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert outputs["ngram"] == outputs[None] and drafted["ngram"] == 0
    assert engine.num_draft_tokens > 0  # the free request of the mixed batch speculated
    for tokens in outputs[None]:  # max_tokens may cut the last word
        assert set(tokenizer.decode(tokens).split()[:-1]) <= {"the", "cat", "sat", "on", "mat"}
