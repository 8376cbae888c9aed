"""The replica count from the load (`--min-replicas`/`--max-replicas`): Ray Serve's rule. The count the load asks
for is the requests in flight (running and queued) over a target per replica, within [min, max]; the count
changes once the load has asked for more for `upscale_delay_s` (a burst of seconds scales nothing), or for fewer
for `downscale_delay_s` (a lull does not retire a replica that the next minute needs again)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_REPLICAS = 256  # the most replicas a server runs (--data-parallel-size, --max-replicas, POST /admin/replicas)


@dataclass(frozen=True)
class AutoscalePolicy:
    min_replicas: int
    max_replicas: int
    target_requests: int = 16  # requests in flight per replica the count aims at
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1 (got {self.min_replicas})")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not be above max_replicas ({self.max_replicas})")
        if self.target_requests < 1:
            raise ValueError(f"target_requests must be >= 1 (got {self.target_requests})")

    def wanted(self, num_in_flight: int) -> int:
        """The replica count `num_in_flight` requests ask for."""
        return min(self.max_replicas, max(self.min_replicas, math.ceil(num_in_flight / self.target_requests)))


class Autoscaler:
    """Fed the load every second or so, `decide` answers the count to scale to, or None to stay."""

    def __init__(self, policy: AutoscalePolicy) -> None:
        self.policy = policy
        self._since: float | None = None  # when the load began to ask for a change, in its direction
        self._up = False

    def decide(self, now: float, num_in_flight: int, num_replicas: int) -> int | None:
        wanted = self.policy.wanted(num_in_flight)
        if wanted == num_replicas:
            self._since = None
            return None
        up = wanted > num_replicas
        if self._since is None or up != self._up:
            self._since, self._up = now, up
        delay = self.policy.upscale_delay_s if up else self.policy.downscale_delay_s
        if now - self._since < delay:
            return None
        self._since = None
        return wanted
