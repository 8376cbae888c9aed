"""The `tfserve` command line: one Typer app (`tfserve.cli.root`), one module per subcommand.

This module stays light: a shell's TAB after `--model` is answered from the model store before Typer and the
commands are imported (`tfserve.cli.completion`); `app` is imported when first asked for.
"""

from __future__ import annotations

import errno
import os
import sys


def __getattr__(name: str):
    if name == "app":
        from tfserve.cli.root import app

        return app
    raise AttributeError(f"module 'tfserve.cli' has no attribute {name!r}")


def main() -> None:
    """Console-script entry point. What no command can catch ends here in one line at most: a Ctrl-C while the
    commands are imported (before Typer's own handler), and a stdout that cannot be written (a full disk), also
    when only the last flush finds it."""
    stdout = sys.stdout = _Stdout(sys.stdout or open(os.devnull, "w"))  # None: closed (`>&-`), printing nowhere
    try:
        try:
            _run()
        except KeyboardInterrupt:
            sys.exit(130)  # quietly, as Typer ends a command on Ctrl-C
        finally:
            sys.stdout.flush()  # here, where a failure can be told in one line, not in Python's exit-time warning
    except OSError:
        if stdout.failure is None:  # not stdout's: a bug, shown as one
            raise
        _output_failed(stdout.failure)
    except SystemExit as exc:
        _end_if_torch_work_abandoned(exc.code)
        _end_at_once_on_ctrl_c()
        raise
    _end_if_torch_work_abandoned(0)
    _end_at_once_on_ctrl_c()


def _end_at_once_on_ctrl_c() -> None:
    """What follows is the interpreter's teardown (atexit handlers: torch's, the work threads' stop): a Ctrl-C
    there (a second one after a server's drain) printed a KeyboardInterrupt traceback from whichever handler ran.
    It now ends the process at once, quietly."""
    import signal

    try:
        signal.signal(signal.SIGINT, lambda *_: _exit_now(130))
    except ValueError:  # not the main thread (an embedding caller): its own business
        pass


def _end_if_torch_work_abandoned(code) -> None:
    """End now, without the interpreter's teardown, where an interrupted model load still runs torch on a thread
    of its own (`tfserve.engine.threads.abandoned_torch_work`), or where this process was a tensor-parallel rank
    (a C++ thread of torch's distributed backend, still joinable, now and then aborted the teardown: -6, as the
    worker ranks saw, `engine/parallel/workers.py`): the teardown would abort the process."""
    threads = sys.modules.get("tfserve.engine.threads")
    tensor_parallel = sys.modules.get("tfserve.engine.parallel.tensor_parallel")
    if not ((threads is not None and threads.abandoned_torch_work())
            or (tensor_parallel is not None and tensor_parallel.joined())):
        return
    if isinstance(code, str):  # SystemExit's message, which the teardown would have printed
        print(code, file=sys.stderr)
    _exit_now(code if isinstance(code, int) else 0 if code is None else 1)


def _exit_now(code: int) -> None:
    """End the process with `code` without the interpreter's teardown, what was printed flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run() -> None:
    if "_TFSERVE_COMPLETE" in os.environ:
        from tfserve.cli.completion import answer_quickly

        answered = answer_quickly(os.environ)
        if answered is not None:
            text, exit_code = answered
            sys.stdout.write(text)
            sys.exit(exit_code)
        from tfserve.cli.completion import fix_zsh_quoting

        fix_zsh_quoting()
    from tfserve.cli.root import app

    app()


class _Stdout:
    """sys.stdout, remembering how a write or flush failed so `main` tells that from any other OSError."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.failure: OSError | None = None

    def write(self, text: str) -> int:
        return self._guarded(self.stream.write, text)

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except OSError as exc:
            self.failure = exc
            raise

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _output_failed(exc: OSError) -> None:
    """Exit 1 with one line on stderr (none for a closed pipe, the reader's choice, as Typer does); stdout then
    writes to /dev/null so the interpreter's last flush of what it still holds succeeds."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if exc.errno != errno.EPIPE:
        from tfserve.cli.output import error

        error(f"cannot write the output: {exc.strerror or exc}")
    sys.exit(1)
