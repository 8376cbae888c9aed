"""Where an image URL's bytes come from, under the server's media policy: http(s) URLs fetched with a byte cap
and a timeout, from allowed hosts only (--allowed-media-domains; without it any host whose every address is
public, so a request cannot make the server probe its own network), and file:// URLs under one directory
(--allowed-local-media-path). Every refusal is an ImageError saying why; the caller names the content part."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from tfserve.images import ImageError, size_text

MAX_REDIRECTS = 5
CHUNK_BYTES = 64 * 1024
REDIRECTS = (301, 302, 303, 307, 308)


# IPv6 prefixes that reach an IPv4 address by translation (NAT64, RFC 6052 and RFC 8215's local one) or that
# embed one (IPv4-compatible ::a.b.c.d, IPv4-translated ::ffff:0:a.b.c.d): refused whatever the address inside
_TRANSLATED = tuple(ipaddress.ip_network(net) for net in ("64:ff9b::/96", "64:ff9b:1::/48", "::/96",
                                                          "::ffff:0:0:0/96"))


def is_public(address: str) -> bool:
    """False for private, loopback, link-local, shared, reserved, multicast and unspecified addresses, for NAT64
    and IPv4-compatible IPv6 addresses, and for an IPv6 address embedding a non-public IPv4 one (IPv4-mapped,
    6to4, either end of Teredo)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # a link-local IPv6 address may carry its zone
    if isinstance(ip, ipaddress.IPv4Address):
        return ip.is_global and not ip.is_multicast
    if any(ip in net for net in _TRANSLATED):
        return False
    embedded = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())]
    if any(v4 is not None for v4 in embedded):
        return all(is_public(str(v4)) for v4 in embedded if v4 is not None)
    return ip.is_global and not ip.is_multicast


class _PublicResolver(AbstractResolver):
    """The system resolver, refusing a host with any non-public address. Connections go to the addresses
    checked here, so a name that resolves differently a moment later (DNS rebinding) gains nothing."""

    def __init__(self) -> None:
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list:
        results = await self._inner.resolve(host, port, family)
        for result in results:
            if not is_public(result["host"]):  # which address is not said: the client learns nothing of the DNS
                raise ImageError(f"{host} resolves to a private or reserved address: refused (the server's "
                                 "--allowed-media-domains can allow it)")
        return results

    async def close(self) -> None:
        await self._inner.close()


class Fetcher:
    """Fetches the http(s) images of one request (`async with`: its connections close with it)."""

    def __init__(self, allowed_domains: tuple[str, ...], max_bytes: int, timeout_s: float) -> None:
        self.allowed_domains, self.max_bytes, self.timeout_s = allowed_domains, max_bytes, timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Fetcher:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._session is not None:
            await self._session.close()

    async def fetch(self, url: str) -> bytes:
        """The body of `url` (redirects followed, each checked); ImageError for anything refused or failed."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url)
        except TimeoutError:
            raise ImageError(f"fetching {_short(url)} took longer than {self.timeout_s:g} s") from None
        except ImageError:
            raise
        except aiohttp.ClientOSError as exc:  # its words name the address connected to: not the client's business
            raise ImageError(f"cannot fetch {_short(url)}: cannot connect to its host ({type(exc).__name__})") from None
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a URL (or a redirect's) yarl cannot read
            raise ImageError(f"cannot fetch {_short(url)}: {exc or type(exc).__name__}") from None

    async def _fetch(self, url: str) -> bytes:
        session = self._open()
        for _ in range(MAX_REDIRECTS + 1):
            self._check(url)
            async with session.get(url, allow_redirects=False, headers={"Accept": "image/*"}) as response:
                if response.status in REDIRECTS and "Location" in response.headers:
                    url = str(response.url.join(URL(response.headers["Location"])))
                    continue
                if response.status != 200:
                    raise ImageError(f"fetching {_short(url)} answered HTTP {response.status}")
                if (response.content_length or 0) > self.max_bytes:
                    raise ImageError(f"{_short(url)} is {size_text(response.content_length)}; at most "
                                     f"{size_text(self.max_bytes)}")
                body = bytearray()
                async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise ImageError(f"{_short(url)} is more than {size_text(self.max_bytes)}")
                return bytes(body)
        raise ImageError(f"{_short(url)} redirects more than {MAX_REDIRECTS} times")

    def _check(self, url: str) -> None:
        """The URL's scheme and host against the policy; a host name's addresses are checked as it resolves."""
        try:
            parsed = URL(url)
        except ValueError:
            raise ImageError(f"{_short(url)} is not a valid URL") from None
        host = (parsed.host or "").rstrip(".").lower()
        if parsed.scheme not in ("http", "https") or not host:
            raise ImageError(f"{_short(url)} is not an http(s) URL")
        if self.allowed_domains:
            if host not in self.allowed_domains:
                raise ImageError(f"{host} is not among the server's --allowed-media-domains")
            return
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            return  # a name: _PublicResolver checks what it resolves to
        if not is_public(str(literal)):
            raise ImageError(f"{host} is a private or reserved address: refused (the server's "
                             "--allowed-media-domains can allow it)")

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # an operator's allow-list is trusted as it stands (an internal host may be the point of it)
            resolver = None if self.allowed_domains else _PublicResolver()
            connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session


def read_file(url: str, root: Path | None, max_bytes: int) -> bytes:
    """The bytes of a `file://` URL whose real path (symlinks and `..` resolved) lies under `root`."""
    if root is None:
        raise ImageError("file:// URLs are refused: the server was started without --allowed-local-media-path")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ImageError("a file:// URL names a path on the server: file:///path/to/image.png")
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root):  # checked before the file is looked at: nothing outside is probed
        raise ImageError(f"{unquote(parts.path)} is outside the server's --allowed-local-media-path")
    try:
        with path.open("rb") as file:
            raw = file.read(max_bytes + 1)
    except OSError as exc:
        raise ImageError(f"cannot read {unquote(parts.path)}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise ImageError(f"{path.name} is more than {size_text(max_bytes)}")
    return raw


def _short(url: str, limit: int = 100) -> str:
    return url if len(url) <= limit else url[:limit - 3] + "..."
