"""One transcription as the transcriber runs it: the options a caller sets, the job's progress through its
audio window by window, and the segments it produces."""

from __future__ import annotations

import itertools
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tfserve.audio.whisper_model import FRAMES_PER_SECOND

TASKS = ("transcribe", "translate")
COMPRESSION_RATIO_THRESHOLD = 2.4  # above: a repetition loop; decode the window again, hotter
LOGPROB_THRESHOLD = -1.0  # below (average per token): decode again, or with a likely no-speech, skip
NO_SPEECH_THRESHOLD = 0.6
TEMPERATURE_STEP = 0.2  # the fallback's temperatures: 0.0, 0.2, ... 1.0
_ids = itertools.count()


@dataclass(slots=True)
class TranscriptionOptions:
    """What a caller chooses for one transcription."""

    task: str = "transcribe"  # or "translate" (to English; multilingual models)
    language: str | None = None  # ISO 639-1 code; None: detected (multilingual) or English (.en models)
    prompt: str | None = None  # text the first window is conditioned on (names, spelling, style)
    temperature: float = 0.0  # 0: greedy, falling back to hotter decodes on a repetition loop (OpenAI's rule)
    condition_on_previous_text: bool = True  # each window sees the text before it
    word_timestamps: bool = False  # time every word (cross-attention alignment) as well as every segment

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not 0.0 <= self.temperature <= 1.0:
            raise ValueError(f"temperature must be between 0 and 1, got {self.temperature}")


@dataclass(slots=True)
class Word:
    """A word (with its leading space) and its times in seconds from the start of the audio."""

    word: str
    start: float
    end: float


@dataclass(slots=True)
class Segment:
    """A stretch of speech with its times in seconds from the start of the audio."""

    id: int
    seek: int  # mel frame where its window started
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float  # over its own tokens (its timestamps included)
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] | None = None  # with word_timestamps


@dataclass(slots=True)
class TranscriptionResult:
    """A finished transcription."""

    text: str
    segments: list[Segment]
    language: str  # ISO code
    duration_s: float  # of the audio
    num_windows: int  # decoded, counting fallbacks


Sink = Callable[[str, Any], None]  # ("segments", [Segment]) | ("done", TranscriptionResult) | ("error", exc)


@dataclass(eq=False)
class TranscriptionJob:
    """One audio file's way through the transcriber."""

    audio: Any  # float32 mono 16 kHz samples, until its features are computed (then None)
    num_frames: int  # of the audio itself
    options: TranscriptionOptions
    sink: Sink
    prompt_tokens: list[int] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_ids))
    seek: int = 0  # mel frame where the next window starts
    language: str | None = None
    segments: list[Segment] = field(default_factory=list)
    all_tokens: list[int] = field(default_factory=list)  # of every segment, for conditioning the next window
    prompt_reset_since: int = 0  # all_tokens before this are not shown to the next window
    num_windows: int = 0
    features: Any = None  # log-mel [num_mel_bins, num_frames + 3000] (the silence after the audio included)
    aborted: threading.Event = field(default_factory=threading.Event)

    @property
    def duration_s(self) -> float:
        return self.num_frames / FRAMES_PER_SECOND

    @property
    def language_code(self) -> str:
        """The language detected or asked for ("en" for English-only models, which take none)."""
        return self.language or self.options.language or "en"

    @property
    def done(self) -> bool:
        return self.seek >= self.num_frames

    def abort(self) -> None:
        """Stop working on this job (from any thread); its slot is freed before the next step."""
        self.aborted.set()


def compression_ratio(text: str) -> float:
    """How well `text` compresses: above ~2.4 it repeats itself."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0
