"""The embedding models a server serves beside (or instead of) its chat model: loaded at start (`tfserve serve
--embedding-model NAME`, or `--model` of an encoder), each with its batcher, found by the name a request gives.

Other API families reach them here: `state.embeddings.get(name)` is an `EncoderBatcher`, whose `embed(texts)`
answers `/v1/embeddings` and Ollama's `/api/embed` alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tfserve.server.errors import ApiError

if TYPE_CHECKING:
    from tfserve.embeddings.batcher import EncoderBatcher

logger = logging.getLogger("tfserve.server")


@dataclass(slots=True)
class EmbeddingOptions:
    """Embedding settings of a server: what one request may ask for, and how requests are batched."""

    max_inputs: int = 2048  # inputs in one request (OpenAI's limit)
    max_total_tokens: int = 65536  # tokens of all its inputs together (a CPU embeds ~10k tokens/s with MiniLM)
    max_batch_inputs: int = 256  # inputs one forward takes, across requests
    batch_wait_ms: float = 2.0  # how long a batch waits for requests still being tokenized

    def __post_init__(self):
        for name in ("max_inputs", "max_total_tokens", "max_batch_inputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0 (got {self.batch_wait_ms})")


class EmbeddingModels:
    """The served embedding models, by name. `alone`: no chat model is served (`--model` named an encoder)."""

    def __init__(self, options: EmbeddingOptions | None = None) -> None:
        self.options = options or EmbeddingOptions()
        self.loaded: dict[str, EncoderBatcher] = {}  # served name -> batcher; the first is the default
        self._aliases: dict[str, str] = {}  # other names (its path, its folder's name) -> served name
        self.alone = False

    def load(self, spec: str, device: str = "cpu") -> EncoderBatcher:
        """Load and start the embedding model `spec` names (pulled first if it is a catalog model the store lacks);
        blocking, for the thread that loads models."""
        from tfserve.embeddings.batcher import EncoderBatcher
        from tfserve.embeddings.encoder import Encoder
        from tfserve.engine.threads import run_in_fresh_thread

        encoder = run_in_fresh_thread(Encoder.from_spec, spec, True, device)
        batcher = EncoderBatcher(encoder, self.options.max_batch_inputs, self.options.batch_wait_ms).start()
        self.add(batcher, spec)
        logger.info("loaded embedding model %s (%d dimensions, inputs up to %d tokens)", encoder.name,
                    encoder.dimensions, encoder.max_input_tokens)
        return batcher

    def add(self, batcher: EncoderBatcher, spec: str | None = None) -> None:
        """Serve `batcher` under its model's name (and `spec`, and the last part of a path)."""
        self.loaded[batcher.name] = batcher
        for alias in (spec, Path(spec).name if spec else None):
            if alias and alias != batcher.name:
                self._aliases[alias] = batcher.name

    def serves(self, name: str | None) -> bool:
        return name is not None and (name in self.loaded or name in self._aliases)

    def get(self, name: str | None) -> EncoderBatcher:
        """The batcher of the model a request names (None: the first served); 404 for a model not served."""
        if not self.loaded:
            raise ApiError(404, "this server serves no embedding model; start it with --embedding-model NAME "
                                "(e.g. all-minilm-l6-v2)", param="model", code="model_not_found")
        if name is None:
            return next(iter(self.loaded.values()))
        served = self._aliases.get(name, name)
        if served not in self.loaded:
            raise ApiError(404, f"The embedding model {name[:80]!r} is not served here; this server embeds with "
                                f"{', '.join(map(repr, self.loaded))}", param="model", code="model_not_found")
        return self.loaded[served]

    def refuse_chat(self, name: str | None) -> None:
        """400 on a text-generation endpoint for a request naming an embedding model (or naming none where only
        embedding models are served)."""
        from tfserve.embeddings.pooling import is_embedding_dir
        from tfserve.models import store

        if name is None and not self.alone:
            return
        if (name is None or self.serves(name)
                or (store.is_store_name(name) and is_embedding_dir(store.model_path(name)))):
            which = name or next(iter(self.loaded), "the served model")
            raise ApiError(400, f"{which!r} is an embedding model: it makes vectors, not text; send its inputs to "
                                "/v1/embeddings", param="model", code="model_not_supported")

    def stop(self) -> None:
        for batcher in self.loaded.values():
            batcher.stop()
        self.loaded.clear()
        self._aliases.clear()
