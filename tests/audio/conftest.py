"""Speech fixtures for tests/audio: see tests/speech.py."""

from speech import transcriber, whisper, whisper_dir  # noqa: F401  (fixtures)
