"""Qwen3-MoE on the lean forward (tfserve/engine/backends/lean_moe.py), beyond the per-architecture checks of
test_gguf_architectures.py (an F32 file gives HF's logits and greedy tokens, a quantized one HF's logits over its
dequantized weights):

- continuous batching: prompts of different lengths, chunked prefill steps mixed with decode steps and a
  request that joins mid-decode, give each prompt exactly what it gets alone (the experts a token chose, and
  every kernel's rows, do not depend on the rest of the batch);
- the experts run from the file's own blocks: expert e's layers are slice e of the file's 3-D stacks, the
  model holds no float copy of them;
- a Qwen3-MoE loaded through transformers (float weights; weights not renormalised; a dense layer among the
  sparse ones) runs on the lean forward too, token-identical to HF `generate`.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_writer import write_gguf
from kernel_builds import kernel_build
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from tfserve import Engine, SamplingParams
from tfserve.engine.backends.lean_moe import MixtureOfExperts
from tfserve.models.gguf_reader import read
from tfserve.models.gguf_weights import is_placeholder

VOCAB_SIZE = 384
NUM_EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 32
_SIZES = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
          "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None, "initializer_range": 0.1,
          "num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_WIDTH,
          "tie_word_embeddings": False}
_gen = torch.Generator().manual_seed(4321)
PROMPTS = [torch.randint(0, VOCAB_SIZE, (n,), generator=_gen).tolist() for n in (5, 17, 33, 9)]
NUM_NEW = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module", autouse=True)
def _kernels_and_home(tmp_path_factory):
    kernel_build("native")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TFSERVE_HOME", str(tmp_path_factory.mktemp("gguf-moe-home")))
        yield


def _build(**overrides) -> Qwen3MoeForCausalLM:
    """A tiny random Qwen3-MoE, norms random too (a norm read wrong shows)."""
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**_SIZES, "norm_topk_prob": True, **overrides}))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    return write_gguf(_build(), tmp_path_factory.mktemp("moe") / "moe-Q8_0.gguf", "Q8_0")


def _outputs(engine: Engine, prompts: list[list[int]]) -> list:
    return list(engine.generate_batch(prompts, PARAMS).values())


def test_continuous_batching_gives_each_prompt_what_it_gets_alone(q8_file):
    # at most 3 running (the fourth joins as one finishes), 8 tokens a step: prompts prefill in chunks beside
    # other requests' decodes
    engine = Engine.from_pretrained(str(q8_file), num_blocks=64, block_size=4, max_num_seqs=3, max_batch_tokens=8)
    assert engine.runner.forward.name == "lean"
    batched = _outputs(engine, PROMPTS)
    assert engine.num_steps >= -(-sum(map(len, PROMPTS)) // 8) + NUM_NEW  # more steps than a batch of 4 needs
    alone = Engine.from_pretrained(str(q8_file), num_blocks=64, block_size=4, max_num_seqs=1)
    for prompt, output in zip(PROMPTS, batched):
        (single,) = _outputs(alone, [prompt])
        assert output.generated_tokens == single.generated_tokens, f"prompt of {len(prompt)} tokens"
        assert output.logprobs == single.logprobs, f"prompt of {len(prompt)} tokens"
    assert len({tuple(o.generated_tokens) for o in batched}) == len(PROMPTS)


def test_each_expert_runs_its_own_slice_of_the_files_blocks(q8_file):
    engine = Engine.from_pretrained(str(q8_file), num_blocks=16, block_size=4)
    forward, model = engine.runner.forward, engine.model
    config = model.config  # from the file's metadata: expert_count, expert_used_count, expert_feed_forward_length
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob) \
        == (NUM_EXPERTS, TOP_K, EXPERT_WIDTH, True)
    assert forward.weight_formats == {"Q8_0": 2 * 4 + 2 * NUM_EXPERTS * 2 + 1, "float32": 2}  # routers in float32
    tensors = {t.name: t for t in read(q8_file).tensors}
    q8 = gguf.GGMLQuantizationType.Q8_0
    for i, layer in enumerate(model.model.layers):
        assert is_placeholder(layer.mlp.experts.gate_up_proj) and is_placeholder(layer.mlp.experts.down_proj)
        moe = forward._layers[3][i]
        assert isinstance(moe, MixtureOfExperts) and forward._layers[4][i] is None
        router = tensors[f"blk.{i}.ffn_gate_inp.weight"]  # kept in F32, as llama.cpp keeps it
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(layer.mlp.gate.weight, torch.from_numpy(router.data.copy()))
        gate, up, down = (gguf.quants.dequantize(tensors[f"blk.{i}.ffn_{part}_exps.weight"].data, q8)
                          for part in ("gate", "up", "down"))
        for e, (gate_up, down_proj) in enumerate(moe.experts):
            (fused,) = gate_up  # gate and up of one type: one kernel call
            assert fused.label == down_proj.label == "Q8_0"
            rows = fused.rows(torch.arange(2 * EXPERT_WIDTH))
            assert torch.equal(rows, torch.cat([torch.from_numpy(gate[e]), torch.from_numpy(up[e])]))
            assert torch.equal(down_proj.rows(torch.arange(_SIZES["hidden_size"])), torch.from_numpy(down[e]))


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=NUM_NEW, min_new_tokens=None, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_a_transformers_qwen3_moe_runs_on_the_lean_forward(weights):
    model = _build(norm_topk_prob=False, mlp_only_layers=[1])  # layer 1 a dense MLP
    assert hasattr(model.model.layers[0].mlp, "experts") and not hasattr(model.model.layers[1].mlp, "experts")
    references = [_hf_greedy(model, prompt) for prompt in PROMPTS]  # before an Engine sets its attention
    engine = Engine(model, block_size=4, num_blocks=64, weights=weights)
    assert engine.runner.forward.name == "lean"
    moe = engine.runner.forward._layers[3][0]
    assert isinstance(moe, MixtureOfExperts) and not moe.norm_topk_prob
    outputs = _outputs(engine, PROMPTS)
    if weights == "float32":  # the same float32 weights: HF's tokens
        assert [o.generated_tokens for o in outputs] == references
    else:  # Q8_0 blocks quantized from the float weights, each expert's as every dense layer's: near HF's
        assert {linear.label for linear in moe.linears[1:]} == {"int8"}
        assert [o.generated_tokens[0] for o in outputs] == [r[0] for r in references]


def test_tensor_parallelism_refuses_a_mixture_of_experts():
    from tfserve.engine.parallel.tensor_parallel import why_not

    assert "mixture of experts" in why_not(_build(), 2)
