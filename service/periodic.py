"""A daemon thread that calls `tick()` every `interval` seconds until `stop()`: the API process's
background loops (the reaper, service/reaper.py; the webhook sender, service/webhook_delivery.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any


class PeriodicThread:
    def __init__(self, name: str, interval: float, tick: Callable[[], Any]) -> None:
        self.interval = interval
        self._tick = tick
        self._log = logging.getLogger(f"loraq.{name}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"loraq-{name}", daemon=True)

    def start(self) -> PeriodicThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except Exception:  # a database blip must not end the loop; the next tick retries
                self._log.warning("%s tick failed", self._thread.name, exc_info=True)
