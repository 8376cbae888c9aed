"""`tfserve serve`'s embedding models: `--embedding-model NAME` beside the chat model, or `--model` of an encoder
alone; which of the two a command line means, checked before anything loads, and the banner's lines for them."""

from __future__ import annotations

from typing import Annotated

import typer

from tfserve.errors import ModelNotFoundError, TfserveError, UsageError

EMBEDDINGS = "Embeddings"

EmbeddingModelOpt = Annotated[str | None, typer.Option(
    metavar="NAME", show_default=False, rich_help_panel=EMBEDDINGS,
    help="Sentence-embedding model served on /v1/embeddings beside the chat model, loaded at start (pulled "
         "first if it is a catalog model the store lacks: all-minilm-l6-v2). A request's `model` picks it; "
         "--model of an embedding model serves it alone.")]


def is_embedding_model(spec: str) -> bool:
    """Whether `spec` names a sentence-embedding encoder: a catalog embedding model, or a folder holding one."""
    from tfserve.embeddings.pooling import is_embedding_dir
    from tfserve.models import catalog
    from tfserve.models.loading import resolve_model

    known = catalog.get_known(spec)
    if known is not None:
        return known.task == "embedding"
    try:
        resolved = resolve_model(spec)
    except ModelNotFoundError:
        return False
    return resolved.kind != "gguf" and is_embedding_dir(resolved.path)


def plan(spec: str, embedding_model: str | None) -> tuple[bool, str | None]:
    """(alone, the embedding model to load) for `--model spec` and `--embedding-model`: alone when `spec` itself
    is an encoder (no chat model is loaded). One line for an --embedding-model that is no encoder."""
    if is_embedding_model(spec):
        if embedding_model is not None and embedding_model != spec:
            raise UsageError(f"--model {spec} is an embedding model, served alone: --embedding-model "
                             f"{embedding_model} would be a second one; give one of them")
        return True, spec
    if embedding_model is not None and not is_embedding_model(embedding_model):
        from tfserve.models import catalog

        names = [name for name in catalog.known_names() if catalog.get_known(name).task == "embedding"]
        raise TfserveError(f"--embedding-model {embedding_model}: not a sentence-embedding model (a "
                           f"sentence-transformers folder, or an encoder such as BertModel); e.g. {', '.join(names)}")
    return False, embedding_model


def print_banner(state, url: str, has_api_key: bool) -> None:
    """The banner of a server of embedding models alone."""
    from rich.panel import Panel
    from rich.table import Table

    from tfserve.cli.output import console

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for line in banner_rows(state):
        table.add_row(*line)
    table.add_row("URL", f"{url}/v1/embeddings" + ("  (API key required)" if has_api_key else ""))
    console.print(Panel(table, title="tfserve serve (embeddings)", expand=False))
    console.print(f"Health: {url}/health   Metrics: {url}/metrics   Ctrl+C drains and stops.")


def banner_rows(state) -> list[tuple[str, str]]:
    """One row per served embedding model: its name, vector size, input limit and device."""
    rows = []
    for name, batcher in state.embeddings.loaded.items():
        encoder = batcher.encoder
        pooling = "+".join(encoder.pooling.modes) + (", normalized" if encoder.pooling.normalize else "")
        rows.append(("Embeddings", f"{name}: {encoder.dimensions} dimensions ({pooling}), inputs up to "
                                   f"{encoder.max_input_tokens} tokens, {encoder.device}"))
    return rows
