"""Images in the engine. The processor expands each image placeholder of a prompt into the model's image tokens;
the vision encoder runs once per image, when a prefill first reaches its tokens (its output kept in an
`EncoderCache`, so a preemption's recompute or the same image in another request does not encode again); its
rows are scattered into the step's packed token embeddings, wherever a chunk of the prefill cuts. The prefix
cache names a block by its token ids plus the keys of the images whose tokens it holds (kv_cache.py), so the
same image reuses its KV and a different one never does. Text-only requests never reach this module."""

from __future__ import annotations

import hashlib
import inspect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

# processor outputs that are the prompt, not the picture
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
DEFAULT_ENCODER_CACHE_BYTES = 256 << 20
BIDIRECTIONAL_IMAGES = frozenset({"gemma3"})  # model types whose image tokens attend to each other both ways


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: the positions of its image tokens (in order: row i of the encoder output goes to
    the i-th), its content key, and what the vision encoder takes for it alone."""

    spans: tuple[tuple[int, int], ...]  # [start, end) runs of prompt positions holding its image tokens
    key: str  # content hash of the image (and of how it was processed)
    pixel_inputs: dict[str, Any]  # the processor's tensors for this image alone (pixel_values, sizes...)

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    def rows_in(self, start: int, end: int) -> list[tuple[int, int]]:
        """(prompt position, encoder row) of each of its tokens within [start, end)."""
        rows, row = [], 0
        for span_start, span_end in self.spans:
            for position in range(max(start, span_start), min(end, span_end)):
                rows.append((position, row + position - span_start))
            row += span_end - span_start
        return rows


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """The images of one prompt, in order, and for a model with multimodal rotary positions (Qwen2-VL's M-RoPE)
    the prompt's 3-D positions and the offset of the positions after it."""

    images: tuple[ImageInput, ...]
    mrope_positions: Any = None  # [3, num_prompt_tokens] long tensor (temporal, height, width), or None
    mrope_delta: int = 0  # position of token p past the prompt: p + mrope_delta on all three axes
    # Gemma 3: the tokens of an image attend to each other both ways, so a prefill chunk holds the rest of an
    # image whole (never ends inside one) and the attention mask opens each run of image tokens to itself
    bidirectional: bool = False

    def chunk_size(self, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` a prefill chunk takes: with bidirectional images, cut before
        an image the chunk would end inside, or (starting inside or at it) run to its end."""
        if not self.bidirectional:
            return num_new
        end = start + num_new
        for image in self.images:
            first, last = image.spans[0][0], image.spans[-1][1]
            if first < end < last:
                end = first if first > start else last
        return end - start

    def runs_in(self, start: int, end: int) -> list[tuple[int, int]]:
        """The runs of image tokens overlapping [start, end), for the bidirectional mask."""
        return [span for image in self.images for span in image.spans if span[0] < end and start < span[1]]

    def keys_in(self, start: int, end: int) -> tuple[str, ...]:
        """The keys of the images with tokens in prompt positions [start, end) (a block's extra hash)."""
        return tuple(image.key for image in self.images
                     if any(s < end and start < e for s, e in image.spans))


class EncoderCache:
    """Vision encoder outputs by image key, least recently used dropped past `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_encoded = 0  # images run through the encoder (a hit is not counted)
        self.num_encoder_calls = 0  # encoder runs: fewer than images when a step's images are batched
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        features = self._entries.get(key)
        if features is not None:
            self._entries.move_to_end(key)
        return features

    def put(self, key: str, features: torch.Tensor) -> None:
        if key in self._entries:
            return
        self._entries[key] = features
        self.num_bytes += features.numel() * features.element_size()
        while self.num_bytes > self.max_bytes and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= dropped.numel() * dropped.element_size()

    def __len__(self) -> int:
        return len(self._entries)


def image_token_id(model: Any, processor: Any) -> int:
    """The id of the token the model's image features replace."""
    for owner in (model.config, processor):
        for name in ("image_token_id", "image_token_index"):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
    token = getattr(processor, "image_token", None)
    if token is not None:
        return processor.tokenizer.convert_tokens_to_ids(token)
    raise ValueError(f"cannot tell the image token of {type(model).__name__}")


class VisionLanguage:
    """The image side of a vision-language model: prompts with images through its processor, and its vision
    encoder. Families differ in how their processors lay image tokens out; the model's own `get_image_features`
    (transformers' per-image `pooler_output`) hides how they encode."""

    def __init__(self, model: Any, processor: Any, encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        self.model, self.processor = model, processor
        self.image_token_id = image_token_id(model, processor)
        self.cache = EncoderCache(encoder_cache_bytes)
        accepted = inspect.signature(model.get_image_features).parameters
        self._takes_all = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        self._accepted = frozenset(accepted)
        self.bidirectional = model.config.model_type in BIDIRECTIONAL_IMAGES
        # M-RoPE (Qwen2-VL, Qwen2.5-VL): image tokens get 3-D positions from the model's own get_rope_index
        self._rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)
        self.uses_mrope = self._rope_index is not None

    def render(self, messages: list[dict], images: list[Any], tools: list | None = None,
               template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> tuple[list[int], MultiModalInput]:
        """Messages whose content holds `{"type": "image"}` parts, and the images in their order (PIL images,
        or objects with `.image` and `.sha256`) -> the prompt ids, image tokens expanded, and its images.
        ValueError says what does not fit (a count that does not match, a template that fails)."""
        pictures = [getattr(image, "image", image) for image in images]
        text = self.processor.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, tokenize=False, **(template_kwargs or {}))
        # nested: the images of each text (Idefics3's processor wants it so; LLaVA's takes it too)
        inputs = self.processor(text=[text], images=[pictures] if pictures else None, return_tensors="pt")
        prompt_ids = inputs["input_ids"][0].tolist()
        per_image = [self._one_image(picture, getattr(image, "sha256", None))
                     for picture, image in zip(pictures, images)]
        positions = [i for i, token in enumerate(prompt_ids) if token == self.image_token_id]
        if len(positions) != sum(count for count, _, _ in per_image):
            raise ValueError(f"the processor gave {len(positions)} image tokens for {len(images)} image(s), "
                             f"where the images alone take {sum(c for c, _, _ in per_image)}")
        spans, first = [], 0
        for count, key, pixel_inputs in per_image:
            spans.append(ImageInput(_runs(positions[first:first + count]), key, pixel_inputs))
            first += count
        if not self.uses_mrope:
            return prompt_ids, MultiModalInput(tuple(spans), bidirectional=self.bidirectional)
        accepted = inspect.signature(self._rope_index).parameters
        with torch.inference_mode():
            rope, delta = self._rope_index(**{k: v for k, v in inputs.items() if k in accepted})
        return prompt_ids, MultiModalInput(tuple(spans), rope[:, 0].cpu(), int(delta.reshape(-1)[0]))

    @staticmethod
    def mrope_positions(segments: list[tuple[Any, int, int]]) -> torch.Tensor:
        """The step's 3-D positions [3, num_tokens] for (request, start, end) segments in packed order: a
        prompt's own from its MultiModalInput, then `p + mrope_delta`; a text request's `p` on every axis."""
        parts = []
        for request, start, end in segments:
            mm = request.mm
            if mm is None or mm.mrope_positions is None:
                parts.append(torch.arange(start, end).expand(3, -1))
                continue
            length = mm.mrope_positions.shape[1]
            tail = torch.arange(max(start, length), max(end, length)) + mm.mrope_delta  # empty in a prefill chunk
            parts.append(torch.cat([mm.mrope_positions[:, start:min(end, length)], tail.expand(3, -1)], dim=1))
        return torch.cat(parts, dim=1)

    def _one_image(self, picture: Any, sha256: str | None) -> tuple[int, str, dict[str, Any]]:
        """An image through the processor alone: its image-token count, key and encoder inputs."""
        token = self.processor.tokenizer.convert_ids_to_tokens(self.image_token_id)
        placeholder = getattr(self.processor, "image_token", None) or token
        alone = self.processor(text=[placeholder], images=[[picture]], return_tensors="pt")
        count = alone["input_ids"][0].tolist().count(self.image_token_id)
        pixel_inputs = {k: v for k, v in alone.items() if k not in TEXT_KEYS}
        digest = hashlib.sha256()
        digest.update((sha256 or _pixel_hash(picture)).encode())
        for name in sorted(pixel_inputs):  # how it was processed (size, crops) is part of what the KV holds
            value = pixel_inputs[name]
            digest.update(name.encode() + str(tuple(getattr(value, "shape", ()))).encode())
        return count, digest.hexdigest(), pixel_inputs

    def features(self, image: ImageInput, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The image's encoder output, [num_tokens, hidden]: from the cache, or encoded now and kept."""
        features = self.cache.get(image.key)
        if features is None:
            self.encode([image], device, dtype)
            features = self.cache.get(image.key)
        return features

    @torch.inference_mode()
    def encode(self, images: list[ImageInput], device: torch.device, dtype: torch.dtype) -> None:
        """Encode the images not cached yet, in as few encoder calls as their shapes allow: images whose inputs
        differ only in their first dimension are concatenated into one batch (a step's images, across requests)."""
        groups: dict[tuple, list[ImageInput]] = {}
        for image in {image.key: image for image in images if self.cache.get(image.key) is None}.values():
            inputs = self._inputs(image)
            shape = tuple(sorted((k, tuple(v.shape[1:]) if torch.is_tensor(v) else repr(v)) for k, v in inputs.items()))
            groups.setdefault(shape, []).append(image)
        for group in groups.values():
            per_image = self._run_encoder(group, device, dtype) if len(group) > 1 else None
            if per_image is None:  # one image, or a batch the model's output does not split back
                per_image = [self._run_encoder([image], device, dtype)[0] for image in group]
            for image, features in zip(group, per_image):
                if features.shape[0] != image.num_tokens:
                    raise ValueError(f"the vision encoder gave {features.shape[0]} rows for {image.num_tokens} "
                                     "image tokens")
                self.cache.put(image.key, features.to(dtype))
                self.cache.num_encoded += 1

    def _inputs(self, image: ImageInput) -> dict[str, Any]:
        return {k: v for k, v in image.pixel_inputs.items() if self._takes_all or k in self._accepted}

    def _run_encoder(self, group: list[ImageInput], device: torch.device, dtype: torch.dtype
                     ) -> list[torch.Tensor] | None:
        """One `get_image_features` call over `group` -> each image's rows [num_tokens, hidden], or None when the
        output cannot be told apart image by image."""
        inputs = [self._inputs(image) for image in group]
        kwargs = {k: torch.cat([each[k] for each in inputs]).to(device) if torch.is_tensor(v) else v
                  for k, v in inputs[0].items()}
        if "pixel_values" in kwargs and kwargs["pixel_values"].is_floating_point():
            kwargs["pixel_values"] = kwargs["pixel_values"].to(dtype)
        pooled = self.model.get_image_features(**kwargs, return_dict=True).pooler_output
        self.cache.num_encoder_calls += 1
        if isinstance(pooled, (list, tuple)) and len(pooled) == len(group):
            return [part.reshape(-1, part.shape[-1]) for part in pooled]
        rows = torch.cat([part.reshape(-1, part.shape[-1]) for part in pooled]) if isinstance(
            pooled, (list, tuple)) else pooled.reshape(-1, pooled.shape[-1])
        sizes = [image.num_tokens for image in group]
        if rows.shape[0] != sum(sizes):
            return None if len(group) > 1 else [rows]
        return list(rows.split(sizes))

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, rows: list[int], images: list[tuple[ImageInput, list[int]]]
              ) -> torch.Tensor:
        """The step's token embeddings [num_tokens, hidden] with the images' encoder rows at packed `rows`."""
        table = self.model.get_input_embeddings()
        # an image token id may lie past the embedding table (its rows are replaced anyway)
        embeds = table(input_ids.masked_fill(input_ids >= table.num_embeddings, 0))
        self.encode([image for image, _ in images], embeds.device, embeds.dtype)  # the step's new images, batched
        features = torch.cat([self.features(image, embeds.device, embeds.dtype)[encoder_rows]
                              for image, encoder_rows in images])
        embeds[torch.tensor(rows, device=embeds.device)] = features
        return embeds


def _runs(positions: list[int]) -> tuple[tuple[int, int], ...]:
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1][1] += 1
        else:
            runs.append([position, position + 1])
    return tuple((start, end) for start, end in runs)


def _pixel_hash(picture: Any) -> str:
    """sha256 of an image's decoded pixels (mode and size included)."""
    digest = hashlib.sha256(f"{picture.mode}{picture.size}".encode())
    digest.update(picture.tobytes())
    return digest.hexdigest()
