"""Option types shared by the subcommands (`serve`, `chat`, `bench`, `models`), in one place."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from tfserve.models.registry import DEFAULT_MODEL


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Quantization(str, Enum):
    none = "none"
    bnb_4bit = "bnb-4bit"
    bnb_8bit = "bnb-8bit"


def _complete_model(incomplete: str) -> list[str]:
    from tfserve.models.store import completion_names

    return [name for name in completion_names() if name.startswith(incomplete)]


LOAD = "Model loading"

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Store name, local HF directory, local .gguf file, or a hub id already in the local HF cache.",
        autocompletion=_complete_model,
        rich_help_panel=LOAD,
    ),
]
DtypeOpt = Annotated[
    Dtype,
    typer.Option("--dtype", help="Weights dtype; auto is float32 on CPU, bfloat16 on CUDA.", rich_help_panel=LOAD),
]
DeviceOpt = Annotated[
    str,
    typer.Option("--device", help="auto, cpu, cuda or cuda:N.", rich_help_panel=LOAD),
]
QuantizationOpt = Annotated[
    Quantization,
    typer.Option("--quantization", "-q", help="bitsandbytes runtime quantization.", rich_help_panel=LOAD),
]
AttnImplementationOpt = Annotated[
    str | None,
    typer.Option(
        "--attn-implementation",
        help="Attention kernel for the model (e.g. sdpa, eager); default: tfserve's paged attention when serving.",
        rich_help_panel=LOAD,
    ),
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Allow custom modelling code from the model's directory.", rich_help_panel=LOAD),
]

__all__ = [
    "DEFAULT_MODEL",
    "AttnImplementationOpt",
    "DeviceOpt",
    "Dtype",
    "DtypeOpt",
    "ModelOpt",
    "Quantization",
    "QuantizationOpt",
    "TrustRemoteCodeOpt",
]
