"""Which instructions each path of the CPU kernels runs on this machine, for the startup log, the banner and /metrics
(`tfserve_kernel_path_info{path, isa}`).

The table is read from what the compiled module says it has (`matmul_paths` names the units, as the banner and
`tfserve_matmul_unit_info` do; `bf16_dot`, `vnni`, `amx`, `amx_active()`:
-march=native, the compiler's version and TFSERVE_KERNELS_MARCH all shape it), never guessed from the CPU's flags;
the flags only add a note where the CPU has a better unit the kernels do not use, and why (amx.py's reason for AMX).
"""

from __future__ import annotations

from tfserve.engine import amx

AMX_BF16 = "AMX-BF16 (TDPBF16PS)"


def matmul_unit_names(ops) -> dict[str, str]:
    """The module's `matmul_paths` (float32, float16, bfloat16, int8 -> the instructions that multiply them) as
    they run now: bfloat16 on AMX tiles where amx.py turned them on. Empty without the kernels."""
    units = dict(getattr(ops, "matmul_paths", None) or {})
    if units and getattr(ops, "amx_active", lambda: False)():
        units["bfloat16"] = AMX_BF16
    return units


def block_units(ops) -> tuple[str, str]:
    """What multiplies GGUF blocks and int8 weights (quant.h): decode rows in int8 dot products, prompt rows over
    the dequantized weight, in bfloat16 dot products where the build has them (EngineLinear.prompt_dot: AMX
    tiles where amx.py turned them on), else float32 FMA. ("", "") without the kernels."""
    units = matmul_unit_names(ops)
    if not units:
        return "", ""
    prompt = units["bfloat16"] if getattr(ops, "bf16_dot", False) else units["float32"]
    return units["int8"], prompt


def kernel_paths(ops) -> dict[str, str]:
    """Kernel path -> the instructions it runs on, for the kernels `ops` (empty without them: torch's own paths).
    The names are the module's own (`matmul_unit_names`, what the banner and `tfserve_matmul_unit_info` say)."""
    units = matmul_unit_names(ops)
    if not units:
        return {}
    decode, prompt = block_units(ops)
    return {
        "linear float32": units["float32"],
        "linear float16": units["float16"],
        "linear bfloat16": units["bfloat16"],
        "quantized blocks (decode rows)": decode,  # Q4_0/Q4_1/Q5_x/Q8_0/K-quants and int8
        "quantized blocks (prompt rows)": f"{prompt} (dequantized)",
        "attention float32": units["float32"],
        # --dtype bfloat16 and block weights (a GGUF's, int8) round a prompt's q, k, v to bfloat16 for the dot
        # products where the build has them (lean.py's prompt_dot)
        "prompt attention bfloat16": ops.matmul_paths["bfloat16"] if getattr(ops, "bf16_dot", False) else units["float32"],
    }


def unused_units(ops, features: frozenset[str]) -> list[str]:
    """Why a unit the CPU has (`features`: kernels.cpu_features) is not one the kernels `ops` use, one note each."""
    if ops is None:
        return []
    notes = []
    if "avx512f" in features and ops.isa not in ("AVX-512",):
        notes.append(f"AVX-512 present but the kernels are built for {ops.isa} (TFSERVE_KERNELS_MARCH?)")
    if "avx512_bf16" in features and not getattr(ops, "bf16_dot", False):
        notes.append("AVX512-BF16 present but not in this build of the kernels")
    if {"avx512_vnni", "avx_vnni"} & features and not getattr(ops, "vnni", ""):
        notes.append("VNNI present but not in this build of the kernels")
    if {"amx_tile", "amx_bf16"} <= features and not getattr(ops, "amx_active", lambda: False)():
        decision = amx.decision_for(ops)
        notes.append(decision.reason if decision is not None else "AMX present but not decided for these kernels")
    return notes


def describe(paths: dict[str, str], notes: list[str]) -> str:
    """The one log line: "CPU kernel paths: linear float32: AVX-512 FMA, ...", then the notes."""
    if not paths:
        return "CPU kernel paths: none (the CPU kernels are off or unavailable; torch's paths run)"
    line = "CPU kernel paths: " + ", ".join(f"{path}: {isa}" for path, isa in paths.items())
    return line + "".join(f"; {note}" for note in notes)
