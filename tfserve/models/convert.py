"""Convert a GGUF file into an ordinary Hugging Face model directory (config.json, safetensors, tokenizer).

transformers dequantizes a GGUF on load, but refuses to `save_pretrained` the result; so the model is
rebuilt from its config (without the GGUF `quantization_config`, else every HF tool would reload the
directory as a GGUF-quantized model) and given the loaded state dict.
"""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from pathlib import Path

from tfserve.errors import ModelStoreError, first_line
from tfserve.models.catalog import recommend_sampling


def gguf_to_hf(gguf_path: Path, out_dir: Path, *, show_hf_progress: bool = True,
               sampling: dict[str, float] | None = None) -> None:
    """Write `gguf_path` as a float32 HF model directory `out_dir` (created; must not exist), with
    `sampling` (the model's recommended temperature, top_p...) in its generation_config.json."""
    from tfserve.models.gguf_reader import serving_gguf_readers

    with hf_progress_bars(enabled=show_hf_progress), serving_gguf_readers():
        _convert(gguf_path, out_dir, sampling or {})


@contextmanager
def hf_progress_bars(enabled: bool):
    """Turn transformers' own tqdm bars off while a caller shows its own progress."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    if enabled:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    # the GGUF dequantizing bar is a bare tqdm that ignores transformers' switch
    gguf_tqdm = gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _convert(gguf_path: Path, out_dir: Path, sampling: dict[str, float]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, fname = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        config = AutoConfig.from_pretrained(src, gguf_file=fname)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        # gguf and transformers raise several kinds on a damaged or unsupported file
        raise ModelStoreError(f"cannot read GGUF {fname}: {first_line(exc)}") from None

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    recommend_sampling(model.generation_config, sampling)
    del gguf_model

    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    for file in out_dir.iterdir():  # safetensors are written 0600; a store may be shared
        file.chmod(0o644)
    _check_saved(out_dir, had_chat_template=bool(tokenizer.chat_template))


def _check_saved(out_dir: Path, had_chat_template: bool) -> None:
    """The saved directory must reload as a plain float32 model with its chat template."""
    from transformers import AutoTokenizer

    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise ModelStoreError(f"conversion left a quantization_config in {out_dir / 'config.json'}")
    if config.get("dtype") != "float32":
        raise ModelStoreError(f"conversion saved dtype {config.get('dtype')!r}, expected float32")
    if had_chat_template and not AutoTokenizer.from_pretrained(out_dir).chat_template:
        raise ModelStoreError(f"the chat template was lost saving the tokenizer to {out_dir}")
