"""Reading a GGUF file's header without loading it (`models info FILE.gguf`), and telling a cut or foreign file
apart from a model transformers cannot load."""

from __future__ import annotations

import pytest

from tfserve.errors import ModelLoadError
from tfserve.models.gguf_file import gguf_info, unreadable_error
from tiny_gguf import CONTEXT, HEADS, KV_HEADS, LAYERS, write_tiny_gguf


def test_info_reads_the_header_and_tensor_table(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    info = gguf_info(path)
    assert (info.architecture, info.num_hidden_layers, info.num_attention_heads, info.num_key_value_heads) == (
        "llama", LAYERS, HEADS, KV_HEADS)
    assert info.max_position_embeddings == CONTEXT and info.has_chat_template
    assert info.tensor_types == {"F32": 19, "Q8_0": 1} and info.num_parameters > 0
    assert info.size_bytes == path.stat().st_size and info.gguf_file == str(path)
    assert not gguf_info(write_tiny_gguf(tmp_path / "plain.gguf", chat_template=None)).has_chat_template
    assert unreadable_error(path) is None


@pytest.mark.parametrize("keep", [4, 100, 1000, -100])
def test_a_cut_file_is_said_to_be_one(tmp_path, keep):
    whole = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(ModelLoadError, match=f"cannot read {cut}: it is truncated or not a GGUF file"):
        gguf_info(cut)
    assert "truncated or not a GGUF file" in str(unreadable_error(cut))


def test_a_file_of_another_kind_is_said_to_be_none(tmp_path):
    other = tmp_path / "notes.gguf"
    other.write_text("just some text, long enough to be read as a header if one tried" * 4)
    assert "does not begin with the GGUF magic bytes" in str(unreadable_error(other))


def test_what_cannot_be_opened_says_why(tmp_path):
    assert "No such file or directory" in str(unreadable_error(tmp_path / "missing.gguf"))
