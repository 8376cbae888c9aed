"""How a benchmark result was made, saved in it under "settings": the command and every option it ran with,
the date, tfserve's version and the machine that ran `tfserve bench`."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

# options that say nothing about the run (where results go) or must not be written down (a key)
_LEFT_OUT = ("api_key", "output_json", "plot")


def run_settings(command: str, params: dict[str, Any], **resolved: Any) -> dict[str, Any]:
    """The "settings" of a `tfserve bench COMMAND` result: its options as given (`params`, click's
    `ctx.params`), what the run resolved them to (`resolved`: the model the server named, the engine's
    backend...), when, which tfserve, and where (`host`)."""
    options = {name: _plain(value) for name, value in params.items() if name not in _LEFT_OUT}
    return {"command": f"tfserve bench {command}", **options, **{k: _plain(v) for k, v in resolved.items()},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tfserve_version": _version(), "host": host()}


def host() -> dict[str, Any]:
    """The machine running `tfserve bench` (for `bench serve` the client, which is the server's machine only
    with --launch or a local URL): OS, architecture, CPU model and the CPUs this process may use, the widest
    vector instruction set of the CPU (what tfserve's CPU kernels use), Python's version, and torch's and the
    GPU's where torch is loaded."""
    from tfserve.engine.kernels import isa

    info: dict[str, Any] = {
        "os": platform.system(), "arch": platform.machine(), "cpu": _cpu_name(),
        "num_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "isa": isa(), "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")  # loaded by an in-process run; never imported here for a client's run
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or None


def _version() -> str:
    from tfserve import __version__

    return __version__


def _plain(value: Any) -> Any:
    """JSON's kinds: an option's enum as its value, a path as text."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
