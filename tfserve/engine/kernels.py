"""Optional C++ kernels for CPU, compiled once on first use and cached under `$TFSERVE_HOME/kernels/`
(`$TFSERVE_KERNELS_DIR` moves them).

The build (about a minute on 2 cores) lands in a directory named by a key over everything that shapes the
binary: the source, the compiler and its flags, torch's and Python's versions and environment, and the CPU's
instruction-set features (the build uses `-march=native`); the source is compiled from a copy inside that
directory. Two installs or checkouts on one machine share a build when they
agree and never overwrite each other's when they do not.

`EngineConfig.cpu_kernels` (default from `TFSERVE_CPU_KERNELS`) turns them off; when the compiler is missing
or the build fails, the engine says so once and keeps to its pure-torch paths: the same results, except that linear layers of 2+ rows then
use F.linear (equally accurate, other rounding; see cpu_linear.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from tfserve.errors import first_line

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCE = _CSRC / "cpu_ops.cpp"  # the one translation unit; it includes the headers beside it
# -fopenmp compiles at::parallel_for to OpenMP, but we link no OpenMP runtime of our own: the symbols resolve
# to the one torch ships, so there is one thread pool, not two fighting.
# -fno-math-errno lets exp() vectorise (glibc's libmvec); results stay within float rounding.
# -ffp-contract=off: no fused multiply-adds the source does not ask for, so the rotary embedding rounds
# exactly as transformers' separate ops do.
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
# instruction sets the kernels have paths for, best first, as /proc/cpuinfo names them
_ISAS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"), ("neon", "NEON"))


@cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features`); empty where /proc/cpuinfo is not there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def isa() -> str:
    """The widest vector instruction set the kernels use on this CPU: AVX-512, AVX2, NEON or scalar."""
    features = cpu_features()
    return next((name for flag, name in _ISAS if flag in features), "scalar")


def _march(march: str | None = None) -> str:
    """The target CPU: `march`, else `$TFSERVE_KERNELS_MARCH`, else "native" (this CPU's every feature;
    "x86-64-v3" builds AVX2 code that runs on any AVX2 machine, "x86-64" plain C++)."""
    return march or os.environ.get("TFSERVE_KERNELS_MARCH") or "native"


def _cflags(march: str | None = None) -> list[str]:
    return [*_CFLAGS, f"-march={_march(march)}"]


@cache
def cache_key(march: str | None = None) -> str:
    """What the build depends on, hashed: source, compiler and flags, torch, Python, machine and CPU features."""
    import torch

    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    # sys.prefix: each environment writes its own include paths into torch's build.ninja, and a build.ninja
    # that changes makes torch rebuild, so two venvs sharing one directory would rebuild each other's
    parts = [*_cflags(march), os.environ.get("CXX", "c++"), torch.__version__, sys.version, sys.prefix,
             platform.machine(), *sorted(cpu_features())]
    digest.update("\0".join(parts).encode())
    return digest.hexdigest()[:16]


def build_dir(march: str | None = None) -> Path:
    """Where this machine's build of the kernels lives: under `$TFSERVE_KERNELS_DIR`, default
    `$TFSERVE_HOME/kernels`."""
    from tfserve.models.store import home

    root = os.environ.get("TFSERVE_KERNELS_DIR") or home() / "kernels"
    return Path(root).expanduser() / f"cpu_ops-{cache_key(march)}"


def _module_name(march: str | None = None) -> str:
    return f"tfserve_cpu_ops_{cache_key(march)}"


def _is_built(directory: Path, march: str | None = None) -> bool:
    return (directory / f"{_module_name(march)}.so").is_file()


def needs_build() -> bool:
    """True when the kernels are not built for this machine yet (the next `cpu_ops()` compiles)."""
    return not cpu_ops.cache_info().currsize and not _is_built(build_dir())


_beside: threading.Thread | None = None  # a build `start_building` began that no one has waited for yet


def start_building() -> None:
    """Start the first-run build now, beside what the caller does next (a model's pull and load, mostly one core
    of Python while the compiler takes another); `build_with_progress` waits for it."""
    global _beside
    if _beside is None and needs_build():
        _beside = threading.Thread(target=cpu_ops, name="tfserve-kernel-build", daemon=True)
        _beside.start()


def build_with_progress(report) -> None:
    """Build the kernels now if this machine has none yet (or wait for the build `start_building` began), telling
    `report` first (the one slow stage of a first load: a caller shows it as its own step)."""
    global _beside
    beside, _beside = _beside, None
    if beside is not None:
        report(f"Building tfserve's CPU kernels for {isa()} (first run only, started beside the load)")
        beside.join()
    elif needs_build():
        report(f"Building tfserve's CPU kernels for {isa()} (first run only, about a minute)")
    cpu_ops()


@cache
def cpu_ops():
    """The compiled module for this CPU (`paged_decode_attention`, `linear`, ...), or None where it cannot be
    built. Whether its bfloat16 linear layers run on AMX tiles is decided here, once (amx.py)."""
    try:
        module = build()
    except Exception as exc:  # no compiler, no ninja, odd platform: the torch path serves
        logger.warning("CPU kernels unavailable (%s); using the torch paths", first_line(exc))
        return None
    from tfserve.engine import amx

    amx.decide(module, cpu_features(), build_dir())  # AMX tiles or not, now, before any thread runs a kernel
    return module


def build(march: str | None = None):
    """Compile (once; later calls load the cached build) and load the kernels for `march` (see `_march`)."""
    directory = build_dir(march)
    module = _load_built(directory, march)
    if module is not None:
        return _checked(module, march)
    from torch.utils.cpp_extension import load

    fresh = not _is_built(directory, march)
    if fresh:
        logger.info("building tfserve's CPU kernels for %s into %s (first run on this machine and install; "
                    "about a minute)", isa() if _march(march) == "native" else _march(march), directory)
    directory.mkdir(parents=True, exist_ok=True)
    source = _source_copy(directory)
    start = time.perf_counter()
    with _builder(directory):
        module = load(name=_module_name(march), sources=[str(source)], extra_cflags=_cflags(march),
                      build_directory=str(directory), verbose=False)
        _mark_built(directory, march)
    if fresh:
        logger.info("CPU kernels built in %.0f s", time.perf_counter() - start)
    return _checked(module, march)


def _checked(module, march: str | None):
    if module.isa == "scalar" and _march(march) == "native":
        logger.warning("tfserve's CPU kernels have no vector path for this CPU (%s); they run as plain C++",
                       platform.machine())
    logger.debug("CPU kernels: %s (%s)", module.isa, build_dir(march))
    return module


_BUILT = "built.ok"  # the .so's size, mtime and inode, written once torch's `load` has loaded it


def _so_identity(so: Path) -> str:
    stat = so.stat()
    return f"{stat.st_size} {stat.st_mtime_ns} {stat.st_ino}"


def _mark_built(directory: Path, march: str | None) -> None:
    try:
        (directory / _BUILT).write_text(_so_identity(directory / f"{_module_name(march)}.so"))
    except OSError as exc:  # the next start loads through torch again: slower, not wrong
        logger.debug("cannot mark the kernels in %s built (%s)", directory, first_line(exc))


def _load_built(directory: Path, march: str | None):
    """The kernels this user's process built and loaded before (`_mark_built`: the very .so, whole), imported
    straight from the file, or None. torch's `load` would import setuptools, ask the compiler its version and
    run ninja to learn that nothing changed (the key in the folder's name covers all of that): a few tenths of
    a second of every start. Only files this user owns that no one else may write are loaded so."""
    import importlib.util

    so = directory / f"{_module_name(march)}.so"
    try:
        if (directory / _BUILT).read_text() != _so_identity(so):
            return None
        if any(p.stat().st_uid != os.getuid() or p.stat().st_mode & 0o022 for p in (directory, so)):
            return None
        spec = importlib.util.spec_from_file_location(_module_name(march), so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError, AttributeError) as exc:  # no mark yet, a .so that will not load, no os.getuid
        # (Windows): torch's `load` decides
        logger.debug("CPU kernels in %s: loading through torch (%s)", directory, first_line(exc))
        return None


@contextmanager
def _builder(directory: Path) -> Iterator[None]:
    """This process alone builds or loads in `directory`, under a lock the OS drops when the process ends.
    torch's own lock is a file (`lock`) that a process killed part-way through a build (Ctrl-C during a first
    `tfserve serve`) leaves behind, and every later start waited on it for ever; holding this lock, no live
    builder can own that file, so a leftover one is removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(directory / "build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _source_files() -> list[Path]:
    return sorted(p for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def _source_copy(directory: Path) -> Path:
    """The sources, copied into the build directory: torch writes the source's path into build.ninja, so
    building from each checkout's own files would make two checkouts rebuild each other's kernels."""
    for path in _source_files():
        copy = directory / path.name
        if not copy.is_file():  # the key covers the content: a copy there is this very source
            tmp = directory / f".{path.name}.{os.getpid()}"
            tmp.write_bytes(path.read_bytes())
            tmp.replace(copy)
    return directory / _SOURCE.name
