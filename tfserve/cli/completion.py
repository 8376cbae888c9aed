"""Shell completion of model names: each option offers the names it takes without a pull, and a TAB after
`--model` is answered before Typer loads.

Typer answers a TAB by building the whole app (every command's parameters) and resolving the command line,
most of a second; a model name needs one directory listing. So `tfserve.cli.main` asks `answer_quickly`
first, which knows the few places a model name goes (`MODEL_OPTIONS`, `NAME_ARGUMENTS`) and answers them in
the shells' completion protocol exactly as Typer would (the completion scripts in completions/ call it); it
returns None for anything else (commands, options, other values, PowerShell), which Typer then answers. The
same functions are the options' Typer `autocompletion` callbacks, so both paths offer the same names.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping


def chat_models(incomplete: str) -> list[str]:
    """Models in the store that generate text (`serve`, `chat`, `bench offline` load these; speech models no)."""
    from tfserve.models import store

    return [name for name in _stored_names() if name.startswith(incomplete) and not store.is_speech_model(name)]


def speech_models(incomplete: str) -> list[str]:
    """Speech models `transcribe` takes by name: those in the store, and the catalog's (pulled on first use)."""
    from tfserve.models import catalog, store

    names = {name for name in _stored_names() if name.startswith(incomplete) and store.is_speech_model(name)}
    names |= {name for name in catalog.known_names() if catalog.get_known(name).task == "speech"}
    return sorted(name for name in names if name.startswith(incomplete))


def stored_models(incomplete: str) -> list[str]:
    """Every model in the store (`models info`, `models rm`)."""
    return [name for name in _stored_names() if name.startswith(incomplete)]


def _stored_names() -> list[str]:
    """The store's names; none where $TFSERVE_HOME is no folder (a TAB offers nothing; the command says why)."""
    from tfserve.errors import ModelStoreError
    from tfserve.models import store

    try:
        return store.stored_names()
    except ModelStoreError:
        return []


def known_models(incomplete: str) -> list[str]:
    """The catalog's models (`models pull`)."""
    from tfserve.models import catalog

    return [name for name in catalog.known_names() if name.startswith(incomplete)]


def choices(*values: str) -> Callable[[str], list[str]]:
    """A completer offering `values`: for an option that takes a few words and is checked in the command (its
    help lists them), where a TAB would otherwise offer file names."""

    def complete(incomplete: str) -> list[str]:
        return [value for value in values if value.startswith(incomplete)]

    return complete


Completer = Callable[[str], list[str]]
# command -> what its --model/-m takes (commands left out, such as `bench serve`, name a server's model)
MODEL_OPTIONS: dict[tuple[str, ...], Completer] = {
    ("serve",): chat_models, ("chat",): chat_models, ("bench", "offline"): chat_models,
    ("transcribe",): speech_models, ("bench", "transcribe"): speech_models,
}
# command -> what its one argument, NAME, takes (their options are flags, so NAME is the word that is no option)
NAME_ARGUMENTS: dict[tuple[str, ...], Completer] = {
    ("models", "info"): stored_models, ("models", "rm"): stored_models, ("models", "pull"): known_models,
}
_GROUPS = ("bench", "models")
_SHELLS = {"complete_bash": "bash", "complete_zsh": "zsh", "complete_fish": "fish"}


def answer_quickly(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """Typer's reply to the completion request in `environ` where it asks for a model name: (what to print,
    exit code); None where Typer has to answer."""
    shell = _SHELLS.get(environ.get("_TFSERVE_COMPLETE", ""))
    if shell is None:
        return None
    try:
        args, incomplete = _completion_args(shell, environ)
    except (KeyError, ValueError):  # no COMP_WORDS, an open quote: Typer's way with them is its own
        return None
    completer, incomplete = model_completer(args, incomplete)
    if completer is None:
        return None
    names = completer(incomplete)
    if shell == "fish":
        if environ.get("_TYPER_COMPLETE_FISH_ACTION") == "is-args":
            return "", 0 if names else 1  # 0: complete these values (not files)
        return "\n".join(names) + "\n", 0
    if shell == "zsh":
        lines = "\n".join(f'"{_zsh_escape(name)}"' for name in names)
        return (f"_arguments '*: :(({lines}))'\n" if names else "_files\n"), 0
    return "\n".join(names) + "\n", 0


def model_completer(args: list[str], incomplete: str) -> tuple[Completer | None, str]:
    """What completes `incomplete` after the words `args` (the program's name left out) where that is a model
    name, and the part of it to complete; (None, incomplete) elsewhere."""
    if incomplete.startswith("--model="):  # zsh and fish keep `--model=NAME` one word
        args, incomplete = [*args, "--model"], incomplete.removeprefix("--model=")
    if args and args[-1] == "=":  # bash splits `--model=NAME` at the `=`
        args = args[:-1]
    if incomplete == "=":
        incomplete = ""
    if incomplete.startswith("-") or not args:
        return None, incomplete
    command = tuple(args[:2] if args[0] in _GROUPS else args[:1])
    rest = args[len(command):]
    if rest and rest[-1] in ("-m", "--model"):
        return MODEL_OPTIONS.get(command), incomplete
    if command in NAME_ARGUMENTS and all(word.startswith("-") for word in rest):
        return NAME_ARGUMENTS[command], incomplete
    return None, incomplete


def _completion_args(shell: str, environ: Mapping[str, str]) -> tuple[list[str], str]:
    """The words before the one being completed, and that one (as Typer's completion classes read them)."""
    if shell == "bash":
        words = shlex.split(environ["COMP_WORDS"])
        index = int(environ["COMP_CWORD"])
        return words[1:index], words[index] if index < len(words) else ""
    line = environ.get("_TYPER_COMPLETE_ARGS", "")
    args = shlex.split(line)[1:]
    if args and not line.endswith(" "):
        return args[:-1], args[-1]
    return args, ""


def _zsh_escape(text: str) -> str:
    """`text` as an item of the `_arguments '*: :((...))'` line zsh evaluates: Typer's escapes, but an apostrophe
    closes, escapes and reopens the single quotes (Typer doubles it, which zsh reads as no apostrophe at all:
    "the model's directory" showed as "the models directory")."""
    return (text.replace('"', '""').replace("'", "'\\''").replace("$", "\\$").replace("`", "\\`")
            .replace(":", r"\\:"))


def fix_zsh_quoting() -> None:
    """Make Typer's zsh completion (options and their help) quote apostrophes as `_zsh_escape` does: its class is
    looked up by name when the app registers its completion classes, so a subclass put under that name serves."""
    from typer import _completion_classes as classes

    if getattr(classes.ZshComplete, "fixed_by_tfserve", False):
        return

    class ZshComplete(classes.ZshComplete):
        fixed_by_tfserve = True

        def format_completion(self, item) -> str:
            value = f'"{_zsh_escape(item.value)}"'
            return f'{value}:"{classes._sanitize_help_text(_zsh_escape(item.help))}"' if item.help else value

    classes.ZshComplete = ZshComplete
