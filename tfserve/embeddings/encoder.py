"""The encoder: a sentence-embedding model (BERT-like, loaded with transformers' AutoModel) that turns batches of
token ids into sentence vectors in one forward per bucket of similar lengths. No KV cache, no sampling.

Tokenizing goes straight to the fast tokenizer's Rust backend (`encode_batch`), without transformers' per-call
Python; batches are sorted by length and cut so that little padding is run, and a bucket whose rows all have the
same length runs without an attention mask (SDPA's fast path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tfserve.embeddings.pooling import PoolingConfig, pool, read_pooling_config
from tfserve.errors import ModelLoadError, ModelNotFoundError

logger = logging.getLogger("tfserve.embeddings")

MAX_BATCH_TOKENS = 16384  # padded tokens in one forward (the attention scores of 32 x 256 tokens: ~100 MB)


class EmbeddingInputError(ValueError):
    """An input this encoder cannot embed (too long, a token id outside the vocabulary, a size it cannot cut to);
    `param` names the request field and `code` says what is wrong; the server answers 400."""

    def __init__(self, message: str, param: str = "input", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(slots=True)
class Embeddings:
    """What one embedding call returns."""

    vectors: object  # torch.Tensor [num_inputs, dimensions], float32 on the CPU
    num_tokens: int  # input tokens embedded, special tokens included (OpenAI's usage.prompt_tokens)


class Encoder:
    """A loaded sentence-embedding model with its tokenizer and pooling. `encode` runs on one thread at a time."""

    def __init__(self, model, tokenizer, pooling: PoolingConfig, name: str,
                 max_batch_tokens: int = MAX_BATCH_TOKENS) -> None:
        self.model, self.tokenizer, self.pooling, self.name = model, tokenizer, pooling, name
        self.max_batch_tokens = max_batch_tokens
        self.device = next(model.parameters()).device
        config = model.config
        limits = [pooling.max_seq_length, getattr(config, "max_position_embeddings", None),
                  tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None]
        self.max_input_tokens: int = min(limit for limit in limits if limit)  # the longest input, special tokens in
        self.dimensions: int = config.hidden_size * len(pooling.modes)  # the native size of a vector
        self.vocab_size: int = config.vocab_size
        self.pad_token_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._exact = _backend(tokenizer, None)  # whole inputs, so that a long one is refused, not cut
        self._truncating = _backend(tokenizer, self.max_input_tokens)

    @classmethod
    def from_pretrained(cls, path: str | Path, name: str | None = None, device: str = "cpu") -> Encoder:
        """Load the encoder in the model folder `path` (float32, SDPA attention) onto `device` ("auto": a GPU if
        there is one)."""
        import torch
        from transformers import AutoModel, AutoTokenizer

        from tfserve.models.loading import resolve_device

        path = Path(path)
        try:
            pooling = read_pooling_config(path)
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load embedding model {path}: {exc}") from None
        if not tokenizer.is_fast:
            raise ModelLoadError(f"{path} has no fast tokenizer (tokenizer.json); embedding models need one")
        model = model.to(resolve_device(device)).eval()
        if next(model.parameters()).device.type == "cpu":  # the linear layers on tfserve's panel kernel
            from tfserve.engine.cpu_linear import pack_linears
            from tfserve.engine.kernels import cpu_ops

            pack_linears(model, cpu_ops())
        return cls(model, tokenizer, pooling, name or path.name)

    @classmethod
    def from_spec(cls, spec: str, allow_paths: bool = True, device: str = "cpu") -> Encoder:
        """Load what `spec` names (a store name, a model folder, a cached hub id); an embedding model of tfserve's
        catalog is pulled first when the store lacks it."""
        from tfserve.models import catalog, store
        from tfserve.models.loading import resolve_model
        from tfserve.models.pull import pull

        known = catalog.get_known(spec)
        if known is not None and known.task == "embedding" and not store.is_pulled(spec):
            pull(spec)
        resolved = resolve_model(spec)
        if resolved.kind == "gguf" or (not allow_paths and resolved.kind not in ("store", "hf_cache")):
            raise ModelNotFoundError(f"{spec!r} is not an embedding model folder, store model or cached hub id")
        return cls.from_pretrained(resolved.path, resolved.name, device)

    # -- inputs ---------------------------------------------------------------------------------------------

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids of each text, special tokens added; EmbeddingInputError for one over `max_input_tokens`
        unless `truncate` (then cut to it, as sentence-transformers does)."""
        backend = self._truncating if truncate else self._exact
        ids = [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=True)]
        if not truncate:
            self.check_lengths(ids)
        return ids

    def check_ids(self, token_ids: list[list[int]], truncate: bool = False) -> list[list[int]]:
        """Token id inputs, taken as given (special tokens are the client's to add); cut or refused by length."""
        for i, ids in enumerate(token_ids):
            if not ids:
                raise EmbeddingInputError(f"input[{i}] is empty: give at least one token")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise EmbeddingInputError(f"input[{i}] holds token id {bad}, outside the vocabulary "
                                          f"(0..{self.vocab_size - 1})")
        if truncate:
            return [ids[:self.max_input_tokens] for ids in token_ids]
        self.check_lengths(token_ids)
        return token_ids

    def check_lengths(self, token_ids: list[list[int]]) -> None:
        for i, ids in enumerate(token_ids):
            if len(ids) > self.max_input_tokens:
                raise EmbeddingInputError(
                    f"input[{i}] is {len(ids)} tokens, more than {self.name}'s maximum of {self.max_input_tokens}; "
                    f"shorten it, or send \"truncate\": true to embed its first {self.max_input_tokens} tokens",
                    code="context_length_exceeded")

    def check_dimensions(self, dimensions: int | None) -> int:
        """The vector size a request's `dimensions` asks for: the native size, or a Matryoshka size the model was
        trained for; EmbeddingInputError otherwise."""
        if dimensions is None or dimensions == self.dimensions:
            return self.dimensions
        allowed = self.pooling.matryoshka_dimensions
        if not allowed:
            raise EmbeddingInputError(f"{self.name} makes {self.dimensions}-dimensional vectors and cannot shorten "
                                      f"them (it is no Matryoshka model): leave dimensions out", "dimensions")
        if not 1 <= dimensions <= self.dimensions:
            raise EmbeddingInputError(f"dimensions must be from 1 to {self.dimensions} (got {dimensions})",
                                      "dimensions")
        return dimensions

    # -- the forward ----------------------------------------------------------------------------------------

    def encode(self, token_ids: list[list[int]], dimensions: int | None = None):
        """Sentence vectors [len(token_ids), dimensions] (float32, CPU) of inputs already checked; one forward
        per bucket of inputs sorted by length, at most `max_batch_tokens` padded tokens each."""
        import torch

        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        out = torch.empty(len(token_ids), self.dimensions, dtype=torch.float32)
        start = 0
        while start < len(order):
            end = start + 1  # sorted ascending: the bucket's last input is its longest
            while end < len(order) and (end + 1 - start) * len(token_ids[order[end]]) <= self.max_batch_tokens:
                end += 1
            rows = order[start:end]
            out[rows] = self._forward([token_ids[i] for i in rows])
            start = end
        if dimensions is not None and dimensions < self.dimensions:  # Matryoshka: the leading part, unit length
            out = out[:, :dimensions]
            out = torch.nn.functional.normalize(out, dim=1) if self.pooling.normalize else out.contiguous()
        return out

    def _forward(self, rows: list[list[int]]):
        import torch

        longest = max(len(ids) for ids in rows)
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)  # [batch, seq]
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        same_length = all(len(row) == longest for row in rows)
        with torch.inference_mode():
            hidden = self.model(input_ids=ids.to(self.device),
                                attention_mask=None if same_length else mask.to(self.device)).last_hidden_state
            return pool(hidden.float(), mask.to(self.device), self.pooling).cpu()  # [batch, dimensions]


def _backend(tokenizer, max_length: int | None):
    """A copy of the fast tokenizer's Rust backend that pads nothing and cuts at `max_length` (None: never); the
    folder's tokenizer.json may set both (all-MiniLM-L6-v2's pads and cuts at 128)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    if max_length is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(max_length)
    return backend
