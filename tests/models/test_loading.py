"""The one loader: resolving `--model` specs, devices, dtypes, quantization; a tiny model loads end to end.
The slow tests load the real default model quantized with bitsandbytes on this CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tfserve.errors import DeviceError, ModelNotFoundError
from tfserve.models import catalog, loading, store
from tfserve.models.loading import load_model, resolve_model

NAME = catalog.DEFAULT_MODEL


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random llama with a trained BPE tokenizer and a chat template, saved as an HF directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["hello world, the quick brown fox"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_resolve_store_name(make_fake_model):
    make_fake_model(store.model_path("tiny"))
    assert resolve_model("tiny") == loading.ResolvedModel("store", store.model_path("tiny"), "tiny")


def test_resolve_hf_dir_and_gguf(make_fake_model, tmp_path):
    path = make_fake_model(tmp_path / "my-model")
    assert resolve_model(str(path)).kind == "hf_dir"
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    resolved = resolve_model(str(gguf))
    assert (resolved.kind, resolved.path, resolved.name) == ("gguf", gguf, "m.Q4")


def test_resolve_hf_cache(tmp_path, monkeypatch, make_fake_model):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    make_fake_model(snapshot)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    resolved = resolve_model("org/tiny")
    assert (resolved.kind, resolved.path, resolved.name) == ("hf_cache", snapshot, "org/tiny")
    with pytest.raises(ModelNotFoundError, match="not in the local HF cache"):
        resolve_model("org/other")


def fake_hf_cache(root, repo_id: str, snapshots: dict[str, dict[str, bytes]], refs: dict[str, str]):
    """A hub cache as huggingface_hub lays one out: each file a link from snapshots/<commit>/ into blobs/."""
    import hashlib

    repo = root / f"models--{repo_id.replace('/', '--')}"
    for commit, files in snapshots.items():
        for name, data in files.items():
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
            (repo / "snapshots" / commit / name).symlink_to(Path("..", "..", "blobs", blob.name))
    for ref, commit in refs.items():
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


MAIN, DEV = "a" * 40, "b" * 40


def test_resolve_a_revision_in_the_hf_cache(hub_cache):
    """`org/model@rev`, as transformers serve names a branch, tag or commit: `@main` said "not in the local HF
    cache" for a model that served without it, and suggested `hf download org/model@main`, which hf refuses."""
    config = {"config.json": b"{}", "model.safetensors": b"x"}
    repo = fake_hf_cache(hub_cache, "org/tiny", {MAIN: config, DEV: config}, {"main": MAIN, "dev": DEV})
    for spec, commit in [("org/tiny", MAIN), ("org/tiny@main", MAIN), ("org/tiny@dev", DEV), (f"org/tiny@{DEV}", DEV)]:
        assert resolve_model(spec) == loading.ResolvedModel("hf_cache", repo / "snapshots" / commit, spec)
    with pytest.raises(ModelNotFoundError, match=r"'org/tiny@v2' is not in the local HF cache.*"
                                                 r"\(`hf download org/tiny --revision v2`\)"):
        resolve_model("org/tiny@v2")
    with pytest.raises(ModelNotFoundError, match=r"\(`hf download org/other`\)"):
        resolve_model("org/other")


def test_resolve_a_gguf_in_a_folder(tmp_path):
    """`<dir>:<file>.gguf` (transformers serve's GGUF naming) said "no such file or directory"."""
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "ggufs" / "tiny.Q8_0.gguf")
    resolved = resolve_model(f"{path.parent}:tiny.Q8_0.gguf")
    assert resolved == loading.ResolvedModel("gguf", path, "tiny.Q8_0")
    loaded = load_model(f"{path.parent}:tiny.Q8_0.gguf")
    assert loaded.path == path and loaded.tokenizer.chat_template is not None
    with pytest.raises(ModelNotFoundError, match="no other.gguf in"):
        resolve_model(f"{path.parent}:other.gguf")
    with pytest.raises(ModelNotFoundError, match="no such directory: ./missing"):
        resolve_model("./missing:tiny.gguf")
    with pytest.raises(ModelNotFoundError, match="is not a directory"):
        resolve_model(f"{path}:tiny.gguf")


def test_a_store_models_gguf_by_name(make_fake_model):
    path = make_fake_model(store.model_path("tiny"))
    (path / "model.gguf").write_bytes(b"GGUF")
    # by the name it was asked by: a request naming it is answered with that name
    assert resolve_model("tiny:model.gguf") == loading.ResolvedModel("gguf", path / "model.gguf", "tiny:model.gguf")


def test_resolve_a_gguf_in_the_hf_cache(hub_cache):
    """`org/repo:file.gguf`: the file in the repo's cached snapshot, by its own name (the cache's blob it links to
    is named by its hash, and the engine reads GGUF blocks only from a file ending in .gguf)."""
    from tiny_gguf import write_tiny_gguf

    data = write_tiny_gguf(hub_cache.parent / "tiny.gguf").read_bytes()
    repo = fake_hf_cache(hub_cache, "org/tiny-GGUF", {MAIN: {"tiny.Q8_0.gguf": data}, DEV: {"tiny.Q4_0.gguf": data}},
                         {"main": MAIN, "dev": DEV})
    spec = "org/tiny-GGUF:tiny.Q8_0.gguf"
    file = repo / "snapshots" / MAIN / "tiny.Q8_0.gguf"
    assert resolve_model(spec) == loading.ResolvedModel("gguf", file, spec)
    assert resolve_model("org/tiny-GGUF@dev:tiny.Q4_0.gguf").path == repo / "snapshots" / DEV / "tiny.Q4_0.gguf"
    loaded = load_model(spec)
    assert (loaded.name, loaded.path) == (spec, file) and loaded.tokenizer.chat_template is not None
    for wrong, message in [
            ("org/tiny-GGUF", ("without a config.json; name one of its GGUF files, as transformers does: "
                               "org/tiny-GGUF:tiny.Q8_0.gguf")),
            ("org/tiny-GGUF:tiny.Q4_0.gguf", ("'org/tiny-GGUF' in the local HF cache has no tiny.Q4_0.gguf.*"
                                              "`hf download org/tiny-GGUF tiny.Q4_0.gguf`")),
            ("org/tiny-GGUF@v2:a.gguf", "not in the local HF cache.*`hf download org/tiny-GGUF a.gguf --revision v2`"),
            ("org/none:a.gguf", "'org/none' is not in the local HF cache.*`hf download org/none a.gguf`")]:
        with pytest.raises(ModelNotFoundError, match=message):
            resolve_model(wrong)


def test_resolve_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match=f"unknown model 'nope'.*`tfserve models pull` gets .*{NAME}"):
        resolve_model("nope")
    with pytest.raises(ModelNotFoundError, match="config.json missing"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve_model("./missing-dir")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelNotFoundError, match="is not a model"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelNotFoundError, match="not pulled yet"):
        resolve_model(NAME)


def test_devices_and_dtypes():
    import torch

    if not torch.cuda.is_available():
        assert loading.resolve_device("auto") == "cpu"
        with pytest.raises(DeviceError, match="CUDA is not available.*--device cpu works"):
            loading.resolve_device("cuda")
        with pytest.raises(DeviceError, match="--device cpu works"):
            loading.resolve_device("cuda:1")
    assert loading.resolve_dtype("auto", "cpu") == torch.float32
    assert loading.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert loading.resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        loading.resolve_device("tpu")
    with pytest.raises(DeviceError, match="unknown dtype 'int3'"):
        loading.resolve_dtype("int3", "cpu")


def test_quantization_without_bitsandbytes_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(DeviceError, match=r"needs bitsandbytes: pip install 'tfserve\[quant\]'"):
        loading.bnb_config("bnb-4bit", None)


def test_load_tiny_hf_dir(tiny_hf_dir):
    import torch

    steps = []
    loaded = load_model(str(tiny_hf_dir), dtype="bfloat16", device="cpu", progress=lambda s, *a: steps.append(s))
    assert loaded.device == "cpu" and loaded.dtype == torch.bfloat16 and loaded.name == tiny_hf_dir.name
    assert next(loaded.model.parameters()).dtype == torch.bfloat16 and not loaded.model.training
    assert loaded.tokenizer.chat_template and steps == [f"Loading {tiny_hf_dir.name}"]
    ids = loaded.tokenizer("hello world", return_tensors="pt").input_ids
    out = loaded.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3


def test_load_cuda_without_cuda_is_one_line(tiny_hf_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="--device cpu works"):
        load_model(str(tiny_hf_dir), device="cuda")


def test_gguf_cannot_be_requantized(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(DeviceError, match="cannot re-quantize a .gguf"):
        load_model(str(gguf), quantization="bnb-4bit")


@pytest.mark.slow
@pytest.mark.parametrize("quantization,layer", [("bnb-4bit", "Linear4bit"), ("bnb-8bit", "Linear8bitLt")])
def test_bitsandbytes_on_cpu(default_model_dir, quantization, layer):
    """bitsandbytes 0.50 runs 4-bit and 8-bit on CPU: the default model loads quantized and generates."""
    loaded = load_model(str(default_model_dir), device="cpu", quantization=quantization)
    assert type(loaded.model.model.layers[0].self_attn.q_proj).__name__ == layer
    tokenizer = loaded.tokenizer
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = loaded.model.generate(**inputs, max_new_tokens=3, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3 and text.strip()


def test_unloadable_directory_is_one_line(make_fake_model, tmp_path):
    from tfserve.errors import ModelLoadError

    path = make_fake_model(tmp_path / "broken", architecture="NoSuchForCausalLM")
    (path / "config.json").write_text('{"model_type": "no-such-type"}')
    with pytest.raises(ModelLoadError, match="cannot load broken"):
        load_model(str(path))


def test_a_name_the_filesystem_refuses_is_no_such_model():
    from tfserve.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="no such model or path: .*File name too long"):
        loading.resolve_model("m" * 300)


def test_a_gguf_loads_its_own_tokenizer_not_the_files_beside_it(tmp_path):
    """A store model's model.gguf sits beside the HF files converted from it: transformers read that folder's
    tokenizer.json over the file's own, and its tokenizer_config.json, which keeps no chat template, so the
    file could not chat there while a copy elsewhere could. Another model's files beside it gave it their
    vocabulary."""
    from tiny_gguf import CHAT_TEMPLATE, write_tiny_gguf

    alone = load_model(str(write_tiny_gguf(tmp_path / "alone" / "tiny.gguf")))
    path = write_tiny_gguf(tmp_path / "store-like" / "model.gguf")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(["something else entirely"] * 4, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=other, eos_token="else").save_pretrained(path.parent)  # no template
    beside = load_model(str(path))
    assert beside.tokenizer.chat_template == alone.tokenizer.chat_template == CHAT_TEMPLATE
    assert len(beside.tokenizer) == len(alone.tokenizer) and beside.tokenizer.eos_token == "<|im_end|>"
    assert beside.path == path  # the engine reads the file's blocks from where it is


@pytest.mark.parametrize("keep", [4, 1000, -100])
def test_a_cut_gguf_is_one_line_saying_so(tmp_path, keep):
    """transformers' reader failed with `struct.error: unpack_from requires a buffer of at least 1006 bytes`,
    a traceback, or with a numpy reshape error."""
    from tfserve.errors import ModelLoadError
    from tiny_gguf import write_tiny_gguf

    whole = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(ModelLoadError, match=f"cannot read {cut}: it is truncated or not a GGUF file \\("):
        load_model(str(cut))


def test_a_folder_without_tokenizer_files_says_so(tiny_hf_dir, tmp_path):
    """transformers' message begins "Couldn't instantiate the backend tokenizer from one of:", its point on the
    lines after; cut to its first line it said nothing."""
    import shutil

    from tfserve.errors import ModelLoadError

    half = tmp_path / "halfmodel"
    shutil.copytree(tiny_hf_dir, half)
    for name in store.TOKENIZER_FILES + ("special_tokens_map.json", "chat_template.jinja"):
        (half / name).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match=r"cannot load halfmodel from .*: no tokenizer files \(tokenizer.json"):
        load_model(str(half))


def test_a_load_error_of_several_lines_is_one_line_with_them_all(tiny_hf_dir, monkeypatch):
    import transformers

    from tfserve.errors import ModelLoadError

    def fail(*args, **kwargs):
        raise ValueError("Couldn't do it from one of:\n(1) this,\n(2) that.\nInstall the other thing.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    with pytest.raises(ModelLoadError) as caught:
        load_model(str(tiny_hf_dir))
    assert str(caught.value).endswith("Couldn't do it from one of: (1) this, (2) that. Install the other thing.")


def test_a_cut_safetensors_file_is_one_line(tiny_hf_dir, tmp_path):
    import shutil

    from tfserve.errors import ModelLoadError

    cut = tmp_path / "cut"
    shutil.copytree(tiny_hf_dir, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot load cut from"):
        load_model(str(cut))
