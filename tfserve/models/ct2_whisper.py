"""Convert a CTranslate2 Whisper model (`model.bin`, as faster-whisper ships it) into a transformers
`WhisperForConditionalGeneration` directory: config, safetensors, generation config, processor, tokenizer.

Reads the CTranslate2 file with numpy alone (no ctranslate2 dependency). Its layout, version 6: a u32 binary
version, the spec name and a u32 revision, then each variable as name, u8 rank, u32 dims, u8 dtype, u32 byte
count and the raw bytes, then an alias table (alias name -> variable name). Strings are a u16 length and
NUL-terminated bytes.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from tfserve.errors import ModelStoreError

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # bfloat16 (5) not needed
MAX_INITIAL_TIMESTAMP_INDEX = 50  # as openai-whisper and HF's generation configs
NUM_TIMESTAMP_TOKENS = 1501  # <|0.00|> .. <|30.00|> in steps of 0.02 s


def read_ct2(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """The spec name (e.g. "WhisperSpec") and the variables of a CTranslate2 model.bin, aliases resolved."""
    data = Path(path).read_bytes()
    offset = 0

    def take(fmt: str):
        nonlocal offset
        values = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def take_string() -> str:
        nonlocal offset
        length = take("H")
        text = data[offset:offset + length].rstrip(b"\0").decode()
        offset += length
        return text

    try:
        version = take("I")
        if version != 6:
            raise ModelStoreError(f"{path}: CTranslate2 binary version {version}, expected 6")
        spec = take_string()
        take("I")  # spec revision
        variables = {}
        for _ in range(take("I")):
            name = take_string()
            rank = take("B")
            dims = [take("I") for _ in range(rank)]
            dtype_id = take("B")
            num_bytes = take("I")
            if dtype_id not in CT2_DTYPES:
                raise ModelStoreError(f"{path}: variable {name} has unsupported CTranslate2 dtype {dtype_id}")
            array = np.frombuffer(data, CT2_DTYPES[dtype_id], num_bytes // np.dtype(CT2_DTYPES[dtype_id]).itemsize,
                                  offset)
            variables[name] = array.reshape(dims)
            offset += num_bytes
        for _ in range(take("I")):
            alias, target = take_string(), take_string()
            variables[alias] = variables[target]
    except (struct.error, ValueError, KeyError) as exc:  # truncated file, bad sizes, dangling alias
        raise ModelStoreError(f"cannot read CTranslate2 model {path}: {exc}") from None
    return spec, variables


def hf_state_dict(variables: dict[str, np.ndarray], dtype=np.float32) -> dict[str, np.ndarray]:
    """CTranslate2 WhisperSpec variables -> the state dict of WhisperForConditionalGeneration (proj_out is
    tied to the decoder's token embedding, so it is left out)."""
    out: dict[str, np.ndarray] = {}
    get = lambda name: np.asarray(variables[name], dtype=dtype)  # noqa: E731

    def copy(dst: str, src: str) -> None:
        out[dst + ".weight"] = get(src + "/weight")
        out[dst + ".bias"] = get(src + "/bias")

    def layer_norm(dst: str, src: str) -> None:
        out[dst + ".weight"] = get(src + "/gamma")
        out[dst + ".bias"] = get(src + "/beta")

    def split(dsts: list[str], src: str) -> None:
        """A fused projection: rows split evenly; HF's k_proj has no bias (CTranslate2 stores zeros)."""
        weights = np.split(get(src + "/weight"), len(dsts))
        biases = np.split(get(src + "/bias"), len(dsts))
        for dst, weight, bias in zip(dsts, weights, biases):
            out[dst + ".weight"] = weight
            if dst.endswith("k_proj"):
                if np.any(bias):
                    raise ModelStoreError(f"{src}: the key bias is not zero; not a Whisper layout")
            else:
                out[dst + ".bias"] = bias

    for side in ("encoder", "decoder"):
        out[f"model.{side}.embed_positions.weight"] = get(f"{side}/position_encodings/encodings")
        layer_norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        for i in range(num_layers(variables, side)):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            attn = f"{dst}.self_attn"
            split([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], f"{src}/self_attention/linear_0")
            copy(f"{attn}.out_proj", f"{src}/self_attention/linear_1")
            layer_norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
            copy(f"{dst}.fc1", f"{src}/ffn/linear_0")
            copy(f"{dst}.fc2", f"{src}/ffn/linear_1")
            layer_norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
            if side == "decoder":
                cross = f"{dst}.encoder_attn"
                copy(f"{cross}.q_proj", f"{src}/attention/linear_0")
                split([f"{cross}.k_proj", f"{cross}.v_proj"], f"{src}/attention/linear_1")
                copy(f"{cross}.out_proj", f"{src}/attention/linear_2")
                layer_norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
    for i in (1, 2):
        copy(f"model.encoder.conv{i}", f"encoder/conv{i}")
    out["model.decoder.embed_tokens.weight"] = get("decoder/embeddings/weight")
    return out


def num_layers(variables: dict[str, np.ndarray], side: str) -> int:
    """How many `{side}/layer_N` blocks the model has."""
    return len({m.group(1) for name in variables if (m := re.match(rf"{side}/layer_(\d+)/", name))})


def whisper_config(variables: dict[str, np.ndarray], tokens: dict[str, int]) -> dict:
    """WhisperConfig fields from the CTranslate2 variables' shapes and the tokenizer's special token ids."""
    d_model = variables["decoder/embeddings/weight"].shape[1]
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "vocab_size": variables["decoder/embeddings/weight"].shape[0],
        "num_mel_bins": variables["encoder/conv1/weight"].shape[1],
        "d_model": d_model,
        "encoder_layers": num_layers(variables, "encoder"),
        "decoder_layers": num_layers(variables, "decoder"),
        "encoder_attention_heads": int(variables["encoder/num_heads"]),
        "decoder_attention_heads": int(variables["decoder/num_heads"]),
        "encoder_ffn_dim": variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        "decoder_ffn_dim": variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        "max_source_positions": variables["encoder/position_encodings/encodings"].shape[0],
        "max_target_positions": variables["decoder/position_encodings/encodings"].shape[0],
        "activation_function": "gelu",
        "scale_embedding": bool(variables.get("decoder/scale_embeddings", 0)),
        "tie_word_embeddings": True,
        "bos_token_id": tokens["<|endoftext|>"],
        "eos_token_id": tokens["<|endoftext|>"],
        "pad_token_id": tokens["<|endoftext|>"],
        "decoder_start_token_id": tokens["<|startoftranscript|>"],
        "dtype": "float32",
    }


def generation_config(config: dict, tokens: dict[str, int], ct2_config: dict) -> dict:
    """generation_config.json for Whisper: start/end/no-timestamps ids, suppressed tokens (from the
    CTranslate2 model's config.json) and, for a multilingual vocabulary, its language and task ids."""
    is_multilingual = config["vocab_size"] >= 51865  # the English-only vocabularies have one token less
    gen = {
        "decoder_start_token_id": tokens["<|startoftranscript|>"],
        "bos_token_id": tokens["<|endoftext|>"],
        "eos_token_id": tokens["<|endoftext|>"],
        "pad_token_id": tokens["<|endoftext|>"],
        "no_timestamps_token_id": tokens["<|notimestamps|>"],
        "prev_sot_token_id": tokens["<|startofprev|>"],
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin", [])),
        "is_multilingual": is_multilingual,
        "max_initial_timestamp_index": MAX_INITIAL_TIMESTAMP_INDEX,
        "max_length": config["max_target_positions"],
        "return_timestamps": False,
    }
    if ct2_config.get("alignment_heads"):
        gen["alignment_heads"] = ct2_config["alignment_heads"]
    if is_multilingual:
        names = {token_id: token for token, token_id in tokens.items()}
        gen["lang_to_id"] = {names[i]: i for i in ct2_config.get("lang_ids", []) if i in names}
        gen["task_to_id"] = {"transcribe": tokens["<|transcribe|>"], "translate": tokens["<|translate|>"]}
        # generate() with no task then detects the language and transcribes (without it the prompt has no task
        # token and the text comes out cut short); OpenAI's HF checkpoints say this with forced_decoder_ids
        gen["task"] = "transcribe"
    return gen


def whisper_tokenizer_json(tokenizer: dict, vocab_size: int) -> dict:
    """faster-whisper's tokenizer.json made whole for transformers: its added tokens marked special and the
    1501 timestamp tokens added right after <|notimestamps|>, filling the vocabulary."""
    added = tokenizer["added_tokens"]
    for token in added:
        token["special"] = True
    first = next(t["id"] for t in added if t["content"] == "<|notimestamps|>") + 1
    if first + NUM_TIMESTAMP_TOKENS != vocab_size or any(t["id"] >= first for t in added):
        raise ModelStoreError(f"the tokenizer's ids do not leave room for {NUM_TIMESTAMP_TOKENS} timestamp tokens "
                              f"from {first} in a vocabulary of {vocab_size}")
    added += [{"id": first + i, "content": f"<|{i * 0.02:.2f}|>", "single_word": False, "lstrip": False,
               "rstrip": False, "normalized": False, "special": False} for i in range(NUM_TIMESTAMP_TOKENS)]
    return tokenizer


def ct2_whisper_to_hf(src_dir: Path, out_dir: Path) -> None:
    """Write the CTranslate2 Whisper model in `src_dir` (model.bin, tokenizer.json, config.json) as a float32
    transformers directory `out_dir` (created; must not exist) with its processor and tokenizer."""
    import torch
    from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizer)

    src_dir = Path(src_dir)
    spec, variables = read_ct2(src_dir / "model.bin")
    if spec != "WhisperSpec":
        raise ModelStoreError(f"{src_dir / 'model.bin'} is a CTranslate2 {spec}, not a WhisperSpec")
    try:
        tokenizer_json = json.loads((src_dir / "tokenizer.json").read_text())
        ct2_config = json.loads((src_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelStoreError(f"cannot read the CTranslate2 model's JSON files: {exc}") from None
    tokens = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    config = whisper_config(variables, tokens)
    gen = generation_config(config, tokens, ct2_config)
    # config.json keeps copies too; WhisperConfig's defaults are the English-only ones (begin 50256)
    config |= {"suppress_tokens": gen["suppress_tokens"], "begin_suppress_tokens": gen["begin_suppress_tokens"]}

    model = WhisperForConditionalGeneration(WhisperConfig(**config)).eval()
    state = {name: torch.from_numpy(array) for name, array in hf_state_dict(variables).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"proj_out.weight"}:
        raise ModelStoreError(f"CTranslate2 -> HF weights do not match: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(**gen)

    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer_file = out_dir / "tokenizer.json"
    tokenizer_file.write_text(json.dumps(whisper_tokenizer_json(tokenizer_json, config["vocab_size"])))
    tokenizer = WhisperTokenizer(tokenizer_file=str(tokenizer_file), unk_token="<|endoftext|>")
    feature_extractor = WhisperFeatureExtractor(feature_size=config["num_mel_bins"], sampling_rate=16_000)
    WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(out_dir)
    for file in out_dir.iterdir():  # safetensors are written 0600; a store may be shared
        file.chmod(0o644)
