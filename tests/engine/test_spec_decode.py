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

    with pytest.raises(ValueError, match="speculative must be ngram"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
