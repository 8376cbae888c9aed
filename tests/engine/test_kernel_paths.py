"""Which instructions each CPU kernel path runs on (engine/kernel_paths.py). Any CPU runs these (AVX2-only,
AVX-512, ARM): they check that the table agrees with what the module exposes, never fixed strings for one machine."""

from __future__ import annotations

import pytest
from kernel_builds import kernel_build

from tfserve.engine.kernel_paths import AVX512_BF16, describe, kernel_paths, unused_units

AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16"})


@pytest.fixture(scope="module", params=["native", pytest.param("x86-64", marks=pytest.mark.slow)])
def ops(request):
    return kernel_build(request.param)


def test_the_table_is_what_the_module_exposes(ops):
    paths = kernel_paths(ops)
    assert ops.isa in paths["linear float32"] or ops.isa == "scalar"
    assert paths["linear float32"] in paths["attention float32"] + paths["quantized blocks (prompt rows)"]
    if ops.bf16_dot:
        assert paths["linear bfloat16"] == AVX512_BF16
    else:
        assert paths["linear bfloat16"] == paths["linear float16"]  # widened to float32 in registers
    assert (paths["prompt attention bfloat16"] == AVX512_BF16) == ops.bf16_dot
    int8 = paths["quantized blocks (decode rows)"]
    assert int8.startswith(ops.vnni) if ops.vnni else "VNNI" not in int8
    assert ops.vnni in ("", "AVX512-VNNI", "AVX-VNNI")
    assert kernel_paths(None) == {} and "none" in describe({}, [])


def test_the_log_line_names_each_path_and_why_a_unit_is_unused(ops):
    from tfserve.engine.kernels import cpu_features

    line = describe(kernel_paths(ops), unused_units(ops, cpu_features()))
    assert line.startswith("CPU kernel paths: linear float32: ") and "\n" not in line
    for path, isa in kernel_paths(ops).items():
        assert f"{path}: {isa}" in line
    notes = unused_units(ops, AMX_FLAGS | {"avx512_vnni"})
    assert "AMX present but the kernels have no AMX path" in notes
    assert ("VNNI present but not in this build of the kernels" in notes) == (not ops.vnni)
    assert unused_units(ops, frozenset()) == []
