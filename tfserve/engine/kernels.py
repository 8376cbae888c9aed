"""Optional C++ kernels for CPU, compiled once on first use (about 30 s) and cached by torch.

`TFSERVE_CPU_KERNELS=0` turns them off; when the compiler is missing or the build fails, the engine says
so once and keeps to its pure-torch paths: the same results, except that linear layers of 2+ rows then
use F.linear (equally accurate, other rounding; see cpu_linear.py).
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"


@cache
def cpu_ops():
    """The compiled module (`paged_decode_attention`, `rotary_embedding_`), or None where it is off or cannot be built."""
    if os.environ.get("TFSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.debug("building tfserve's CPU kernels (once; cached by torch)")
        return load(
            name="tfserve_cpu_ops",
            sources=[str(_SOURCE)],
            # -fopenmp compiles at::parallel_for to OpenMP, but we link no OpenMP runtime of our own: the
            # symbols resolve to the one torch ships, so there is one thread pool, not two fighting.
            # -fno-math-errno lets exp() vectorise (glibc's libmvec); results stay within float rounding.
            # -ffp-contract=off: no fused multiply-adds the source does not ask for, so the rotary embedding
            # rounds exactly as transformers' separate ops do.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                          "-ffp-contract=off"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, odd platform: the torch path serves
        logger.warning("CPU kernels unavailable (%s); using the torch paths", exc)
        return None
