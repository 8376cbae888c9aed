"""Connection-level limits, below any request: a header-read timeout (a client that opens a connection and
never finishes its request's headers, slowloris, is closed after `header_timeout_s`), a cap on open
connections and on connections from one client address (past either, a 503 and close), and one log line
every few seconds, not a traceback per failing `accept()`, when the process runs out of open files.

aiohttp has none of these: they hook its protocol (`LimitedHandler`, the server's handler class) and the
event loop's exception handler (`quiet_accept_errors`). nginx's client_header_timeout and limit_conn do the
same in front of a server."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from collections import Counter

from aiohttp.web_protocol import RequestHandler

from tfserve.server.runtime.connection_limits import ConnectionLimits

logger = logging.getLogger("tfserve.server")

_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class RateLimitedLog:
    """One warning line per `interval_s` at most, saying how many more happened since the last one."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s, self.num_skipped, self._last = interval_s, 0, float("-inf")

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self.num_skipped += 1
            return
        skipped, self.num_skipped, self._last = self.num_skipped, 0, now
        logger.warning(message + (f" (and {skipped} more since the last such line)" if skipped else ""), *args)


class ConnectionTracker:
    """Open connections, in all and per client address; says which a new one would exceed."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.num_open = 0
        self.per_client: Counter[str] = Counter()
        self.refusals = RateLimitedLog()

    def admit(self, client: str) -> str | None:
        """Count a new connection from `client` in; the cap it would exceed instead (it is then not counted)."""
        limits = self.limits
        if limits.max_connections and self.num_open >= limits.max_connections:
            return f"the server holds its --max-connections ({limits.max_connections}) open connections"
        if client and limits.max_connections_per_client and self.per_client[client] >= limits.max_connections_per_client:
            return (f"this client address holds its --max-connections-per-client "
                    f"({limits.max_connections_per_client}) open connections")
        self.num_open += 1
        if client:
            self.per_client[client] += 1
        return None

    def release(self, client: str) -> None:
        self.num_open -= 1
        if client:
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]


class LimitedHandler(RequestHandler):
    """aiohttp's protocol under the server's ConnectionTracker (its manager's `tracker`; none: no limits)."""

    __slots__ = ("_header_timer", "_client", "_counted")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._client, self._counted = "", False
        super().connection_made(transport)
        tracker: ConnectionTracker | None = getattr(self._manager, "tracker", None)
        if tracker is None:
            return
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refused = tracker.admit(self._client)
        if refused is not None:
            tracker.refusals.warning("refused a connection from %s: %s", self._client or "a local socket", refused)
            _refuse(transport, refused)
            self.force_close()
            return
        self._counted = True
        self._arm_header_timer(tracker.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        num_requests = self._request_count
        busy = self._request_in_progress or bool(self._messages)  # bytes now may be a request's body
        super().data_received(data)
        if self._request_count > num_requests:  # a request's headers are complete
            self._cancel_header_timer()
        elif not busy and data and self._header_timer is None and self._counted:  # the next request's first bytes
            self._arm_header_timer(self._manager.tracker.limits.header_timeout_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        if self._counted:
            self._counted = False
            tracker = getattr(self._manager, "tracker", None)
            if tracker is not None:
                tracker.release(self._client)
        super().connection_lost(exc)

    def _arm_header_timer(self, timeout_s: float) -> None:
        self._header_timer = self._loop.call_later(timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        """The request's headers did not all come in time: close (as nginx's client_header_timeout does)."""
        self._header_timer = None
        if not self._request_in_progress and not self._messages:
            logger.debug("closed a connection from %s: its request headers took over the header timeout",
                         self._client or "a local socket")
            self.force_close()


def _refuse(transport: asyncio.BaseTransport, reason: str) -> None:
    body = json.dumps({"error": {"message": f"too many connections: {reason}; retry later",
                                 "type": "service_unavailable", "param": None, "code": "too_many_connections"}})
    transport.write((f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n{body}").encode())


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Out of open files, asyncio logs a traceback each time `accept()` fails: one warning line every 10 s
    instead. Other errors go to the loop's handler as before."""
    previous = loop.get_exception_handler()
    lines = RateLimitedLog()

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FILES:
            lines.warning("cannot accept connections: %s (lower --max-connections or raise ulimit -n)",
                          exc.strerror or exc)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
