"""`tfserve bench roofline` with the tiny random-weight llama: each round's figures, and ratios that follow from
them."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner
from tiny import build_llama, build_tokenizer
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)

from tfserve.cli import app


def test_roofline_rounds_measure_the_steps_against_the_limits(tfserve_home, tmp_path, monkeypatch):
    import torch

    from tfserve.models import loading

    tokenizer = build_tokenizer()
    model = build_llama(tokenizer)
    monkeypatch.setattr(loading, "load_model", lambda spec, **options: loading.LoadedModel(
        model, tokenizer, "tiny-local", Path("/models/tiny-local"), "cpu", torch.float32))
    monkeypatch.setenv("TFSERVE_CPU_KERNELS", "0")  # no kernel build in a fresh $TFSERVE_HOME
    out = tmp_path / "roofline.json"
    result = CliRunner().invoke(app, ["bench", "roofline", "-m", "tiny-local", "--batch", "3", "--output-len", "8",
                                      "--rounds", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "of the roofline" in result.output and "round 2" in result.output
    data = json.loads(out.read_text())
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    # what a decode step reads: every linear layer's weight (the LM head's too), not the embedding table
    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    for r in data["rounds"]:
        assert r["weight_bytes"] == weights and r["batch"] == 3
        assert min(r["read_gb_s"], r["one_step_ms"], r["matmul_gflops"], r["matmul_gflops_bf16"],
                   r["batch_step_ms"]) > 0
        assert r["peak_dtype"] == "float32" and r["unit"] == "float32"  # float32's peak bounds the batch
        assert r["unit_peak_gops"] is None and r["batch_of_unit_peak"] is None  # no kernels: not measured
        # (each figure is rounded in the JSON: the tiny model's are small, so the rounding counts)
        assert r["one_gb_s"] == pytest.approx(weights / (r["one_step_ms"] / 1e3) / 1e9, rel=0.01, abs=0.01)
        assert r["one_of_read"] == pytest.approx(r["one_gb_s"] / r["read_gb_s"], rel=0.02, abs=0.002)
        assert r["batch_tok_s"] == pytest.approx(3 / (r["batch_step_ms"] / 1e3), rel=0.01, abs=0.1)
        assert r["batch_of_roofline"] == pytest.approx(r["batch_tok_s"] / r["roofline_tok_s"], rel=0.02, abs=0.002)
    assert data["settings"]["command"] == "tfserve bench roofline" and data["settings"]["dtype"] == "float32"



def test_the_unit_is_the_one_the_batch_multiplies_on():
    from tfserve.bench.roofline import batch_unit

    assert batch_unit({"float32": 15}) == batch_unit({"float16": 15}) == "float32"
    assert batch_unit({"bfloat16": 15}) == "bfloat16"
    assert batch_unit({"Q4_1": 14, "Q8_0": 1}) == batch_unit({"int8": 14, "float16": 1}) == "int8"


def test_the_kernels_measure_each_units_peak():
    from tfserve.engine.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.skip("CPU kernels unavailable here")
    def peak(unit: str) -> float:  # a peak: the best of three (a neighbour's moment only ever lowers one)
        return max(ops.unit_peak_gops(unit, 0.05) for _ in range(3))

    float32 = peak("float32")
    assert float32 > 0 and ops.unit_peak_gops("no such unit", 0.05) == 0
    # the dot products do 2 (bfloat16) and 4 (int8, VNNI) times the products of an FMA a vector
    assert (peak("bfloat16") > 1.3 * float32) == ops.bf16_dot
    if ops.vnni == "AVX512-VNNI":
        assert peak("int8") > 2 * float32
