"""Images in requests: a message's image parts (chat's `image_url`, the Responses API's `input_image`) become
HF-style `{"type": "image"}` parts for the chat template plus an `ImageRef` each, and `gather_images` turns
the refs into decoded images (tfserve.images): data URLs, http(s) URLs and file:// URLs as media_fetch allows,
off the event loop, every failure a 400 naming the content part. `detail` is accepted and ignored: the model's
processor decides the resolution."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfserve.images import (DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_PIXELS, DEFAULT_MAX_REQUEST_PIXELS, ImageError,
                            MediaImage, data_url_bytes, decode_image, image_pixels)
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.media_fetch import Fetcher, read_file
from tfserve.server.protocol import field, one_of, part_text, text_of

DEFAULT_MAX_IMAGES = 16  # per request
DEFAULT_FETCH_TIMEOUT_S = 10.0
DETAILS = ("auto", "low", "high")
SCHEMES = ("data", "http", "https", "file")
IMAGE_PARTS = ("image_url", "input_image")  # chat completions', the Responses API's


@dataclass(slots=True)
class MediaOptions:
    """The server's image settings (`tfserve serve`'s Media flags)."""

    allowed_domains: tuple[str, ...] = ()  # hosts image URLs may name; empty: any host whose addresses are public
    allowed_local_path: Path | None = None  # file:// URLs must resolve under it; None: file:// is refused
    max_images: int = DEFAULT_MAX_IMAGES  # per request, over the whole conversation
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # an image's encoded size (a fetch stops past it)
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # width x height, checked before decoding
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS  # the sum over a request's images, checked before any decodes
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # one URL, redirects included

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_bytes", "max_image_pixels", "max_request_pixels", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        self.allowed_domains = tuple(domain.strip().rstrip(".").lower() for domain in self.allowed_domains)
        if self.allowed_local_path is not None:
            path = Path(self.allowed_local_path).expanduser().resolve()
            if not path.is_dir():
                raise ValueError(f"allowed_local_path must be a directory (got {self.allowed_local_path})")
            self.allowed_local_path = path


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image part of a request, not yet fetched or decoded."""

    url: str  # data:, http(s): or file: URL
    where: str  # the content part, for errors: "messages[1].content[2]"


def content_of(content: Any, param: str, images: list[ImageRef]) -> str | list[dict[str, Any]]:
    """Message content -> what the chat template reads: the joined text, exactly as before, when it holds no
    image; else HF-style parts (`{"type": "text", "text"}`, `{"type": "image"}`) in order, each image's ref
    appended to `images`."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                for p in content):
        return text_of(content, param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
            images.append(image_ref(part, where))
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": part_text(part, where)})
    return parts


def image_ref(part: dict[str, Any], where: str) -> ImageRef:
    """`{"type": "image_url", "image_url": {"url", "detail"}}` (chat; a bare URL string is taken too) or
    `{"type": "input_image", "image_url", "detail"}` (responses) -> its ref; the URL's scheme is checked here."""
    if part["type"] == "image_url":
        image_url = field(part, "image_url", (dict, str), required=True, param=f"{where}.image_url")
        if isinstance(image_url, str):
            image_url = {"url": image_url}
        url = field(image_url, "url", str, required=True, param=f"{where}.image_url.url")
        detail = field(image_url, "detail", str, "auto", param=f"{where}.image_url.detail")
        detail_param = f"{where}.image_url.detail"
    else:
        if part.get("file_id") is not None:
            raise bad_request(f"{where}.file_id is not supported: this server has no Files API; send image_url "
                              "(a data: or https: URL)", f"{where}.file_id")
        url = field(part, "image_url", str, required=True, param=f"{where}.image_url")
        detail = field(part, "detail", str, "auto", param=f"{where}.detail")
        detail_param = f"{where}.detail"
    one_of(detail, DETAILS, detail_param)
    scheme = url.partition(":")[0].lower()
    if scheme not in SCHEMES or ":" not in url:
        raise bad_request(f"{where}: the image URL must be a data: URL (data:image/png;base64,...), an http(s) URL "
                          f"or a file:// URL (got {_short(url)})", where)
    return ImageRef(url, where)


def takes_images(engine: Any) -> bool:
    """Whether the served model takes images (a vision-language model, with its processor)."""
    return engine is not None and "image" in engine.input_modalities


def no_images(model: str | None, where: str) -> ApiError:
    return bad_request(f"the model {model} does not take images; send text, or serve a vision-language model",
                       where)


async def gather_images(state: Any, refs: list[ImageRef]) -> list[MediaImage]:
    """The request's images, in order: fetched, read and decoded concurrently and off the event loop. 400s,
    before anything is fetched: a model without an image processor, more images than --limit-mm-per-prompt;
    before anything is decoded: more pixels in all (from the headers) than --max-request-pixels; then any image
    that cannot be had, naming its part."""
    if not refs:
        return []
    if not takes_images(state.engine):
        raise no_images(state.model_name, refs[0].where)
    options: MediaOptions = state.media_options
    if len(refs) > options.max_images:
        raise bad_request(f"a request may hold at most {options.max_images} images (--limit-mm-per-prompt); "
                          f"this one holds {len(refs)}", refs[options.max_images].where)
    async with Fetcher(options.allowed_domains, options.max_image_bytes, options.fetch_timeout_s) as fetcher:
        raws = await _each(refs, lambda i, ref: _read(ref, options, fetcher))
    pixels = await _each(refs, lambda i, ref: asyncio.to_thread(image_pixels, raws[i], options.max_image_pixels))
    total = 0
    for ref, num_pixels in zip(refs, pixels):
        total += num_pixels
        if total > options.max_request_pixels:
            raise bad_request(f"{ref.where}: the request's images hold {sum(pixels) / 1e6:.1f} megapixels in all; "
                              f"at most {options.max_request_pixels / 1e6:g} megapixels per request "
                              "(--max-request-pixels)", ref.where)
    return await _each(refs, lambda i, ref: asyncio.to_thread(decode_image, raws[i], ref.where,
                                                              options.max_image_pixels))


async def _each(refs: list[ImageRef], work: Any) -> list[Any]:
    """`await work(index, ref)` for every ref concurrently, in order; the first failure (an ImageError: a 400 naming its
    part) answers and the others stop (a decode already running finishes in its thread)."""
    async def one(index: int, ref: ImageRef) -> Any:
        try:
            return await work(index, ref)
        except ImageError as exc:
            raise bad_request(f"{ref.where}: {exc}", ref.where) from None

    tasks = [asyncio.ensure_future(one(index, ref)) for index, ref in enumerate(refs)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _read(ref: ImageRef, options: MediaOptions, fetcher: Fetcher) -> bytes:
    """The image's bytes, undecoded."""
    scheme = ref.url.partition(":")[0].lower()
    if scheme == "data":
        return await asyncio.to_thread(data_url_bytes, ref.url, options.max_image_bytes)
    if scheme == "file":
        return await asyncio.to_thread(read_file, ref.url, options.allowed_local_path, options.max_image_bytes)
    return await fetcher.fetch(ref.url)


def _short(url: str, limit: int = 60) -> str:
    return repr(url if len(url) <= limit else url[:limit - 3] + "...")
