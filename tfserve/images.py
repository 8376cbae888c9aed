"""Image bytes -> one RGB picture and its content hash: the decoder behind the server's image parts and the
in-process chat's. Pillow is imported on first use. What cannot be taken is an `ImageError` (a ValueError)
saying why, for the caller to word: the server answers 400 naming the content part, the chat prints one line."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import Any

# Pillow's format name -> its MIME type: what the server decodes (a GIF or an animated WebP: its first frame)
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MIME_TYPES = {**{mime: name for name, mime in FORMATS.items()}, "image/jpg": "JPEG"}  # image/jpg: a common slip
FORMAT_NAMES = "PNG, JPEG, WebP or GIF"
DEFAULT_MAX_PIXELS = 32_000_000  # 32 megapixels: a 6,500 x 4,900 photo; processors downscale far below it
DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
# all the images of one request, decoded: a 91 KB black 5600x5600 PNG passes the per-image cap, and 8 of them
# took 21 s and 2.5 GB; 64 megapixels decode to ~200 MB of RGB
DEFAULT_MAX_REQUEST_PIXELS = 64_000_000
WHITE = (255, 255, 255)


class ImageError(ValueError):
    """An image that cannot be taken: not decodable, not a supported format, too large."""


@dataclass(frozen=True, slots=True)
class MediaImage:
    """One decoded image of a request, in order of appearance."""

    image: Any  # PIL.Image.Image in RGB mode (transparency composited over white)
    # hex sha256 of the decoded pixels (size + RGB bytes), not of the file: the same picture hashes the same
    # whatever its format, encoder or URL, so the engine's prefix cache may key on it
    sha256: str
    where: str  # the content part it came from ("messages[1].content[2]"), for errors


def sniff_mime(raw: bytes) -> str | None:
    """The MIME type of PNG, JPEG, WebP or GIF bytes by their magic number; None for anything else."""
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if raw.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if raw[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return None


def data_url_bytes(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL (whitespace in the base64 is ignored). ImageError for
    another MIME type, a URL that is not base64, bad base64, or more than `max_bytes`."""
    header, comma, payload = url[len("data:"):].partition(",")
    if url[:5].lower() != "data:" or not comma:
        raise ImageError("not a data URL (data:image/png;base64,...)")
    mime, *params = [p.strip().lower() for p in header.split(";")]
    if mime not in MIME_TYPES:
        raise ImageError(f"unsupported image type {mime or 'text/plain'!r}: send {FORMAT_NAMES}")
    if "base64" not in params:
        raise ImageError("the data URL must be base64-encoded (data:image/png;base64,...)")
    payload = re.sub(r"\s+", "", payload)
    if len(payload) // 4 * 3 > max_bytes:  # before decoding: a huge payload costs nothing to refuse
        raise ImageError(f"the image is {size_text(len(payload) // 4 * 3)}; at most {size_text(max_bytes)}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's base64 is invalid") from None
    if len(raw) > max_bytes:
        raise ImageError(f"the image is {size_text(len(raw))}; at most {size_text(max_bytes)}")
    return raw


def image_pixels(raw: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> int:
    """Width x height of PNG, JPEG, WebP or GIF bytes, from the header alone (nothing is decoded): what a
    request's images will cost before any is decoded. ImageError as `decode_image` would raise it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw), formats=list(FORMATS)) as image:
            width, height = image.size
    except Image.DecompressionBombError:
        raise ImageError(f"the image has more than {max_pixels / 1e6:g} megapixels") from None
    except UnidentifiedImageError:
        raise ImageError(f"the bytes are not a {FORMAT_NAMES} image") from None
    except Exception as exc:  # noqa: BLE001  (a truncated header: Pillow raises OSError, SyntaxError...)
        raise ImageError(f"cannot decode the image: {exc}") from None
    if width * height > max_pixels:
        raise ImageError(_too_many_pixels(width, height, max_pixels))
    return width * height


def decode_image(raw: bytes, where: str = "", max_pixels: int = DEFAULT_MAX_PIXELS) -> MediaImage:
    """PNG, JPEG, WebP or GIF bytes -> a MediaImage in RGB. The size is checked from the header, before any
    pixel is decoded, so a decompression bomb costs nothing; ImageError for anything that cannot be taken."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw), formats=list(FORMATS)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(_too_many_pixels(width, height, max_pixels))
            rgb = to_rgb(image)
    except ImageError:
        raise
    except Image.DecompressionBombError:  # past twice Pillow's own limit, refused while reading the header
        raise ImageError(f"the image has more than {max_pixels / 1e6:g} megapixels") from None
    except UnidentifiedImageError:
        raise ImageError(f"the bytes are not a {FORMAT_NAMES} image") from None
    except Exception as exc:  # noqa: BLE001  (a truncated or corrupt file: Pillow raises OSError, SyntaxError...)
        raise ImageError(f"cannot decode the image: {exc}") from None
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}\n".encode())
    digest.update(rgb.tobytes())
    return MediaImage(rgb, digest.hexdigest(), where)


def to_rgb(image: Any) -> Any:
    """RGB, as processors want it; transparent pixels become white (as vLLM does) rather than whatever colour
    a dropped alpha channel leaves."""
    from PIL import Image

    if image.mode == "RGB":
        image.load()
        return image.copy()
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, WHITE)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def _too_many_pixels(width: int, height: int, max_pixels: int) -> str:
    return (f"the image is {width}x{height} ({width * height / 1e6:.1f} megapixels); at most "
            f"{max_pixels / 1e6:g} megapixels")


def size_text(num_bytes: int) -> str:
    """`20 MiB`, `1.5 KiB`, `300 bytes`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{num_bytes} bytes"
