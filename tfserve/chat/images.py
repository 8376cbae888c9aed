"""Images in the terminal chat: `/image PATH`, or a path dropped into the prompt (a terminal pastes it, quoted or
with its spaces escaped), attaches a file to the next message. It goes as a base64 data URL `image_url` part,
which any OpenAI-compatible vision server reads; the in-process model decodes it itself (local.py)."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from tfserve.chat.backend import ChatError
from tfserve.images import DEFAULT_MAX_IMAGE_BYTES, FORMAT_NAMES, size_text, sniff_mime

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")
# a quoted path, or an unquoted run where a backslash escapes the next character (a space, a quote)
_TOKEN = re.compile(r"""'([^'\n]+)'|"([^"\n]+)"|((?:\\.|[^\s'"\\])+)""")


@dataclass(frozen=True, slots=True)
class Attachment:
    """An image file read for the next message."""

    path: Path
    num_bytes: int
    part: dict[str, Any]  # {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}


def read_image(path: Path, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> Attachment:
    """A PNG, JPEG, WebP or GIF file as a data URL part; ChatError (one line) for anything else."""
    try:
        if path.stat().st_size > max_bytes:
            raise ChatError(f"{path} is {size_text(path.stat().st_size)}; servers take images of at most "
                            f"{size_text(max_bytes)}")
        raw = path.read_bytes()
    except OSError as exc:
        raise ChatError(f"cannot read {path}: {exc.strerror or exc}") from None
    mime = sniff_mime(raw)
    if mime is None:
        raise ChatError(f"{path} is not a {FORMAT_NAMES} image")
    url = f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"
    return Attachment(path, len(raw), {"type": "image_url", "image_url": {"url": url}})


def path_of(text: str) -> Path:
    """What a user typed or a terminal pasted for one path: quoted, with backslash escapes, or a file:// URL."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    else:
        text = re.sub(r"\\(.)", r"\1", text)
    if text.startswith("file://"):
        text = unquote(urlsplit(text).path)
    return Path(text).expanduser()


def is_image_file(path: Path) -> bool:
    return path.name.lower().endswith(IMAGE_SUFFIXES) and path.is_file()


def starts_with_image(text: str) -> bool:
    """Whether `text` begins with an image file's path: a dropped `/home/me/cat.png` is no slash command."""
    match = _TOKEN.match(text)
    return match is not None and is_image_file(path_of(match.group(0)))


def dropped_images(text: str) -> tuple[str, list[Path]]:
    """The image files a message names (words ending in an image suffix that are existing files: what a
    terminal pastes for a dropped file) and the message without them."""
    found: list[Path] = []
    kept, start = [], 0
    for match in _TOKEN.finditer(text):
        path = path_of(match.group(0))
        if not is_image_file(path):
            continue
        found.append(path)
        kept.append(text[start:match.start()].rstrip(" \t") + (" " if match.start() else ""))
        start = match.end()
    kept.append(text[start:].lstrip(" \t"))
    return "".join(kept).strip(), found


def message_content(text: str, attachments: list[Attachment]) -> str | list[dict[str, Any]]:
    """A user message's content: the text alone, or the images first (most vision models are trained so) and
    then the text, as OpenAI content parts."""
    if not attachments:
        return text
    return [*(attachment.part for attachment in attachments), *([{"type": "text", "text": text}] if text else [])]
