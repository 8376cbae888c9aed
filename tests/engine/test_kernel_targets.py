"""The kernels build for the x86 CPUs this machine cannot run: Alder Lake's AVX2 with AVX-VNNI (the integer road's
256-bit VEX dot products, what client Intel and AMD chips without AVX-512 have) and Sapphire Rapids' AVX-512 with
bfloat16 dot products, VNNI and AMX tiles. Compiled with the flags kernels.py uses (at -O1: the same intrinsics
and target checks in a third of the time), and each object holds the instructions its path promises; what they compute is tested where a CPU runs them (test_gguf_block_kernels,
test_kernel_paths and amx.py's probe on an AMX machine)."""

import platform
import shutil
import subprocess
import sysconfig

import pytest

pytestmark = pytest.mark.slow

TARGETS = {
    "alderlake": ["{vex} vpdpbusd"],  # AVX-VNNI: the block kernels' decode rows
    "sapphirerapids": ["vpdpbusd", "vdpbf16ps", "tdpbf16ps"],  # AVX512-VNNI, AVX512-BF16, AMX-BF16 tiles
}


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_the_kernels_build_for_cpus_this_one_cannot_run(march, tmp_path):
    if platform.machine() != "x86_64" or shutil.which("c++") is None:
        pytest.skip("x86-64 targets, built with the system's c++")
    from torch.utils.cpp_extension import include_paths

    from tfserve.engine import kernels

    includes = [flag for path in [*include_paths(), sysconfig.get_paths()["include"]] for flag in ("-isystem", path)]
    obj = tmp_path / "cpu_ops.o"
    build = subprocess.run(["c++", *includes, "-DTORCH_EXTENSION_NAME=tfserve_target_check", "-fPIC", "-std=c++20",
                            *kernels._cflags(march), "-O1", "-c", str(kernels._CSRC / "cpu_ops.cpp"), "-o", str(obj)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the instructions back")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True).stdout
    for instruction in TARGETS[march]:
        assert instruction in code, f"{march}: no {instruction}"
