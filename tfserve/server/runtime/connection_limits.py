"""What one connection, and one client address, may hold (connections.py holds a server to it). Apart from
connections.py so that the CLI reads its defaults without importing aiohttp."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("tfserve.server")

DEFAULT_HEADER_TIMEOUT_S = 15.0
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 128
RESERVED_FILES = 128  # open files kept for the model, the engine and the log beside the connections


@dataclass(slots=True)
class ConnectionLimits:
    """What one connection, and one client address, may hold. 0 for a cap: none."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a request's headers must all arrive within this
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections at most; more get 503 and close
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT  # from one client address at most

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0 (got {self.header_timeout_s})")
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, 0 for no cap (got {getattr(self, name)})")

    def within_open_files(self) -> ConnectionLimits:
        """These limits with max_connections lowered to fit under the process's open-file limit (a warning says
        so): past it, `accept()` fails and nothing, /health included, can connect."""
        try:
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (ImportError, OSError, ValueError):
            return self
        if soft == resource.RLIM_INFINITY:
            return self
        fits = max(16, soft - RESERVED_FILES)
        if self.max_connections and self.max_connections <= fits:
            return self
        logger.warning("--max-connections lowered to %d: the open-file limit is %d (ulimit -n raises it)", fits, soft)
        return ConnectionLimits(self.header_timeout_s, fits, self.max_connections_per_client)
