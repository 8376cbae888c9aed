"""The kernel builds the kernel tests run against: this CPU's, the plain C++ one, and on an AVX-512 machine the
AVX2 one (the path most laptops run, which this CPU would otherwise never test) and the AVX-512 CPUs without
bfloat16 dot products: with VNNI (Cascade Lake, Ice Lake: the integer road's group pairs, the prompt road in
float32) and without (Skylake-X), where this CPU has what they need."""

import platform

import pytest

# what each older AVX-512 target needs of this CPU (/proc/cpuinfo's names)
_AVX512_TARGETS = {"skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
                   "cascadelake": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}}


def kernel_build(march: str):
    from tfserve.engine import kernels

    if march == "native":
        ops = kernels.cpu_ops()
        if ops is None:
            pytest.skip("CPU kernels unavailable here (no compiler or TFSERVE_CPU_KERNELS=0)")
        return ops
    if platform.machine() != "x86_64":
        pytest.skip("the plain C++ and AVX2 builds are tested on x86-64")
    if march == "x86-64-v3":
        if kernels.isa() != "AVX-512":
            pytest.skip("an AVX2 CPU tests its AVX2 build as its own (native)")
        ops = kernels.build(march)
        assert ops.isa == "AVX2"
        return ops
    if march in _AVX512_TARGETS:
        if not _AVX512_TARGETS[march] <= kernels.cpu_features():
            pytest.skip(f"this CPU cannot run a {march} build")
        ops = kernels.build(march)
        assert ops.isa == "AVX-512" and not ops.bf16_dot
        return ops
    ops = kernels.build(march)
    assert ops.isa == "scalar"
    return ops
