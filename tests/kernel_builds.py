"""The kernel builds the kernel tests run against: this CPU's, and the plain C++ one."""

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
        pytest.skip("the plain C++ build is tested on x86-64 (baseline x86-64 has no AVX2)")
    ops = kernels.build(march)
    assert ops.isa == "scalar"
    return ops
