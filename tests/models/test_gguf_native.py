"""A GGUF file read natively: tfserve's reader against gguf-py's, the config and tokenizer cache, and the model
whose linear weights are placeholders for the file's blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tfserve.models import gguf_native
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
    assert again_tokenizer(text)["input_ids"] == expected(text)["input_ids"]
    assert again_tokenizer.chat_template == expected.chat_template

    # a pickle another user could have written is not loaded: the tokenizer files are read instead
    pickled = next(gguf_native.cache_root().iterdir()) / gguf_native.PICKLED_TOKENIZER
    assert gguf_native._pickled(pickled) is not None
    pickled.chmod(0o666)
    assert gguf_native._pickled(pickled) is None
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
