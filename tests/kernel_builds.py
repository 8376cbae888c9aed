"""The kernel builds the kernel tests run against: this CPU's, the plain C++ one, and on an AVX-512 machine the
AVX2 one (the path most laptops run, which this CPU would otherwise never test)."""

import platform

import pytest


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
    ops = kernels.build(march)
    assert ops.isa == "scalar"
    return ops
