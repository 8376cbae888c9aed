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


# -- the default model's own GGUF blocks (Q4_1, with a Q8_0 embedding) --------------------------------------

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
             "Name three primary colors.", "What is the largest ocean?", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def gguf_engine(default_model_dir):
    from tfserve import Engine

    return Engine.from_pretrained(str(default_model_dir), device="cpu", max_num_seqs=8)


def test_the_store_keeps_the_files_blocks_and_they_are_the_models_weights(engine, default_model_dir):
    gguf = pytest.importorskip("gguf")
    from tfserve.models.gguf_weights import STORE_FILE, quantized_linear_weights

    blocks = quantized_linear_weights(default_model_dir / STORE_FILE, engine.model)
    modules = dict(engine.model.named_modules())
    assert {w.type_name for w in blocks.values()} == {"Q4_1", "Q8_0"}
    assert len(blocks) == 30 * 7 + 2  # every projection, the embedding and the LM head tied to it
    # the first and last layers' projections (the query/key rows come back in the model's order) and the embedding
    checked = [name for name in blocks if ".layers." not in name or ".layers.0." in name or ".layers.29." in name]
    for name in checked:
        weight = blocks[name]
        floats = gguf.quants.dequantize(weight.blocks, gguf.GGMLQuantizationType(weight.qtype))
        assert torch.equal(torch.from_numpy(floats), modules[name].weight.detach()), name


def test_by_default_the_engine_runs_the_files_blocks_and_answers_paris(gguf_engine):
    from tfserve import SamplingParams

    # the LM head (tied to the Q8_0 embedding) runs as 16-bit panels of the dequantized blocks: bfloat16 where the
    # kernels have its dot products
    head = "bfloat16" if gguf_engine.runner.cpu_ops.bf16_dot else "float16"
    assert gguf_engine.quantization == "/".join(sorted(["Q4_1", head]))
    assert gguf_engine.runner.forward.weight_formats == {"Q4_1": 210, head: 1}
    prompt = chat_ids(gguf_engine.tokenizer, "What is the capital of France?")
    (out,) = gguf_engine.generate_batch([prompt], SamplingParams(max_tokens=20, temperature=0)).values()
    assert out.text.strip() == "The capital of France is Paris."


def test_the_files_blocks_stay_close_to_float32(engine, gguf_engine):
    """Stated tolerance for Q4_1 with int8 activations against the float32 expansion of the same file: the same
    first reply token, with a log-probability within 0.3 nats of float32's (measured: at most 0.16). Later
    tokens may part where float32 itself hesitates between near-equal choices, as llama.cpp's do."""
    from tfserve import SamplingParams

    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
    ref = list(engine.generate_batch(prompts, params).values())
    got = list(gguf_engine.generate_batch(prompts, params).values())
    for a, b in zip(ref, got):
        assert a.generated_tokens == b.generated_tokens
        assert abs(a.logprobs[0]["logprob"] - b.logprobs[0]["logprob"]) < 0.3


def test_speculative_decoding_gives_the_same_greedy_tokens(gguf_engine):
    """Proposals are checked as decodes of their own (the same kernels, the same int8 or float road), so the
    file's blocks give exactly the tokens they give one at a time. (Float weights: tests/engine/test_spec_decode.py.)"""
    from tfserve import Engine, SamplingParams

    questions = QUESTIONS + ["Repeat exactly three times: The quick brown fox jumps over the lazy dog."]
    prompts = [chat_ids(gguf_engine.tokenizer, q) for q in questions]
    params = SamplingParams(max_tokens=40, temperature=0)
    speculating = Engine.from_pretrained(gguf_engine.model_path, device="cpu", speculative="ngram")
    results = [[o.generated_tokens for o in engine.generate_batch(prompts, params).values()]
               for engine in (gguf_engine, speculating)]
    assert results[0] == results[1]
    assert speculating.num_accepted_tokens > 0


def test_a_prompt_gets_the_same_tokens_alone_and_beside_others(gguf_engine):
    """Prompt attention runs every row on its own (the decode kernel), so a prompt prefilled beside prompts of
    other lengths gets the same keys and values, bit for bit, as alone: with SDPA over the padded prompts one
    of these eight parted from its tokens alone a few tokens on (the int8 road turns a last-bit difference
    into another token)."""
    from tfserve import SamplingParams

    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Tell me a joke about cats.",
                 "Explain gravity in one sentence.", "List three colors.", "What is 2+2?", "Name a famous painter.",
                 "Why is the sky blue?"]
    prompts = [chat_ids(gguf_engine.tokenizer, q) for q in questions]
    params = SamplingParams(max_tokens=40, temperature=0)
    alone = [next(iter(gguf_engine.generate_batch([p], params).values())).generated_tokens for p in prompts]
    together = [o.generated_tokens for o in gguf_engine.generate_batch(prompts, params).values()]
    assert together == alone


# -- structured outputs and enforced tool calls on the real model ----------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


def test_the_default_model_fills_a_json_schema_and_a_forced_tool_call(gguf_engine):
    import json

    import jsonschema

    from tfserve import SamplingParams
    from tfserve.sampling_params import Grammar
    from tfserve.protocol.tool_formats import detect_format
    from tfserve.protocol.tool_calls import parse_tool_calls
    from tfserve.server.tools.tool_choice import tool_call_grammar

    tokenizer = gguf_engine.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    prompt = chat_ids(tokenizer, "What is the capital of France? Answer in JSON with city and country.")
    (out,) = gguf_engine.generate_batch([prompt], SamplingParams(max_tokens=40, temperature=0,
                                                                 grammar=Grammar.json_schema(schema))).values()
    answer = json.loads(out.text)
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris"

    fmt = detect_format(tokenizer)
    grammar = tool_call_grammar(fmt, [WEATHER_TOOL["function"]], parallel=False, tokenizer=tokenizer)
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    ids = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    (out,) = gguf_engine.generate_batch([list(ids)], SamplingParams(max_tokens=60, temperature=0,
                                                                    grammar=grammar)).values()
    assert out.finish_reason == "stop"
    content, (call,) = parse_tool_calls(out.text, fmt)
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    assert call.name == "get_weather" and arguments["city"] == "Paris" and content is None
