"""Another client's small chats while an attack on the server runs (issue 43's tests): each must answer in time."""

from __future__ import annotations

import threading
import time

from tiny import MODEL_NAME


class Bystander:
    """Another client's small chats, one after another on a thread while an attack runs, each followed by a
    `GET /health`: each chat must answer within `within_s`, each health check within `health_within_s`."""

    def __init__(self, live, within_s: float = 2.0, health_within_s: float = 1.0) -> None:
        self.live, self.within_s, self.health_within_s = live, within_s, health_within_s
        self.latencies: list[float] = []
        self.health_latencies: list[float] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _chat(self) -> None:
        self._client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, temperature=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                self._chat()
            except Exception as exc:  # noqa: BLE001  (reported by check())
                self.errors.append(exc)
                return
            self.latencies.append(time.perf_counter() - started)
            started = time.perf_counter()
            status = self.live.request("GET", "/health")[0]
            self.health_latencies.append(time.perf_counter() - started)
            if status != 200:
                self.errors.append(AssertionError(f"/health answered {status}"))
                return

    def __enter__(self) -> Bystander:
        # One untimed chat before the attack starts: a fresh server's first chat pays for its own set-up (the chat
        # template's first render, the first step's allocations: 2.2 s once on a loaded CI machine), which is no
        # attack's doing. The client is closed on exit, so its kept-alive connection counts only while it chats.
        self._client = self.live.client(timeout=30)
        self._chat()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        deadline = time.monotonic() + 30
        while not self.latencies and not self.errors and time.monotonic() < deadline:  # one chat at least
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(30)
        self._client.close()
        assert not self.errors, self.errors
        assert self.latencies and max(self.latencies) < self.within_s, self.latencies
        assert max(self.health_latencies) < self.health_within_s, self.health_latencies


class PeakRss:
    """The highest resident set of this process (the live server runs in it) while the block runs, above the
    one at its start, in bytes (`grown`), sampled every 5 ms from /proc/self/statm."""

    def __init__(self) -> None:
        self.grown = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        import os

        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.grown = max(self.grown, self.rss() - self.start)

    def __enter__(self) -> PeakRss:
        self.start = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(5)
        self.grown = max(self.grown, self.rss() - self.start)
