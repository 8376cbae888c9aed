"""Whether bfloat16 linear layers run on the CPU's AMX tiles (csrc/amx.h), decided once per process at run time.

AMX is used only when all of these hold, checked in this order; the first that fails is the reason it is not:
the CPU has it (`amx_tile` and `amx_bf16` in /proc/cpuinfo); `TFSERVE_AMX` is not 0; the build has the tile code
(a new enough compiler on x86-64 Linux: `ops.amx`); Linux grants this process the tile data state
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: per process, so granted here before any thread runs AMX
code); and a probe, a small AMX GEMM against float64 sums, run in a forked child so that a crash there leaves this
process standing, exits 0 with matching results. The probe's verdict is kept beside the kernels' build (its
directory's key covers the CPU's features and the source), so later starts do not fork again.

The tile code was written without AMX hardware to run it on: the probe is what vouches for it on each machine.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import platform
import signal
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
_XFEATURE_XTILEDATA = 18
_PROBE_TOLERANCE = 1e-4  # float32 sums of 71 products against float64: ~1e-6 relative
_PROBE_TIMEOUT_S = 10.0
_VERDICT = "amx-probe"  # the probe's verdict, in the kernels' build directory: "ok" or why not


@dataclass(frozen=True, slots=True)
class AmxDecision:
    """Whether AMX runs the bfloat16 linear layers, and why (or why not) in words for the log."""

    enabled: bool
    reason: str


_decisions: dict[str, AmxDecision] = {}  # by kernels module name: what `decide` found for it in this process


def decide(ops, features: frozenset[str], cache_dir: Path | None = None) -> AmxDecision:
    """Check everything AMX needs (the module's docstring) for the kernels `ops` on a CPU of `features`
    (kernels.cpu_features); turn it on there when all hold. Never raises: any failure is the reason AMX stays off.
    `cache_dir`: where the probe's verdict is kept (the kernels' build directory)."""
    decision = _check(ops, features, cache_dir)
    if ops is not None and hasattr(ops, "use_amx"):
        ops.use_amx(decision.enabled)
        _decisions[ops.__name__] = decision
    return decision


def decision_for(ops) -> AmxDecision | None:
    """What `decide` found for the kernels `ops` in this process (None: not asked, e.g. a build for another -march)."""
    return _decisions.get(getattr(ops, "__name__", ""))


def _check(ops, features: frozenset[str], cache_dir: Path | None) -> AmxDecision:
    for flag in ("amx_bf16", "amx_tile"):
        if flag not in features:
            return AmxDecision(False, f"no AMX: CPU lacks {flag}")
    if os.environ.get("TFSERVE_AMX", "1").strip().lower() in ("0", "false", "no", "off"):
        return AmxDecision(False, "AMX present but turned off (TFSERVE_AMX=0)")
    if ops is None or not getattr(ops, "amx", False):
        return AmxDecision(False, "AMX present but this build of the kernels has no tile code (needs bfloat16 dot "
                                  "products and GCC 11+ or clang 12+ on x86-64 Linux)")
    refused = tile_permission_error()
    if refused is not None:
        return AmxDecision(False, f"AMX present but tile permission refused: {refused}")
    failure = _probe_verdict(ops, cache_dir)
    if failure is not None:
        return AmxDecision(False, f"AMX present but its probe failed: {failure}")
    return AmxDecision(True, "AMX-BF16 tiles for bfloat16 linear layers (probe passed)")


def request_tile_permission() -> bool:
    """Ask Linux for this process's AMX tile data state; True when granted (or already held). Safe anywhere: False
    on a CPU without AMX, another OS or architecture, or where the call is filtered."""
    return tile_permission_error() is None


def tile_permission_error() -> str | None:
    """None once this process holds the AMX tile state (asked for if need be), else why not: EINVAL or EOPNOTSUPP
    without AMX or on a kernel before 5.16, ENOSPC where a thread's signal stack is too small for the tile state."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        held = ctypes.c_ulong(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(held)) == 0 and \
                held.value >> _XFEATURE_XTILEDATA & 1:
            return None
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0:
            return None
        errno = ctypes.get_errno()
        return f"arch_prctl(ARCH_REQ_XCOMP_PERM) failed: {os.strerror(errno)} (errno {errno})"
    except (OSError, AttributeError) as exc:  # no libc to call through
        return f"arch_prctl unavailable ({exc})"


def _probe_verdict(ops, cache_dir: Path | None) -> str | None:
    """None when the probe passes (now or in an earlier start with this build on this CPU), else why not."""
    path = cache_dir / _VERDICT if cache_dir is not None else None
    try:
        if path is not None and path.is_file():
            verdict = path.read_text().strip()
            return None if verdict == "ok" else f"{verdict} (kept in {path})"
    except OSError:
        pass
    verdict, conclusive = _run_probe(ops)
    if path is not None and conclusive:
        try:
            path.write_text((verdict or "ok") + "\n")
        except OSError as exc:  # the next start probes again: slower, not wrong
            logger.debug("cannot keep the AMX probe's verdict in %s (%s)", path, exc)
    if verdict is not None:
        logger.warning("AMX probe failed (%s); bfloat16 linear layers stay on AVX512-BF16", verdict)
    return verdict


def _run_probe(ops) -> tuple[str | None, bool]:
    """Run `ops.amx_probe()` in a forked child: (None, True) when it matched, else (why not, whether that is
    conclusive enough to keep). The child touches no thread pool (the probe is one thread of plain C++) and leaves
    by os._exit, so the parent's threads and buffers are left alone."""
    try:
        pid = os.fork()
    except OSError as exc:
        return f"cannot fork a child to probe in ({exc})", False
    if pid == 0:  # the child
        code = 3
        try:
            faulthandler.disable()  # a SIGILL here is an answer, not a crash to trace on the parent's stderr
            code = 0 if ops.amx_probe() < _PROBE_TOLERANCE else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + _PROBE_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"the probe did not finish in {_PROBE_TIMEOUT_S:.0f} s", False
        time.sleep(0.01)
    if os.WIFSIGNALED(status):
        return f"the probe was killed by {signal.Signals(os.WTERMSIG(status)).name}", True
    code = os.WEXITSTATUS(status)
    if code == 0:
        return None, True
    if code == 1:
        return f"AMX results differ from float64 sums by more than {_PROBE_TOLERANCE:g}", True
    return f"the probe raised in the child (exit {code})", True
