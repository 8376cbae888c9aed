"""A GGUF file read natively: tfserve's reader against gguf-py's, the config and tokenizer cache, and the model
whose linear weights are placeholders for the file's blocks."""

from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest
import torch

from tfserve.models import gguf_native, gguf_tokenizer_cache
from tfserve.models.gguf_reader import GGUFFormatError, Reader, read
from tfserve.models.gguf_weights import is_native, is_placeholder
from tiny_gguf import HIDDEN, LAYERS, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_reader_reads_what_gguf_py_reads(tiny):
    ours, theirs = Reader(tiny), gguf.GGUFReader(str(tiny))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # gguf-py's own framing fields
            continue
        assert ours.fields[key].types == field.types
        assert ours.fields[key].contents() == field.contents(), key


@pytest.mark.parametrize("keep", [0, 7, 100, 4000])
def test_a_cut_file_is_a_format_error(tiny, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:keep])
    with pytest.raises(GGUFFormatError):
        Reader(cut)


def test_config_and_tokenizer_come_from_the_cache_on_a_second_load(tiny, home, monkeypatch):
    from transformers import AutoTokenizer

    config, tokenizer = gguf_native.load_config_and_tokenizer(tiny)
    assert config.hidden_size == HIDDEN and config.num_hidden_layers == LAYERS
    expected = AutoTokenizer.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    text = "hello world, the quick brown fox"
    assert tokenizer(text)["input_ids"] == expected(text)["input_ids"]
    assert tokenizer.chat_template == expected.chat_template

    def no_metadata_reads(*args, **kwargs):
        raise AssertionError("the metadata was read again")

    monkeypatch.setattr("transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint", no_metadata_reads)
    again, again_tokenizer = gguf_native.load_config_and_tokenizer(tiny)
    assert again.to_dict() == config.to_dict()
    # the config without its transformers class (its import is 1.2 s of a start): every attribute the same
    assert type(again).__name__ == type(config).__name__ and type(again).__module__ == gguf_native.__name__
    for name in dir(config):
        value = getattr(config, name)
        if not name.startswith("_") and not callable(value) and name not in ("per_layer_config", "base_model_pp_plan",
                                                                              "transformers_version"):
            assert getattr(again, name) == value, name
    assert again_tokenizer(text)["input_ids"] == expected(text)["input_ids"]
    assert again_tokenizer.chat_template == expected.chat_template
    # the tokenizer without its transformers class (importing it imports transformers.models: 0.6 s of a start)
    if type(tokenizer).__module__.startswith("transformers.models."):
        assert type(again_tokenizer).__name__ == type(tokenizer).__name__
        assert type(again_tokenizer).__module__ == gguf_tokenizer_cache.__name__

    # a pickle another user could have written is not loaded: the tokenizer files are read instead
    pickled = next(gguf_native.cache_root().iterdir()) / gguf_tokenizer_cache.PICKLED_TOKENIZER
    assert gguf_tokenizer_cache._pickled(pickled) is not None
    pickled.chmod(0o666)
    assert gguf_tokenizer_cache._pickled(pickled) is None
    assert gguf_native.load_config_and_tokenizer(tiny)[1](text)["input_ids"] == expected(text)["input_ids"]


def test_a_changed_file_is_read_again_and_the_cache_stays_bounded(tiny, home, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_native, "MAX_CACHED_FILES", 2)
    copies = []
    for i in range(4):
        copy = tmp_path / f"copy{i}.gguf"
        copy.write_bytes(tiny.read_bytes())
        gguf_native.load_config_and_tokenizer(copy)
        copies.append(copy)
    assert len([p for p in gguf_native.cache_root().iterdir() if p.is_dir()]) == 2


def test_the_model_holds_the_files_norms_and_no_linear_weight(tiny):
    from transformers import AutoModelForCausalLM

    config, _ = gguf_native.load_config_and_tokenizer(tiny)
    model = gguf_native.build_model(read(tiny), config)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny.parent), gguf_file=tiny.name, dtype=torch.float32)
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if name.endswith("_proj.weight") or "embed_tokens" in name or name == "lm_head.weight":
            assert is_placeholder(param), name
            assert param.untyped_storage().nbytes() == 4  # one float, seen through zero strides
        else:
            assert torch.equal(param, expected[name]), name
    assert is_native(model) and not is_native(reference)
    for name, buffer in model.named_buffers():  # the rotary tables are computed, not left empty
        assert buffer.device.type == "cpu"
        torch.testing.assert_close(buffer, dict(reference.named_buffers())[name])


def test_a_second_start_reads_the_norms_from_the_cache(tiny, home, monkeypatch):
    """The norms and biases as the first start processed them from the file's tensors, kept with its config."""
    config, _ = gguf_native.load_config_and_tokenizer(tiny)
    first = dict(gguf_native.build_model(read(tiny), config).named_parameters())

    def no_tensor_reads(*args, **kwargs):
        raise AssertionError("the file's norms were processed again")

    monkeypatch.setattr(gguf_native, "_small_tensors", no_tensor_reads)
    config, _ = gguf_native.load_config_and_tokenizer(tiny)
    again = dict(gguf_native.build_model(read(tiny), config).named_parameters())
    assert again.keys() == first.keys()
    for name, param in again.items():
        assert torch.equal(param, first[name]) and param.shape == first[name].shape, name


def test_a_cached_start_imports_no_model_package_of_transformers(tiny, home):
    """Importing `transformers.models` scans every model folder of transformers (0.6 s of a 2-core start): a
    start that finds the file cached reads its config, tokenizer and norms without it."""
    import subprocess
    import sys

    config, _ = gguf_native.load_config_and_tokenizer(tiny)
    gguf_native.build_model(read(tiny), config)  # the first start: everything cached
    code = ("import sys; from pathlib import Path; from tfserve.models import gguf_native; "
            "from tfserve.models.gguf_reader import read; path = Path(sys.argv[1]); "
            "config, tokenizer = gguf_native.load_config_and_tokenizer(path); "
            "gguf_native.build_model(read(path), config); tokenizer('hello world'); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models')))")
    result = subprocess.run([sys.executable, "-c", code, str(tiny)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_file_with_a_tensor_the_skeleton_has_no_place_for_is_built_from_its_class(tiny, tmp_path):
    """The module tree tfserve builds itself must hold every tensor of the file; where one has no place (a bias
    the architecture's skeleton lacks), the transformers class decides, as transformers' loader would."""
    import gguf as gguf_py

    config, _ = gguf_native.load_config_and_tokenizer(tiny)
    assert type(gguf_native.build_model(read(tiny), config)).__module__ == "tfserve.models.gguf_skeleton"
    reader = Reader(tiny)
    extra = tmp_path / "extra.gguf"
    writer = gguf_py.GGUFWriter(str(extra), "llama")
    for key, field in reader.fields.items():
        if key.startswith("general.architecture"):
            continue
        value = field.value
        kind = field.types[-1]
        if field.types[0] == gguf_py.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor("blk.0.attn_output.bias", np.zeros(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config, _ = gguf_native.load_config_and_tokenizer(extra)
    model = gguf_native.build_model(read(extra), config)
    assert type(model).__module__.startswith("transformers.models.llama")
    assert is_native(model)


def _as_architecture(source, path, arch: str, extra: dict):
    """`source` (a llama file) written again as llama.cpp writes `arch` like Llama: its `llama.*` keys under
    `arch`, with `extra` keys over them."""
    import gguf as gguf_py

    reader = Reader(source)
    writer = gguf_py.GGUFWriter(str(path), arch)
    keys = {key.replace("llama.", f"{arch}.", 1): field for key, field in reader.fields.items()
            if key != "general.architecture"}
    for key, field in keys.items():
        if key in extra:
            continue
        if field.types[0] == gguf_py.GGUFValueType.ARRAY:
            writer.add_array(key, field.value)
        else:
            writer.add_key_value(key, field.value, field.types[-1])
    for key, value in extra.items():
        writer.add_key_value(key, value, gguf_py.GGUFValueType.STRING if isinstance(value, str) else
                             gguf_py.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf_py.GGUFValueType.UINT32)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_smollm3_file_is_read_with_llamas_keys(tiny, tmp_path):
    """transformers' GGUF mapping has no smollm3, which llama.cpp writes with Llama's keys (tfserve maps it,
    tfserve.models.gguf_config): a Llama's config as a SmolLM3Config, rotary left out of every fourth layer (llama.cpp's
    own fixed rule, no key), its YaRN scaling; the tokenizer transformers converts for the Llama file; read once."""
    yarn = {"smollm3.rope.scaling.type": "yarn", "smollm3.rope.scaling.factor": 2.0,
            "smollm3.rope.scaling.original_context_length": 128}
    smol = _as_architecture(tiny, tmp_path / "smol.gguf", "smollm3", {"smollm3.block_count": 8, **yarn})
    llama, llama_tokenizer = gguf_native.load_config_and_tokenizer(tiny)
    for _ in range(2):  # from the metadata, then from the cache
        config, tokenizer = gguf_native.load_config_and_tokenizer(smol)
        assert type(config).__name__ == "SmolLM3Config"
        assert gguf_native.architecture_class(config) == "SmolLM3ForCausalLM"
        for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "rms_norm_eps", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                      "eos_token_id"):
            assert getattr(config, field) == getattr(llama, field), field
        assert config.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
        assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": llama.rope_parameters["rope_theta"],
                                          "factor": 2.0, "original_max_position_embeddings": 128}
        text = "hello world, the quick brown fox"
        assert tokenizer(text)["input_ids"] == llama_tokenizer(text)["input_ids"]
        assert tokenizer.chat_template == llama_tokenizer.chat_template


def test_the_cached_tokenizer_is_the_fresh_one(tiny, home):
    """Every start after the first serves with the cached tokenizer: it encodes, decodes, names its tokens and
    renders the chat template exactly as the tokenizer read from the file's metadata does."""
    import json

    from transformers import AutoTokenizer

    from tfserve.server.api.logprobs import _is_byte_level

    fresh = AutoTokenizer.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    gguf_native.load_config_and_tokenizer(tiny)  # the first start: read from the metadata, cached
    _, cached = gguf_native.load_config_and_tokenizer(tiny)
    texts = ["hello world, the quick brown fox", "  two  spaces\nand a line", "émoji 🦊 and 中文", ""]
    for text in texts:
        for special in (True, False):
            assert cached.encode(text, add_special_tokens=special) == fresh.encode(text, add_special_tokens=special)
        ids = fresh.encode(text)
        for skip in (True, False):
            assert cached.decode(ids, skip_special_tokens=skip) == fresh.decode(ids, skip_special_tokens=skip)
    everything = list(range(len(fresh)))
    assert cached.convert_ids_to_tokens(everything) == fresh.convert_ids_to_tokens(everything)
    assert (cached.all_special_tokens, cached.eos_token_id, cached.bos_token_id) == \
        (fresh.all_special_tokens, fresh.eos_token_id, fresh.bos_token_id)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "and now?"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # rebuilt from its parts (`_bpe_parts`: the vocabulary and merges as Python objects), the very same tokenizer
    assert gguf_tokenizer_cache._bpe_parts(fresh.backend_tokenizer) is not None
    assert cached.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    # the server's byte-level test reads the decoder alone; the whole tokenizer's JSON says the same
    decoder = json.loads(fresh.backend_tokenizer.to_str())["decoder"]
    assert _is_byte_level(cached) is _is_byte_level(fresh) is ("ByteLevel" in json.dumps(decoder))


def test_a_tokenizer_bpe_parts_cannot_rebuild_is_pickled_as_its_json():
    """Only a BPE model goes by parts; any other (WordLevel here) pickles and unpickles as tokenizers does it."""
    import io
    import pickle

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    word_level = Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert gguf_tokenizer_cache._bpe_parts(word_level) is None
    file = io.BytesIO()
    gguf_tokenizer_cache._TokenizerPickler(file).dump(word_level)
    assert pickle.loads(file.getvalue()).to_str() == word_level.to_str()


def test_a_file_read_again_is_parsed_once_until_it_changes(tiny, tmp_path):
    """A start reads the header for its model and again for its engine: the second read is the first's reader,
    and a file written since is read anew."""
    import os

    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny.read_bytes())
    first = read(copy)
    assert read(copy) is first
    copy.write_bytes(tiny.read_bytes())  # the same bytes written again (a later mtime): read again
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert read(copy) is not first


def _resident_kb(path) -> int:
    """kB of `path`'s mapped pages resident in this process (0 when it is not mapped)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header line: its range, ..., its file
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads resident pages from /proc")
def test_a_loaded_engine_holds_no_page_of_the_file_twice(tiny, monkeypatch):
    """The kernels copy (repack) the blocks they multiply; the mapped file's pages then counted a second time
    (a 0.5B Q8_0 file: 1.62 GB resident where 0.97 GB held the model). They leave once the engine holds its
    own, and the float tensors still read from the file fault back in as stored: the same tokens either way."""
    from tfserve import Engine, SamplingParams
    from tfserve.engine import kernels
    from tfserve.models import gguf_reader

    if kernels.cpu_ops() is None:
        pytest.skip("the file's blocks are multiplied by the CPU kernels, which did not build here")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = Engine.from_pretrained(str(tiny), device="cpu", block_size=4, num_blocks=32)
    assert engine.runner.forward.weight_formats.get("Q8_0"), "the file's blocks are not multiplied as stored"
    assert _resident_kb(tiny) == 0
    tokens = [out.generated_tokens for out in engine.generate_batch([[5, 6, 7]], params).values()]
    monkeypatch.setattr(gguf_reader, "release", lambda path: None)
    kept = Engine.from_pretrained(str(tiny), device="cpu", block_size=4, num_blocks=32)
    assert _resident_kb(tiny) > 0
    assert [out.generated_tokens for out in kept.generate_batch([[5, 6, 7]], params).values()] == tokens
