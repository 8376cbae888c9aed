"""`transformers serve` command lines, unchanged, against `tfserve serve`.

Its flags are `serve`'s options (docs/transformers-serve.md says what each maps to); this module holds the
ones that only exist for that, and the two things click cannot do itself:
- `ServeCommand` reads transformers' spellings before click parses: `--max_num_seqs` is `--max-num-seqs`,
  a flag may carry a value (`--trust_remote_code true`), as transformers 4.x's argparse allowed, and `-q` is
  transformers' `--quiet` unless a quantization follows (tfserve's `-q VALUE`);
- `notes` says, in one line each, what a flag that changes nothing here would have done.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

COMPAT = "transformers serve compatibility"
_BOOLS = {"true": True, "t": True, "yes": True, "y": True, "1": True,
          "false": False, "f": False, "no": False, "n": False, "0": False}


class ServeCommand(TyperCommand):
    """`tfserve serve`: arguments are normalised by `normalize_args` before click parses them; the words that
    follow a boolean flag are remembered (`flag_value_error`)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        params = self.get_params(ctx)
        args = normalize_args(params, args)
        ctx.meta[_AFTER_FLAG] = words_after_flags(params, args)
        return super().parse_args(ctx, args)


_AFTER_FLAG = "tfserve.words_after_flags"


def normalize_args(params: list, args: list[str]) -> list[str]:
    """transformers' spellings of this command's options -> ours. `--foo_bar[=V]` becomes `--foo-bar[=V]` when
    that is an option here; `--flag true|false` (or `--flag=false`) becomes `--flag`, its `--no-` form, or
    nothing; `-q` is `--quiet` unless a value `--quantization` takes follows it. Values are never touched: the
    token after an option that takes one is copied as it is, and everything after `--` too. Anything unknown is
    left for click to report."""
    options = _options(params)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg == "--":
            return [*out, arg, *args[i:]]
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name.startswith("--") and name not in options and name.replace("_", "-") in options:
            name = name.replace("_", "-")
        param = options.get(name)
        if param is None:
            out.append(arg)
        elif name == "-q" and not eq and "--quiet" in options and not _is_choice(param, args[i:i + 1]):
            out.append("--quiet")  # transformers' -q, a flag: tfserve's -q takes a quantization
        elif param.is_flag and not param.count:
            if not eq and i < len(args) and args[i].lower() in _BOOLS:  # --enable_cors true
                eq, value, i = "=", args[i], i + 1
            out += _flag(param, name, value) if eq and value.lower() in _BOOLS else [name + eq + value]
        else:
            out.append(name + eq + value)
            if not eq and i < len(args):  # the option's value, as it is
                out.append(args[i])
                i += 1
    return out


def _options(params: list) -> dict:
    """Each spelling of the command's options (`--max-num-seqs`, `--no-enable-cors`, `-q`) -> its parameter."""
    return {name: param for param in params if param.param_type_name == "option"
            for name in (*param.opts, *param.secondary_opts)}


def _is_choice(param, words: list[str]) -> bool:
    """Whether the first of `words` is one of the values `param` (a choice option) takes."""
    kind = getattr(param, "type_descriptor", None) or getattr(param, "type", None)  # typer's, or click's
    if not words or not getattr(kind, "choices", None):
        return False
    fold = (lambda text: text) if kind.case_sensitive else str.lower
    return fold(words[0]) in {fold(str(getattr(choice, "value", choice))) for choice in kind.choices}


def words_after_flags(params: list, args: list[str]) -> dict[str, str]:
    """`{word: flag}` for each word right after a boolean flag given without a value (`--enable-cors maybe`):
    click takes such a word for MODEL, as it should for `--enable-cors Qwen/Qwen3-1.7B`."""
    options = _options(params)
    found: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg == "--":
            break
        name, eq, _ = arg.partition("=")
        param = options.get(name)
        if param is None:
            continue
        if param.is_flag and not param.count:
            if not eq and i < len(args) and not args[i].startswith("-"):
                found.setdefault(args[i], name)
        elif not eq:
            i += 1  # the option's value
    return found


def flag_value_error(ctx, model_arg: str | None):
    """A UsageError where MODEL, which names no model, is the word right after a boolean flag: it was meant as
    the flag's value (`--enable_cors maybe`, as transformers 4.x took `--enable_cors true`); else None."""
    from tfserve.errors import UsageError

    flag = ctx.meta.get(_AFTER_FLAG, {}).get(model_arg) if model_arg is not None else None
    if flag is None:
        return None
    if flag == "--quiet":  # perhaps `-q VALUE` with a quantization tfserve does not know
        return UsageError(f"-q/--quiet takes no value, and -q VALUE is --quantization VALUE (none, int8, bnb-4bit, "
                          f"bnb-8bit): got {model_arg!r}, which names no model either")
    return UsageError(f"{flag} takes true or false, or no value (got {model_arg!r}, which names no model either)")


def _flag(param, name: str, value: str) -> list[str]:
    """A boolean flag given a value (`--enable_cors true`, `--no-compile=false`) -> what click parses."""
    truth = _BOOLS[value.lower()]
    if name in param.secondary_opts:  # --no-foo false is --foo
        truth, name = not truth, param.opts[0]
    if truth:
        return [name]
    return [param.secondary_opts[0]] if param.secondary_opts else []


ContinuousBatchingOpt = Annotated[bool | None, typer.Option(
    "--continuous-batching/--no-continuous-batching", show_default=False, rich_help_panel=COMPAT,
    help="Accepted: tfserve always batches continuously over a paged KV cache (--cb-* flags map to its options).")]
CbUseCudaGraphOpt = Annotated[bool | None, typer.Option(
    "--cb-use-cuda-graph/--no-cb-use-cuda-graph", show_default=False, rich_help_panel=COMPAT,
    help="--cuda-graph as transformers spells it.")]
DecisionConfigOpt = Annotated[str | None, typer.Option(
    metavar="PATH", show_default=False, rich_help_panel=COMPAT,
    help="Accepted with a note: tfserve has no /v1/systemone endpoint to configure.")]


class OutputFormat(str, Enum):
    """transformers' `--format` (huggingface_hub's CLI output modes)."""

    auto = "auto"
    human = "human"
    agent = "agent"
    json = "json"
    quiet = "quiet"


# transformers' "Formatting options" (huggingface_hub's, on every command): serve writes no tables or IDs, so
# only quiet means something here
FormatOpt = Annotated[OutputFormat | None, typer.Option(
    "--format", metavar="FORMAT", show_default=False, rich_help_panel=COMPAT,
    help="auto, human, agent, json or quiet. quiet: the same as --quiet; json, agent, human: accepted with a note "
         "(serve prints a banner and log lines, nothing to format).")]
JsonOpt = Annotated[bool, typer.Option(
    "--json", rich_help_panel=COMPAT, help="--format json: accepted with a note.")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", rich_help_panel=COMPAT,
    help="Fewer log lines: --log-level warning (no access line per request) unless --log-level is given. -q "
         "too, unless a quantization follows it (-q bnb-4bit is --quantization).")]
NoTruncateOpt = Annotated[bool, typer.Option(
    "--no-truncate", rich_help_panel=COMPAT, help="Accepted with a note: serve prints no tables to truncate.")]
# transformers 4.x's flags: accepted, not shown in --help (docs/transformers-serve.md lists them)
InputValidationOpt = Annotated[bool, typer.Option(
    "--input-validation", hidden=True, help="Accepted with a note: tfserve always validates requests.")]
NonBlockingOpt = Annotated[bool, typer.Option(
    "--non-blocking", hidden=True, help="Accepted with a note (transformers' test hook).")]
LoadIn4bitOpt = Annotated[bool, typer.Option("--load-in-4bit", hidden=True, help="--quantization bnb-4bit.")]
LoadIn8bitOpt = Annotated[bool, typer.Option("--load-in-8bit", hidden=True, help="--quantization bnb-8bit.")]
Bnb4bitQuantTypeOpt = Annotated[str | None, typer.Option(
    "--bnb-4bit-quant-type", hidden=True, help="Accepted with a note: bitsandbytes' default 4-bit type is used.")]
UseBnbNestedQuantOpt = Annotated[bool, typer.Option(
    "--use-bnb-nested-quant", hidden=True, help="Accepted with a note: no nested quantization.")]
TorchDtypeOpt = Annotated[str | None, typer.Option(
    "--torch-dtype", hidden=True, help="--dtype (transformers' deprecated spelling).")]


class Reasoning(str, Enum):
    on = "on"
    off = "off"
    auto = "auto"


def check_json_object(value: str | None) -> str | None:
    """--chat-template-kwargs: a JSON object, or one line saying what is wrong with it."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{value!r} is not JSON ({exc.msg} at column {exc.colno}); "
                                 "e.g. '{\"enable_thinking\": false}'") from None
    if not isinstance(parsed, dict):
        raise typer.BadParameter(f"{value!r} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return value


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline (as vLLM takes it); one line where it is
    neither or does not parse as Jinja."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value:  # no template syntax: a file name
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise typer.BadParameter(f"{path}: {reason} (give a template file, or the template itself)") from None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(value)
    except TemplateSyntaxError as exc:
        raise typer.BadParameter(f"not a Jinja template: {exc.message} (line {exc.lineno})") from None
    return value


def chat_template_kwargs(text: str | None, reasoning: Reasoning) -> dict[str, Any]:
    """The server's default chat template variables: --chat-template-kwargs, then --reasoning on|off as
    enable_thinking (as transformers serve does; auto leaves it to the template)."""
    kwargs = json.loads(text) if text else {}
    if reasoning != Reasoning.auto:
        kwargs["enable_thinking"] = reasoning == Reasoning.on
    return kwargs


def legacy_quantization(quantization: str, load_in_4bit: bool, load_in_8bit: bool) -> str:
    """transformers 4.x's --load-in-4bit / --load-in-8bit -> --quantization; one line when they disagree."""
    from tfserve.errors import UsageError

    wanted = {name for name, on in (("bnb-4bit", load_in_4bit), ("bnb-8bit", load_in_8bit)) if on}
    if quantization != "none":
        wanted.add(quantization)
    if len(wanted) > 1:
        raise UsageError(f"conflicting quantizations ({', '.join(sorted(wanted))}): give one --quantization")
    return wanted.pop() if wanted else "none"


def output_format(format_: OutputFormat | None, json_output: bool, quiet: bool) -> OutputFormat | None:
    """--format, --json and --quiet (-q) -> the one format they ask for, None when none is given; one line
    where they disagree (transformers refuses any two of them)."""
    from tfserve.errors import UsageError

    given = {flag: mode for flag, mode in ((f"--format {format_.value}" if format_ else "", format_),
                                           ("--json", OutputFormat.json if json_output else None),
                                           ("--quiet", OutputFormat.quiet if quiet else None)) if mode}
    if len(set(given.values())) > 1:
        raise UsageError(f"{' and '.join(given)} disagree: give one")
    return next(iter(given.values()), None)


def notes(values: dict[str, Any]) -> list[str]:
    """One line per accepted flag that changes nothing here, saying why. `values`: serve's parameters."""
    lines = []
    if values["continuous_batching"] is not None:
        lines.append("continuous batching is always on in tfserve"
                     + ("; --no-continuous-batching has no effect" if not values["continuous_batching"] else ""))
    if values["decision_config"]:
        lines.append("--decision-config has no effect: tfserve has no /v1/systemone endpoint")
    if values["input_validation"]:
        lines.append("--input-validation has no effect: tfserve always validates requests (400 naming the field)")
    if values["non_blocking"]:
        lines.append("--non-blocking has no effect: tfserve serves in the foreground")
    if values["bnb_4bit_quant_type"] or values["use_bnb_nested_quant"]:
        lines.append("--bnb-4bit-quant-type/--use-bnb-nested-quant have no effect: bnb-4bit uses bitsandbytes' "
                     "defaults")
    if values["output_format"] in (OutputFormat.json, OutputFormat.agent, OutputFormat.human):
        flag = "--json" if values["json_output"] else f"--format {values['output_format'].value}"
        lines.append(f"{flag} has no effect: tfserve serve prints a banner and log lines, nothing to format")
    if values["no_truncate"]:
        lines.append("--no-truncate has no effect: tfserve serve prints no tables to truncate")
    if values["model_timeout"] > 0 and values["force_model"]:
        lines.append("--model-timeout has no effect with a pinned model (MODEL or --force-model), as in "
                     "transformers serve")
    return lines
