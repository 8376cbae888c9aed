"""Request bytes -> one JSON object, or a 4xx naming what is wrong: the Content-Encoding (decoded here, not by
aiohttp, so that a bad one is a JSON error and the keep-alive connection stays usable), then strict JSON as
OpenAI's parser reads it: no NaN or Infinity, no number too large for a double, at most `MAX_DEPTH` levels of
nesting, and strings that are valid Unicode (no lone UTF-16 surrogates from `\\ud800` escapes)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import zlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from tfserve.server.errors import ApiError, bad_request

MAX_DEPTH = 64  # levels of arrays and objects; tool schemas need a dozen at most
# a body none of whose bytes came for this long is given up (408): a client that opens a request and stops
# sending would hold its handler, and a drain, for ever; a slow upload that keeps sending goes on
BODY_IDLE_TIMEOUT_S = 30.0
_T = TypeVar("_T")
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_CONTAINERS = (dict, list)
_PARSE_ON_LOOP_BYTES = 2**20  # bodies up to this size are parsed on the event loop (a thread costs more)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way a JSON body can hold a surrogate


class _StrictJsonError(ValueError):
    """A value JSON allows in Python but not in OpenAI's parser."""


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 400 when it is not one, 413 when it (decompressed) is over `client_max_size`,
    415 for a Content-Encoding other than identity, gzip and deflate, or more than one of them."""
    raw = await while_arriving(request, request.read())
    codings = _codings(request.headers.get("Content-Encoding", ""))
    if len(codings) > 1:  # browsers, proxies and SDKs send one; each layer more is only work for the server
        raise ApiError(415, f"Content-Encoding {', '.join(codings)!r} stacks {len(codings)} encodings; send at most "
                       "one (gzip or deflate)", code="unsupported_content_encoding")
    if codings:  # off the event loop: inflating up to client_max_size bytes takes a while
        raw = await asyncio.to_thread(_decode, raw, codings[0], request.client_max_size)
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    # a large body is parsed on a thread: the C parser holds the GIL, but the depth walk after it lets the event
    # loop in (a 13 MB body of 400,000 messages held every other request for 1.3 s)
    body = await asyncio.to_thread(loads, raw) if len(raw) > _PARSE_ON_LOOP_BYTES else loads(raw)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        _check_unicode(body)
    return body


async def while_arriving(request: web.Request, reading: Awaitable[_T]) -> _T:
    """Await `reading` (what reads the body of `request`) while the body keeps arriving; a 408 once no byte of it
    has come for BODY_IDLE_TIMEOUT_S (the connection then closes: the rest of the body is not read)."""
    task = asyncio.ensure_future(reading)
    poll = min(1.0, BODY_IDLE_TIMEOUT_S / 4)
    received, idle = request.content.total_bytes, 0.0
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if request.content.total_bytes != received:
                received, idle = request.content.total_bytes, 0.0
                continue
            idle += poll
            if idle >= BODY_IDLE_TIMEOUT_S:
                raise ApiError(408, f"the request body stopped arriving: no byte of it came for {idle:g} s "
                               f"({received} received)", code="request_timeout", headers={"Connection": "close"})
    finally:
        task.cancel()  # a no-op once done; else the read stops with the request (given up, or its client gone)


def loads(text: str | bytes, param: str | None = None) -> Any:
    """Strict JSON (see the module docstring); a 400 naming `param` when it is not."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad_request(f"the JSON is nested too deeply (at most {MAX_DEPTH} levels)", param) from None
    except ValueError as exc:  # also UnicodeDecodeError, and ints over Python's 4,300-digit limit
        what = "the request body" if param is None else param
        raise bad_request(f"{what} is not valid JSON: {exc}", param) from None
    if isinstance(value, (dict, list)) and _num_brackets(text) > MAX_DEPTH:  # else it cannot be too deep
        _check_depth(value, param)
    return value


def _num_brackets(text: str | bytes) -> int:
    square, curly = (b"[", b"{") if isinstance(text, bytes) else ("[", "{")
    return text.count(square) + text.count(curly)


def _reject_constant(name: str) -> Any:
    raise _StrictJsonError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _StrictJsonError(f"the number {text[:40]} is out of range")
    return value


def _check_depth(value: dict | list, param: str | None) -> None:
    # level by level, not recursively (a recursive walk would itself overflow on the bodies it is meant to
    # refuse), each level one comprehension: 400,000 tiny messages take 0.45 s, not the 2 s of a stack's loop
    level, depth = [value], 1
    while level:
        if depth > MAX_DEPTH:
            raise bad_request(f"the JSON is nested too deeply (at most {MAX_DEPTH} levels)", param)
        level = [child for parent in level for child in (parent.values() if type(parent) is dict else parent)
                 if type(child) in _CONTAINERS]
        depth += 1


def _check_unicode(body: dict[str, Any]) -> None:
    for name, value in body.items():
        try:
            json.dumps({name: value}, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise bad_request(f"{name} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); "
                              "strings must be valid Unicode", name) from None


def _codings(header: str) -> list[str]:
    return [c.strip().lower() for c in header.split(",") if c.strip() and c.strip().lower() != "identity"]


def _decode(raw: bytes, coding: str, max_size: int) -> bytes:
    """One Content-Encoding undone, never to more than `max_size` bytes (a small gzip can inflate to gigabytes)."""
    wbits = _WBITS.get(coding)
    if wbits is None:
        raise ApiError(415, f"Content-Encoding {coding!r} is not supported; send the body plain, gzip or deflate",
                       code="unsupported_content_encoding")
    if coding == "deflate" and raw and raw[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS  # a raw deflate stream without the zlib header, as some clients send
    decompressor = zlib.decompressobj(wbits)
    try:
        body = decompressor.decompress(raw, max_size + 1)
    except zlib.error as exc:
        raise bad_request(f"the request body is not valid {coding} data ({exc})") from None
    if len(body) > max_size:
        raise ApiError(413, f"the request body is over {max_size} bytes once decompressed",
                       code="request_too_large")
    if not decompressor.eof:
        raise bad_request(f"the request body is truncated {coding} data")
    return body
