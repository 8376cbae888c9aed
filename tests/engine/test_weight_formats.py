"""The engine with its linear weights in 16 bits or int8 blocks: each format stays within a stated distance of
the float32 engine's logits, the choice is checked where it is made, and `from_pretrained` maps the user's
--dtype / --quantization onto it on CPU."""

import pytest

torch = pytest.importorskip("torch")

from tfserve import Engine, SamplingParams  # noqa: E402
from tfserve.config import EngineConfig  # noqa: E402
from tfserve.engine.backends import select_backend  # noqa: E402
from tfserve.engine.kernels import cpu_ops  # noqa: E402

# Largest logit error allowed, relative to the float32 logits' spread (max - min) at the same position.
# measured: 0.0002; 0.0017 with float32 inputs, 0.0022 with AVX512-BF16 dot products (inputs rounded too); 0.006
# (0.003 with its prompt rows and attention through the AVX512-BF16 dot products)
TOLERANCE = {"float16": 0.001, "bfloat16": 0.005, "int8": 0.015}


@pytest.fixture(scope="module")
def ops():
    if cpu_ops() is None:
        pytest.skip("CPU kernels unavailable here")
    return cpu_ops()


def _prompt_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits each prompt's prefill ends with."""
    captured = []
    sampler = engine.runner.sampler
    engine.runner.sampler = lambda logits, requests: (captured.append(logits.clone()), sampler(logits, requests))[1]
    for prompt in prompts:  # one at a time: one logits row per step
        engine.generate_batch([prompt], SamplingParams(temperature=0, max_tokens=1))
    return [row[0] for row in captured]


@pytest.mark.parametrize("weights", list(TOLERANCE))
def test_each_format_stays_within_its_stated_logit_error(llama, ops, weights):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llama.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    reference = _prompt_logits(Engine(llama, block_size=4, num_blocks=64, weights="float32"), prompts)
    engine = Engine(llama, block_size=4, num_blocks=64, weights=weights)
    head = "bfloat16" if ops.bf16_dot else "float16"  # int8's head: 16-bit panels, bfloat16 on its dot products
    expected = {weights: 2 * 7 + 1} if weights != "int8" else {"int8": 2 * 7, head: 1}
    assert engine.runner.forward.weight_formats == expected
    # bfloat16 weights and int8 blocks' prompt rows: prompt attention on the bfloat16 dot products too, where the
    # build has them
    assert engine.runner.forward.prompt_dot is (weights != "float16" and ops.bf16_dot)
    for got, ref in zip(_prompt_logits(engine, prompts), reference):
        spread = (ref.max() - ref.min()).item()
        assert (got - ref).abs().max().item() <= TOLERANCE[weights] * spread, weights


def test_a_format_that_needs_what_is_missing_is_refused(llama, ops):
    with pytest.raises(ValueError, match="weights gguf needs the GGUF file"):
        Engine(llama, block_size=4, num_blocks=16, weights="gguf")
    with pytest.raises(ValueError, match="weights int8 needs tfserve's CPU kernels"):
        select_backend(llama, EngineConfig(weights="int8"), None)
    with pytest.raises(ValueError, match="weights float16 needs the lean forward"):
        select_backend(llama, EngineConfig(weights="float16", forward_backend="hf"), ops)
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="float8")


def test_from_pretrained_maps_dtype_and_quantization_onto_weight_formats(llama, tokenizer, ops, tmp_path):
    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    head = "bfloat16" if ops.bf16_dot else "float16"
    for options, expected in [({"dtype": "float16"}, "float16"), ({"dtype": "bfloat16"}, "bfloat16"),
                              ({"quantization": "int8"}, f"{head}/int8"), ({}, "none")]:  # int8: the head 16-bit
        engine = Engine.from_pretrained(str(tmp_path), device="cpu", block_size=4, num_blocks=16, **options)
        assert engine.quantization == expected, options
        assert engine.model.dtype == torch.float32  # compute stays float32; only the engine's copy is smaller
        for fmt in expected.split("/") if expected != "none" else ["float32"]:  # said in the log and /metrics
            prompt_unit = ops.matmul_paths["bfloat16" if ops.bf16_dot else "float32"]  # (AMX is off in tests)
            assert engine.matmul_units[fmt] == (ops.matmul_paths[fmt] if fmt != "int8" else
                                                f"{ops.matmul_paths['int8']} (decode rows), {prompt_unit} (prompt rows)")
        out = engine.generate_batch(["hello world"], SamplingParams(temperature=0, max_tokens=3))
        assert len(next(iter(out.values())).generated_tokens) == 3


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_prompts_last_token_alone_is_computed_as_a_prompt_token(llama, ops, chunk):
    """A prompt whose every token but the last is in the prefix cache (or comes in chunks that leave the last
    one alone) ends with the same logits as the same prompt computed whole: its last token is a prompt token,
    multiplied in float32, not with a decode's int8 activations."""
    prompt = torch.randint(0, llama.config.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    cold = _prompt_logits(Engine(llama, block_size=4, num_blocks=64, weights="int8", enable_prefix_caching=False),
                          [prompt])
    engine = Engine(llama, block_size=4, num_blocks=64, weights="int8", max_batch_tokens=chunk or 256)
    first, cached = _prompt_logits(engine, [prompt, prompt])  # the second finds 8 of its 9 tokens cached
    assert engine.block_pool.stats.num_hit_tokens == 8
    assert torch.equal(first, cold[0]) and torch.equal(cached, cold[0])


def test_auto_holds_a_bfloat16_checkpoint_in_bfloat16_where_the_cpu_has_its_dot_products(tokenizer, ops, tmp_path,
                                                                                           caplog):
    """weights "auto": a checkpoint stored in bfloat16 runs on the bfloat16 dot products where the build has them
    (float32 elsewhere); --dtype float32 keeps float32 arithmetic; a float32 checkpoint stays float32."""
    from tiny import build_llama

    stored = build_llama(tokenizer, seed=3)
    with torch.no_grad():
        for param in stored.parameters():
            param.copy_(param.bfloat16().float())  # as transformers loads a bfloat16 checkpoint in float32
    stored.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with caplog.at_level("INFO", logger="tfserve.engine.loading"):
        auto = Engine.from_pretrained(str(tmp_path), device="cpu", block_size=4, num_blocks=16)
    assert ("weights auto: bfloat16, as the checkpoint stores them" in caplog.text) == ops.bf16_dot  # said once
    assert auto.runner.forward.weight_formats.keys() == ({"bfloat16"} if ops.bf16_dot else {"float32"})
    assert auto.quantization == ("bfloat16" if ops.bf16_dot else "none")
    pinned = Engine.from_pretrained(str(tmp_path), device="cpu", block_size=4, num_blocks=16, dtype="float32")
    assert pinned.runner.forward.weight_formats.keys() == {"float32"} and pinned.quantization == "none"
    float32 = Engine(build_llama(tokenizer, seed=3), block_size=4, num_blocks=16)
    assert float32.runner.forward.weight_formats.keys() == {"float32"}


def test_the_startup_log_names_each_unit_once_and_why_a_better_one_is_unused(tokenizer, ops, tmp_path, caplog,
                                                                             monkeypatch):
    """At info: a line per unit the model's formats multiply through, and why a unit the CPU has goes unused; the
    build's whole path table (what /metrics holds) only at debug, so no unit is named twice."""
    from tiny import build_llama

    from tfserve.engine import loading

    stored = build_llama(tokenizer, seed=3)
    stored.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(loading, "unused_units", lambda ops, features: ["AMX present but a test said no"])
    with caplog.at_level("INFO", logger="tfserve.engine.loading"):
        engine = Engine.from_pretrained(str(tmp_path), device="cpu", block_size=4, num_blocks=16, dtype="float32")
    lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    unit = engine.matmul_units["float32"]
    assert [line for line in lines if "multiply through" in line] == [f"float32 weights multiply through {unit}"]
    assert "CPU units unused: AMX present but a test said no" in lines
    assert not any(line.startswith("CPU kernel paths") for line in lines)
    caplog.clear()
    with caplog.at_level("DEBUG", logger="tfserve.engine.loading"):
        Engine.from_pretrained(str(tmp_path), device="cpu", block_size=4, num_blocks=16, dtype="float32")
    assert any(r.getMessage().startswith("CPU kernel paths: linear float32: ") for r in caplog.records)


def test_bfloat16_weights_hold_a_bfloat16_kv_cache_and_results_stay_batch_free(llama, ops):
    """bfloat16 weights on the kernels keep keys and values in bfloat16 (half the bytes a decode reads, twice the
    tokens for the same memory); every other format keeps float32. A request's tokens are the same alone, in a
    batch and with its prompt's prefix cached (every reader widens the same stored values)."""
    memory = 64 * 2 * llama.config.num_hidden_layers * 4 * llama.config.num_key_value_heads * 16 * 4  # 64 float32 blocks
    bf16 = Engine(llama, block_size=4, kv_cache_memory=memory, weights="bfloat16")
    assert bf16.runner.kv_dtype == torch.bfloat16 and bf16.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert bf16.runner.num_blocks == 128
    for weights in ("float32", "float16", "int8"):
        engine = Engine(llama, block_size=4, kv_cache_memory=memory, weights=weights)
        assert engine.runner.kv_dtype == torch.float32 and engine.runner.num_blocks == 64, weights
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, llama.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 13, 21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [next(iter(bf16.generate_batch([p], params).values())).generated_tokens for p in prompts]
    together = [out.generated_tokens for out in bf16.generate_batch(prompts, params).values()]
    again = [next(iter(bf16.generate_batch([p], params).values())).generated_tokens for p in prompts]  # cached
    assert together == alone and again == alone
    assert bf16.block_pool.stats.num_hit_tokens > 0
