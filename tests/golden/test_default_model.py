"""The engine on the real default model (SmolLM2-135M-Instruct, float32): Paris, and HF's own tokens."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(default_model_dir):
    from tfserve import Engine

    return Engine.from_pretrained(str(default_model_dir), dtype="float32", device="cpu", max_num_seqs=8)


def chat_ids(tokenizer, question):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


def test_answers_the_capital_of_france(engine):
    from tfserve import SamplingParams

    prompt = chat_ids(engine.tokenizer, "What is the capital of France?")
    (out,) = engine.generate_batch([prompt], SamplingParams(max_tokens=20, temperature=0)).values()
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.text.strip() == "The capital of France is Paris."


def test_greedy_tokens_match_hf_generate_in_a_batch(engine):
    from tfserve import SamplingParams

    questions = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
                 "Name three primary colors."]
    prompts = [chat_ids(engine.tokenizer, q) for q in questions]
    ours = engine.generate_batch(prompts, SamplingParams(max_tokens=40, temperature=0))
    model = engine.model
    for prompt, out in zip(prompts, ours.values()):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=40, do_sample=False)
        assert out.generated_tokens == ref[0, len(prompt):].tolist()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
