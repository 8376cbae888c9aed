"""Option types shared by the subcommands (`serve`, `chat`, `bench`, `models`), in one place."""

from __future__ import annotations

import importlib.util
from enum import Enum
from typing import Annotated

import typer

from tfserve.cli.completion import chat_models
from tfserve.models.catalog import DEFAULT_MODEL


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Quantization(str, Enum):
    none = "none"
    int8 = "int8"
    bnb_4bit = "bnb-4bit"
    bnb_8bit = "bnb-8bit"


LOAD = "Model loading"

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Store name, local HF directory, local .gguf file, or a hub id already in the local HF cache.",
        autocompletion=chat_models,
        rich_help_panel=LOAD,
    ),
]
DtypeOpt = Annotated[
    Dtype,
    typer.Option("--dtype", help="Weights dtype; auto on CPU: a .gguf model's own quantized blocks, a checkpoint "
                                  "stored in bfloat16 as bfloat16 where the CPU has bfloat16 dot products, else "
                                  "float32; bfloat16 on CUDA. On CPU float16 stores the weights in 16 bits and "
                                  "computes in float32; bfloat16 multiplies bfloat16 inputs with float32 sums where "
                                  "the CPU has the dot products (AVX512-BF16, AMX), else as float16.",
                 rich_help_panel=LOAD),
]
DeviceOpt = Annotated[
    str,
    typer.Option("--device", help="auto, cpu, cuda or cuda:N.", rich_help_panel=LOAD),
]
QuantizationOpt = Annotated[
    Quantization,
    typer.Option("--quantization", "-q", help="int8: weight-only int8 (Q8_0 blocks; CPU kernels, bitsandbytes on "
                                                "CUDA); bnb-4bit/bnb-8bit: bitsandbytes.", rich_help_panel=LOAD),
]
# transformers' attention names -> what tfserve runs: its own paged attention (SDPA over the KV block cache)
# serves every model; flash_attention_2 swaps in flash-attn's kernel over the same cache.
PAGED_ATTENTION_NAMES = ("paged", "sdpa", "eager", "paged|sdpa", "paged|eager", "sdpa_paged", "eager_paged",
                         "paged_attention", "tfserve_paged")
FLASH_ATTENTION_NAMES = ("flash_attention_2", "paged|flash_attention_2", "flash_paged")


def attn_implementation(value: str | None) -> str | None:
    """--attn-implementation -> what the loader asks transformers for: None (tfserve's paged attention) or
    "flash_attention_2"; one line saying what works for a name tfserve cannot serve."""
    if value is None:
        return None
    name = value.strip().lower()
    if name in PAGED_ATTENTION_NAMES:
        if name not in ("paged", "tfserve_paged"):
            from tfserve.cli.output import err_console

            err_console.print(f"[cyan]Note:[/] --attn-implementation {value}: tfserve serves with its paged "
                              "attention (SDPA over the KV block cache), which this maps to", highlight=False,
                              soft_wrap=True)
        return None
    if name in FLASH_ATTENTION_NAMES:
        if importlib.util.find_spec("flash_attn") is None:
            raise typer.BadParameter(
                f"{value} needs the flash-attn package (pip install flash-attn --no-build-isolation) and a CUDA "
                "GPU; leave it unset (or pass sdpa) for tfserve's paged attention, which runs everywhere")
        return "flash_attention_2"
    raise typer.BadParameter(f"tfserve cannot serve with {value!r}: use sdpa (default: tfserve's paged attention; "
                             "eager and paged|sdpa map to it too) or flash_attention_2 (flash-attn, CUDA)")


AttnImplementationOpt = Annotated[
    str | None,
    typer.Option(
        "--attn-implementation",
        help="Attention: default (or sdpa, eager, paged|sdpa) is tfserve's paged attention over the KV block "
             "cache; flash_attention_2 uses flash-attn's kernel over the same cache (CUDA, float16/bfloat16).",
        callback=attn_implementation,
        rich_help_panel=LOAD,
    ),
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code/--no-trust-remote-code",
                 help="Allow custom modelling code from the model's directory.", rich_help_panel=LOAD),
]

__all__ = [
    "DEFAULT_MODEL",
    "AttnImplementationOpt",
    "DeviceOpt",
    "Dtype",
    "DtypeOpt",
    "ModelOpt",
    "Quantization",
    "TensorParallelOpt",
    "CompileOpt",
    "CudaGraphOpt",
    "QuantizationOpt",
    "TrustRemoteCodeOpt",
]

TensorParallelOpt = Annotated[
    int,
    typer.Option("--tensor-parallel-size", "-tp", min=1,
                 help="Split the model across this many ranks (processes over torch.distributed, on CPU: shared "
                      "memory within a machine, gloo across). Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, Gemma 3 "
                      "models. It is for models one machine cannot hold: on one machine it costs a little speed "
                      "(docs/deploy.md).",
                 rich_help_panel="Distributed"),
]

CudaGraphOpt = Annotated[
    bool | None,
    typer.Option("--cuda-graph/--no-cuda-graph", show_default=False,
                 help="Replay decode steps as CUDA graphs, one per bucket of batch sizes, captured on first use. "
                      "Default: on where the model is on a CUDA device; --no-cuda-graph runs every step eagerly "
                      "(docs/engine.md).",
                 rich_help_panel="Engine"),
]

CompileOpt = Annotated[
    bool,
    typer.Option("--compile/--no-compile",
                 help="torch.compile the model's own forward, for models the lean forward does not run (not "
                      "Llama/Mistral/Qwen2/Qwen3/SmolLM3/Phi-3/Gemma 3 in float32): one graph for every batch, weights "
                      "prepacked on CPU. Compiled at start: about 2 minutes for a 135M model on 2 cores "
                      "(docs/engine.md).",
                 rich_help_panel="Engine"),
]
