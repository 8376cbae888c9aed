"""The CPU kernels without torch (neon_harness/harness.cpp): every GGUF block type (decode and prompt roads,
dequantized rows), the float32/float16/bfloat16 panels and the attention tiles against scalar references written
from ggml's block formats. Built for this CPU (on x86 also the AVX2 and plain C++ builds, slow) and cross-compiled
for aarch64, run under qemu-aarch64: the NEON path, which no machine here runs natively. The aarch64 builds skip
where `aarch64-linux-gnu-g++` or `qemu-aarch64` is missing (Debian: g++-aarch64-linux-gnu, qemu-user)."""

import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "neon_harness"
CSRC = Path(__file__).parents[2] / "tfserve" / "engine" / "csrc"
# kernels.py's flags (no fused multiply-add the source does not ask for: the references are bit for bit) at -O1,
# a third of -O3's compile time; the slow builds take -O3, as kernels.py does
FLAGS = ["-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd",
         "-DTFS_NO_TORCH=1", f"-I{HARNESS / 'shim'}", f"-I{CSRC}"]
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
# name -> (compiler, flags, the isa line it must print); the FAST two build side by side, the others are slow
BUILDS = {
    "native": ("g++", ["-O1", "-march=native"], None),
    "armv8.2-a+dotprod": (CROSS, ["-O1", "-march=armv8.2-a+dotprod", "-static"], "isa NEON"),
    "armv8-a -O3": (CROSS, ["-O3", "-march=armv8-a", "-static"], "isa NEON"),
    "x86-64-v3": ("g++", ["-O1", "-march=x86-64-v3"], "isa AVX2"),
    "x86-64": ("g++", ["-O1", "-march=x86-64"], "isa scalar"),
}
FAST = ("native", "armv8.2-a+dotprod")


def _missing(name: str) -> str | None:
    """Why the build `name` cannot run here, or None."""
    compiler = BUILDS[name][0]
    if shutil.which(compiler) is None:
        return f"{compiler} not on PATH" + (" (Debian: g++-aarch64-linux-gnu)" if compiler == CROSS else "")
    if compiler == CROSS and shutil.which(QEMU) is None:
        return f"{QEMU} not on PATH (Debian: apt-get install qemu-user)"
    if compiler == "g++" and name != "native" and platform.machine() != "x86_64":
        return "the AVX2 and plain C++ builds are tested on x86-64"
    if name == "x86-64-v3" and " avx2" not in Path("/proc/cpuinfo").read_text():
        return "this CPU has no AVX2"
    return None


def _build(name: str, directory: Path) -> Path:
    compiler, flags, _ = BUILDS[name]
    exe = directory / name.replace(" ", "_")
    result = subprocess.run([compiler, *FLAGS, *flags, str(HARNESS / "harness.cpp"), "-o", str(exe)],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return exe


@pytest.fixture(scope="module")
def fast_builds(tmp_path_factory):
    """The two fast builds, compiled side by side (one core each): name -> executable, or the reason it is missing."""
    directory = tmp_path_factory.mktemp("kernel_harness")
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(_build, name, directory) for name in FAST if _missing(name) is None}
        return {name: futures[name].result() if name in futures else _missing(name) for name in FAST}


def _run(name: str, exe: Path) -> None:
    command = [QEMU, str(exe)] if BUILDS[name][0] == CROSS else [str(exe)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and " 0 failed" in output, output[-4000:]
    expected = BUILDS[name][2]
    assert expected is None or output.startswith(expected), output.splitlines()[0]


@pytest.mark.parametrize("name", FAST)
def test_kernels_against_references(name, fast_builds):
    built = fast_builds[name]
    if isinstance(built, str):
        pytest.skip(built)
    _run(name, built)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in BUILDS if name not in FAST])
def test_other_builds_against_references(name, tmp_path):
    """Plain ARMv8-A (no dot product, no float16 arithmetic) at kernels.py's -O3; on x86 the AVX2 and plain C++
    paths."""
    if (why := _missing(name)) is not None:
        pytest.skip(why)
    _run(name, _build(name, tmp_path))
