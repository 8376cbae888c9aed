"""What the `tfserve bench` commands share: their common options, a result's table (and JSON file), and the
model a server serves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tfserve.cli.output import console, to_json, write_text

NumPromptsOpt = Annotated[int, typer.Option("--num-prompts", "-n", min=1, help="Requests to send.")]
OutputJsonOpt = Annotated[Path | None, typer.Option("--output-json", "-o", help="Write the result as JSON here.")]
DatasetOpt = Annotated[Path | None, typer.Option("--dataset", help="JSONL ({'prompt': ...}) or ShareGPT file.")]


def show_result(result: dict, title: str, output_json: Path | None, settings: dict | None = None) -> None:
    """Print `result`'s table; write it (with the run's `settings`) to `output_json` if given."""
    from tfserve.bench.report import result_table

    console.print(result_table(result, title))
    if output_json is not None:
        write_text(output_json, to_json({**result, "settings": settings}))


def served_model(base_url: str, api_key: str, model: str | None, chat: bool = True) -> str:
    """The model to send, checked before any load as `tfserve chat` checks it (GET /v1/models with the key):
    `model` where the server serves it, else the first chat model it lists. A refused key, a URL that is no
    OpenAI-compatible server, a model it does not serve (`chat`: or a speech-to-text one) are one line."""
    from tfserve.chat.client import RemoteBackend

    backend = RemoteBackend(base_url, api_key=api_key, model=model, timeout=30.0)
    try:
        return backend.connect(chat=chat, need_models=True).model
    finally:
        backend.close()
