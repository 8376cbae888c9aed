"""Another client's small chats while an attack on the server runs (issue 43's tests): each must answer in time."""

from __future__ import annotations

import threading
import time

from tiny import MODEL_NAME


class Bystander:
    """Another client's small chats, one after another on a thread while an attack runs: each must answer within
    `within_s`."""

    def __init__(self, live, within_s: float = 2.0) -> None:
        self.live, self.within_s = live, within_s
        self.latencies: list[float] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = self.live.client(timeout=30)
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, temperature=0)
            except Exception as exc:  # noqa: BLE001  (reported by check())
                self.errors.append(exc)
                return
            self.latencies.append(time.perf_counter() - started)

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        deadline = time.monotonic() + 30
        while not self.latencies and not self.errors and time.monotonic() < deadline:  # one chat at least
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, self.errors
        assert self.latencies and max(self.latencies) < self.within_s, self.latencies
