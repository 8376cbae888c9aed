"""`tfserve serve --log-level`: tfserve's log lines on stderr, and transformers' level beside them."""

from __future__ import annotations

import logging
import os
import sys

import typer


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted, not the stream at setup: a test runner
    (or anything) that swaps stderr and closes the old one never gets "I/O on closed file"."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler sets it at init; the property decides
        pass


def configure_logging(level: str) -> None:
    """Send the "tfserve" logger's records to stderr at `level`; other than info, transformers' too."""
    numeric = logging.DEBUG if level == "detail" else logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise typer.BadParameter(f"unknown log level {level!r}", param_hint="--log-level")
    if numeric != logging.INFO:  # as transformers serve; at info (our default) transformers' chatter stays off
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(numeric)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("tfserve")
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    root.propagate = False
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
