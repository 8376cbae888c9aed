"""Regenerate the speech fixtures: each sentence of sentences.json spoken by espeak-ng (`-v en-us -s 120`, or the
voice the entry names) and stored as 16 kHz mono Opus, a few kilobytes each. Run from the repository root:
`python tests/audio/data/make_speech.py` (needs espeak-ng; the tests only read the files)."""

import json
import subprocess
import tempfile
from pathlib import Path

import av
import numpy as np

from tfserve.audio.decode import decode_audio

HERE = Path(__file__).parent


def encode_opus(samples: np.ndarray, path: Path, rate: int = 16000) -> None:
    with av.open(str(path), "w", format="ogg") as container:
        stream = container.add_stream("libopus", rate=rate, layout="mono")
        stream.bit_rate = 24000
        frame = av.AudioFrame.from_ndarray((samples * 32767).astype(np.int16)[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


def main() -> None:
    for entry in json.loads((HERE / "sentences.json").read_text()):
        with tempfile.TemporaryDirectory() as tmp:
            wav = Path(tmp) / "s.wav"
            subprocess.run(["espeak-ng", "-v", entry.get("voice", "en-us"), "-s", "120", "-w", str(wav), entry["text"]],
                           check=True)
            samples = decode_audio(wav.read_bytes())
        encode_opus(samples, HERE / f"{entry['name']}.opus")
        print(entry["name"], f"{len(samples) / 16000:.1f} s")


if __name__ == "__main__":
    main()
