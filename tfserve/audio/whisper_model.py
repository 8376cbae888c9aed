"""A Whisper model as the transcriber uses it: the transformers model, its processor, and the ids of its
special tokens, read from the tokenizer and generation config (English-only and multilingual vocabularies
place them differently)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfserve.engine.threads import run_in_fresh_thread
from tfserve.errors import ModelNotFoundError, TfserveError

SAMPLE_RATE = 16000
HOP_LENGTH = 160  # samples per mel frame
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100
WINDOW_FRAMES = 3000  # mel frames in one 30-second window
TIME_PRECISION = 0.02  # seconds per timestamp token, i.e. 2 mel frames


@dataclass(frozen=True, slots=True)
class WhisperTokens:
    """Special token ids of one Whisper vocabulary."""

    eot: int  # <|endoftext|>
    sot: int  # <|startoftranscript|>
    sot_prev: int  # <|startofprev|>, before the previous text a window is conditioned on
    no_speech: int  # <|nospeech|> (<|nocaptions|> in older vocabularies)
    no_timestamps: int
    timestamp_begin: int  # <|0.00|>; every id from here on is a timestamp
    transcribe: int
    translate: int
    multilingual: bool  # takes a language and a task token after <|startoftranscript|>
    languages: dict[str, int] = field(default_factory=dict)  # ISO code ("en") -> its token
    suppress: tuple[int, ...] = ()  # never sampled
    begin_suppress: tuple[int, ...] = ()  # not sampled first (a blank, end of text)
    max_initial_timestamp_index: int = 50  # the first timestamp is at most 1.00 s
    max_len: int = 448

    def sot_sequence(self, language: str | None, task: str) -> list[int]:
        """The tokens after which sampling begins: <|startoftranscript|>, then for multilingual models the
        language and the task."""
        if not self.multilingual:
            return [self.sot]
        return [self.sot, self.languages[language], self.translate if task == "translate" else self.transcribe]


class NotSpeechModelError(TfserveError):
    """The model named is not a Whisper speech recognition model."""


class SpeechRequestError(TfserveError):
    """A language or task the model cannot take; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def language_code(text: str) -> str | None:
    """An ISO 639-1 code for a language code or English name Whisper knows ("fr", "French"), else None."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    text = text.strip().lower()
    return text if text in LANGUAGES else TO_LANGUAGE_CODE.get(text)


class WhisperModel:
    """A loaded Whisper model: `model`, `processor` (feature extractor + tokenizer), `tokens`."""

    def __init__(self, model: Any, processor: Any, name: str) -> None:
        self.model = model
        self.processor = processor
        self.name = name
        self.tokens = read_tokens(processor.tokenizer, model.generation_config, model.config)
        config = model.config
        heads = getattr(model.generation_config, "alignment_heads", None)
        # (decoder layer, head) pairs whose cross-attention follows the words; by default the upper half's
        self.alignment_heads = [tuple(pair) for pair in heads] if heads else [
            (layer, head) for layer in range(config.decoder_layers // 2, config.decoder_layers)
            for head in range(config.decoder_attention_heads)]

    @property
    def device(self) -> Any:
        return self.model.device

    @classmethod
    def load(cls, path: str | Path, name: str | None = None, device: str = "cpu") -> WhisperModel:
        """Load a transformers Whisper directory on `device` ("auto", "cpu", "cuda[:N]"), on a thread that ends
        (`tfserve.engine.threads`)."""
        return run_in_fresh_thread(cls._load, path, name, device)

    @classmethod
    def _load(cls, path: str | Path, name: str | None = None, device: str = "cpu") -> WhisperModel:
        from transformers import AutoConfig, WhisperForConditionalGeneration, WhisperProcessor

        from tfserve.models.loading import resolve_device

        device = resolve_device(device)
        config = AutoConfig.from_pretrained(path)
        if config.model_type != "whisper":
            raise NotSpeechModelError(f"{name or path} is a {config.model_type} model, not a Whisper speech model")
        # float32 on a CPU (its fast kernels are float32 ones; the decoder's linears read 16-bit packed copies);
        # float16 on a GPU, as openai-whisper and faster-whisper run it there
        dtype = "float32" if device == "cpu" else "float16"
        model = WhisperForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
        return cls(model, WhisperProcessor.from_pretrained(path), name or Path(path).name)

    @classmethod
    def from_spec(cls, spec: str, progress=None, allow_paths: bool = True, device: str = "cpu") -> WhisperModel:
        """Load what `spec` names (a store name, an HF model directory or a cached hub id; no directory unless
        `allow_paths`) on `device`; a speech model of tfserve's catalog is pulled first when the store lacks it."""
        return run_in_fresh_thread(cls._from_spec, spec, progress, allow_paths, device)

    @classmethod
    def _from_spec(cls, spec: str, progress=None, allow_paths: bool = True, device: str = "cpu") -> WhisperModel:
        from tfserve.engine import kernels
        from tfserve.models import catalog, store
        from tfserve.models.convert import hf_progress_bars
        from tfserve.models.loading import resolve_model
        from tfserve.models.pull import pull

        known = catalog.get_known(spec)
        if known is not None and known.task == "speech" and not store.is_pulled(spec):
            pull(spec, progress=progress)
        resolved = resolve_model(spec)
        if not allow_paths and resolved.kind not in ("store", "hf_cache"):
            raise ModelNotFoundError(f"{spec!r} is not a store model or a cached hub id (clients cannot name paths)")
        if resolved.kind == "gguf":
            raise NotSpeechModelError(f"{spec} is a GGUF file; speech models are transformers Whisper directories")
        with hf_progress_bars(enabled=False):  # the caller shows its own progress, or none (a server)
            whisper = cls._load(resolved.path, resolved.name, device)
        if progress is not None and whisper.device.type == "cpu" and os.environ.get("TFSERVE_CPU_KERNELS", "1") != "0":
            kernels.build_with_progress(progress)
        return whisper

    def check_request(self, language: str | None, task: str) -> str | None:
        """The ISO code of `language` (None: detect it) if this model can do `task` in it; SpeechRequestError
        naming the field otherwise."""
        if task == "translate" and not self.tokens.multilingual:
            raise SpeechRequestError(f"{self.name!r} is an English-only model and cannot translate; use a "
                                     f"multilingual Whisper model such as 'whisper-base'", "model")
        if language is None:
            return None
        code = language_code(language)
        if code is None:
            raise SpeechRequestError(f"language: {language!r} is not a language Whisper knows; send an ISO 639-1 "
                                     f"code such as 'en' or 'fr'", "language")
        if code not in self.tokens.languages:
            raise SpeechRequestError(f"language: {self.name!r} is an English-only model; it cannot take "
                                     f"{language!r} (use a multilingual Whisper model, or 'en')", "language")
        return code

    def features(self, audio) -> Any:
        """Log-mel features of the whole of `audio` (float32 16 kHz), followed by 30 s of silence so every window
        is whole: [num_mel_bins, num_frames + 3000], normalised over the whole file as openai-whisper does."""
        import numpy as np

        padded = np.concatenate([audio, np.zeros(WINDOW_FRAMES * HOP_LENGTH, np.float32)])
        # on a GPU its STFT runs there (3 ms against 11-36 ms on the H200 machine's host for 40 s of audio); the
        # features come back to the CPU, where a job keeps them until its windows are admitted
        device = str(self.device) if self.device.type == "cuda" else "cpu"
        return self.processor.feature_extractor(padded, sampling_rate=SAMPLE_RATE, truncation=False, device=device,
                                                padding="longest", return_tensors="pt").input_features[0].cpu()

    def decode_text(self, token_ids: list[int]) -> str:
        return self.processor.tokenizer.decode([t for t in token_ids if t < self.tokens.eot])

    def encode_text(self, text: str) -> list[int]:
        return self.processor.tokenizer.encode(text, add_special_tokens=False)


def read_tokens(tokenizer: Any, generation_config: Any, config: Any) -> WhisperTokens:
    """The special tokens of a Whisper tokenizer and generation config."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    def lookup(name: str) -> int | None:  # unknown tokens map to <|endoftext|>, Whisper's unk
        token_id = tokenizer.convert_tokens_to_ids(name)
        return token_id if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == name else None

    def token(*names: str) -> int:
        for name in names:
            if (token_id := lookup(name)) is not None:
                return token_id
        raise TfserveError(f"the Whisper tokenizer has no {' or '.join(names)} token")

    no_timestamps = token("<|notimestamps|>")
    languages = {code: token_id for code in LANGUAGES if (token_id := lookup(f"<|{code}|>")) is not None}
    multilingual = bool(getattr(generation_config, "is_multilingual", config.vocab_size >= 51865))
    return WhisperTokens(
        eot=token("<|endoftext|>"), sot=token("<|startoftranscript|>"), sot_prev=token("<|startofprev|>"),
        no_speech=token("<|nospeech|>", "<|nocaptions|>"), no_timestamps=no_timestamps,
        timestamp_begin=no_timestamps + 1, transcribe=token("<|transcribe|>"), translate=token("<|translate|>"),
        multilingual=multilingual, languages=languages if multilingual else {"en": languages.get("en", -1)},
        suppress=tuple(getattr(generation_config, "suppress_tokens", None) or ()),
        begin_suppress=tuple(getattr(generation_config, "begin_suppress_tokens", None) or ()),
        max_initial_timestamp_index=getattr(generation_config, "max_initial_timestamp_index", None) or 50,
        max_len=config.max_target_positions)
