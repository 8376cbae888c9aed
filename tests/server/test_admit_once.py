"""A request is admitted once: the engine builds its sequences (the `n` samples of each prompt, sample `j`
seeded `seed + j`) exactly once, and those very requests run."""

from __future__ import annotations

from tiny import MODEL_NAME

SAMPLED = {"temperature": 1.0, "max_tokens": 5, "extra_body": {"ignore_eos": True}}


def test_each_prompt_is_built_once_and_choice_j_is_seed_plus_j(server, engine, monkeypatch):
    calls = []
    real = engine.make_requests

    def make_requests(prompt, params=None, request_id=None):
        calls.append((list(prompt), params.n, params.seed))
        return real(prompt, params, request_id)

    monkeypatch.setattr(engine, "make_requests", make_requests)
    client = server.client()
    prompts = ["hello world", "Once upon a time"]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, seed=7, **SAMPLED)
    assert [choice.index for choice in batch.choices] == [0, 1, 2, 3]
    assert [(n, seed) for _, n, seed in calls] == [(2, 7), (2, 7)]
    for i, prompt in enumerate(prompts):
        for j in range(2):
            alone = client.completions.create(model=MODEL_NAME, prompt=prompt, seed=7 + j, **SAMPLED)
            assert batch.choices[i * 2 + j].text == alone.choices[0].text, (i, j)
    calls.clear()
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=3, seed=1,
                                   **SAMPLED)
    assert [(n, seed) for _, n, seed in calls] == [(3, 1)]
