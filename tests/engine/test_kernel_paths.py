"""Which instructions each CPU kernel path runs on (engine/kernel_paths.py) and whether AMX tiles are chosen
(engine/amx.py). Any CPU runs these (AVX2-only, AVX-512, ARM): they check that the table agrees with what the
module exposes and that the AMX decision falls back with its reason, never fixed strings for one machine. No
AMX machine is at hand: the tile code itself is vouched for by its probe on one, not here."""

from __future__ import annotations

import os

import pytest
from kernel_builds import kernel_build

from tfserve.engine import amx
from tfserve.engine.kernel_paths import AMX_BF16, describe, kernel_paths, unused_units

AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16"})


@pytest.fixture(scope="module", params=["native", pytest.param("x86-64", marks=pytest.mark.slow)])
def ops(request):
    return kernel_build(request.param)


@pytest.fixture
def fresh_decisions(ops, monkeypatch):
    """Decisions a test fakes are forgotten after it, and AMX is set back as the process had it."""
    monkeypatch.setattr(amx, "_decisions", dict(amx._decisions))
    was_on = ops.amx_active()
    yield
    ops.use_amx(was_on)


def test_the_table_is_what_the_module_exposes(ops):
    paths = kernel_paths(ops)
    assert ops.isa in paths["linear float32"] or ops.isa == "scalar"
    assert paths["linear float32"] in paths["attention float32"] + paths["quantized blocks (prompt rows)"]
    if ops.amx_active():
        assert paths["linear bfloat16"] == AMX_BF16
    elif ops.bf16_dot:
        assert paths["linear bfloat16"] == ops.matmul_paths["bfloat16"] and "BF16" in paths["linear bfloat16"]
    else:
        assert paths["linear bfloat16"] == paths["linear float16"]  # widened to float32 in registers
    assert ("BF16" in paths["prompt attention bfloat16"]) == ops.bf16_dot
    # a GGUF file's prompt rows: dequantized, then the bfloat16 unit where there is one (AMX's where it is on)
    assert paths["quantized blocks (prompt rows)"].startswith(paths["linear bfloat16"] if ops.bf16_dot
                                                              else paths["linear float32"])
    int8 = paths["quantized blocks (decode rows)"]
    assert int8.startswith(ops.vnni) if ops.vnni else "VNNI" not in int8
    assert ops.vnni in ("", "AVX512-VNNI", "AVX-VNNI") and ops.amx in (True, False)
    if not ops.bf16_dot:
        assert not ops.amx  # the tile code reads the bfloat16 dot products' panels
    assert kernel_paths(None) == {} and "none" in describe({}, [])


def test_the_log_line_names_each_path_and_why_a_unit_is_unused(ops):
    from tfserve.engine.kernels import cpu_features

    line = describe(kernel_paths(ops), unused_units(ops, cpu_features()))
    assert line.startswith("CPU kernel paths: linear float32: ") and "\n" not in line
    for path, isa in kernel_paths(ops).items():
        assert f"{path}: {isa}" in line
    notes = unused_units(ops, AMX_FLAGS | {"avx512_vnni"})
    assert any(note.startswith("no AMX") or note.startswith("AMX present") for note in notes) != ops.amx_active()
    assert ("VNNI present but not in this build of the kernels" in notes) == (not ops.vnni)
    assert unused_units(ops, frozenset()) == []


def test_no_amx_on_a_cpu_without_it(ops, fresh_decisions):
    from tfserve.engine.kernels import cpu_features

    if {"amx_tile", "amx_bf16"} <= cpu_features():
        pytest.skip("this CPU has AMX")
    decision = amx.decide(ops, cpu_features())
    assert decision == amx.AmxDecision(False, "no AMX: CPU lacks amx_bf16")
    assert not ops.amx_active() and kernel_paths(ops)["linear bfloat16"] != AMX_BF16
    assert amx.decide(ops, frozenset({"amx_bf16"})).reason == "no AMX: CPU lacks amx_tile"


def test_the_permission_request_is_safe_anywhere():
    from tfserve.engine.kernels import cpu_features

    granted = amx.request_tile_permission()
    assert granted in (True, False)
    if "amx_tile" not in cpu_features():
        assert granted is False and amx.tile_permission_error()  # EINVAL/EOPNOTSUPP here: not raised


def test_faked_amx_flags_fall_back_with_the_reason(ops, fresh_decisions, monkeypatch, tmp_path):
    """Flags say AMX; then the switch, the build, the kernel's permission and the probe each refuse in turn."""
    monkeypatch.setenv("TFSERVE_AMX", "0")
    assert amx.decide(ops, AMX_FLAGS, tmp_path).reason == "AMX present but turned off (TFSERVE_AMX=0)"
    monkeypatch.delenv("TFSERVE_AMX")
    if not ops.amx:
        decision = amx.decide(ops, AMX_FLAGS, tmp_path)
        assert not decision.enabled and "has no tile code" in decision.reason
        return
    from tfserve.engine.kernels import cpu_features

    if "amx_tile" not in cpu_features():  # the real request, refused by this CPU's kernel
        decision = amx.decide(ops, AMX_FLAGS, tmp_path)
        assert not decision.enabled and decision.reason.startswith("AMX present but tile permission refused: ")
    monkeypatch.setattr(amx, "tile_permission_error", lambda: "arch_prctl(ARCH_REQ_XCOMP_PERM) failed: nope")
    decision = amx.decide(ops, AMX_FLAGS, tmp_path)
    assert decision == amx.AmxDecision(False, "AMX present but tile permission refused: arch_prctl("
                                              "ARCH_REQ_XCOMP_PERM) failed: nope")
    assert not ops.amx_active() and amx.decision_for(ops) == decision
    assert decision.reason in unused_units(ops, AMX_FLAGS)
    assert not list(tmp_path.iterdir())  # nothing probed, nothing kept


def test_a_probe_that_crashes_or_mismatches_leaves_amx_off(ops, fresh_decisions, monkeypatch, tmp_path):
    """Permission faked: on a CPU without AMX the probe's first tile instruction raises SIGILL in the child, which
    is the crash the fork is there for. This process stands, AMX stays off, the verdict is kept and read back."""
    from tfserve.engine.kernels import cpu_features

    if not ops.amx or {"amx_tile", "amx_bf16"} <= cpu_features():
        pytest.skip("needs the tile code in the build and a CPU without AMX to fault on it")
    monkeypatch.setattr(amx, "tile_permission_error", lambda: None)
    decision = amx.decide(ops, AMX_FLAGS, tmp_path)
    assert not decision.enabled and not ops.amx_active()
    assert decision.reason == "AMX present but its probe failed: the probe was killed by SIGILL"
    assert (tmp_path / "amx-probe").read_text().strip() == "the probe was killed by SIGILL"

    def no_fork():
        raise AssertionError("the kept verdict is read, not probed again")

    monkeypatch.setattr(os, "fork", no_fork)
    again = amx.decide(ops, AMX_FLAGS, tmp_path)
    assert not again.enabled and "killed by SIGILL (kept in" in again.reason
    # a probe whose numbers disagree, and one that passes: only the verdict file says so here
    (tmp_path / "amx-probe").write_text("AMX results differ from float64 sums by more than 0.0001\n")
    assert "differ" in amx.decide(ops, AMX_FLAGS, tmp_path).reason and not ops.amx_active()


def test_a_probe_verdict_of_ok_turns_the_tiles_on_and_the_table_says_so(ops, fresh_decisions, monkeypatch, tmp_path):
    """The switch itself, without running a tile instruction (nothing is multiplied while it is on)."""
    if not ops.amx:
        assert ops.use_amx(True) is False and not ops.amx_active()  # a build without tile code cannot be switched
        return
    monkeypatch.setattr(amx, "tile_permission_error", lambda: None)
    (tmp_path / "amx-probe").write_text("ok\n")
    decision = amx.decide(ops, AMX_FLAGS, tmp_path)
    try:
        assert decision.enabled and ops.amx_active()
        assert kernel_paths(ops)["linear bfloat16"] == AMX_BF16 and unused_units(ops, AMX_FLAGS) == []
        from tfserve.engine.cpu_linear import matmul_units

        assert matmul_units(["bfloat16", "float32"], ops)["bfloat16"] == AMX_BF16
    finally:
        ops.use_amx(False)


@pytest.mark.parametrize("tail", [0, 1, 4, 15])
def test_the_tile_configuration_keeps_tdpbf16ps_shapes(ops, tail):
    """Palette 1's 64 bytes as Intel documents them (palette_id, start_row, 14 zero bytes, 16 colsb words, 16 row
    bytes), and each TDPBF16PS the tiles run (C += A B on tmm0/1 with tmm2 x tmm3/4, and tmm5 x tmm6/7 for the
    last `tail` pairs) shaped as the instruction needs: A.colsb / 4 == B.rows, C.rows == A.rows, C.colsb == B.colsb."""
    import struct

    if not ops.amx:
        pytest.skip("this build has no AMX tile code")
    cfg = ops.amx_tile_config(tail)
    assert len(cfg) == 64 and cfg[0] == 1 and cfg[1:16] == bytes(15)
    colsb, rows = struct.unpack("<16H", cfg[16:48]), cfg[48:64]
    assert all(c <= 64 and c % 4 == 0 for c in colsb) and all(r <= 16 for r in rows)
    assert colsb[8:] == (0,) * 8 and rows[8:] == bytes(8)  # 8 tiles in palette 1
    products = [(0, 2, 3), (1, 2, 4)] + ([(0, 5, 6), (1, 5, 7)] if tail else [])
    for c, a, b in products:
        assert colsb[a] // 4 == rows[b] and rows[c] == rows[a] == 16 and colsb[c] == colsb[b] == 64
    assert rows[2] == 16 and colsb[2] == 64  # a whole step: 16 pairs
    assert (colsb[5], rows[6], rows[7]) == ((tail * 4, tail, tail) if tail else (0, 0, 0))  # unused tiles: 0
