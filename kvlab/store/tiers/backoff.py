"""The one back-off of every shared tier: after a failure it pauses for a doubling while
(``RETRY_FIRST_S`` up to ``RETRY_MAX_S``), and it logs each kind of fault once."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

logger = logging.getLogger("kvlab.store")

# Seconds a tier that failed waits before it tries again (doubling up to the max).
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 300.0


class Backoff:
    """Pause after each failure for the current delay, which doubles (up to RETRY_MAX_S)
    until a success resets it; and a warning per kind of fault, the first time only.
    Thread-safe: a tier's threads fail, succeed and log through one back-off."""

    def __init__(self) -> None:
        self.delay_s = RETRY_FIRST_S  # the next pause
        self._until = 0.0
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @property
    def paused(self) -> bool:
        """Whether the last failure's pause still runs."""
        return time.monotonic() < self._until

    def fail(self) -> float:
        """Start a pause of the current delay and double the next; returns the pause (s)."""
        with self._lock:
            pause = self.delay_s
            self._until = time.monotonic() + pause
            self.delay_s = min(2 * pause, RETRY_MAX_S)
        return pause

    def succeed(self) -> None:
        """It worked: no pause, and the next failure pauses for RETRY_FIRST_S again."""
        with self._lock:
            self.delay_s = RETRY_FIRST_S
            self._until = 0.0

    def log_once(self, kind: str, message: str, *args: object) -> None:
        """``logger.warning(message, *args)`` the first time ``kind`` happens."""
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning(message, *args)

    def call(self, stats: Any, kind: str, operation: Callable[[], Any], errors: tuple[type[BaseException], ...],
             where: str, skipped: str) -> Any:
        """``operation()`` for a shared tier, or None: while paused (a write counted in
        ``stats.<skipped>``), or when it raises one of ``errors`` (a read or write error
        counted, logged once naming ``where``, and a pause started)."""
        if self.paused:
            if kind == "write":
                setattr(stats, skipped, getattr(stats, skipped) + 1)
            return None
        try:
            result = operation()
        except errors as error:
            stats.write_errors += kind == "write"
            stats.read_errors += kind == "read"
            pause = self.fail()
            self.log_once(kind, "KVLabConnector store: %s failed a %s (%s); the tier pauses for %g s, then less "
                          "often; requests go on", where, kind, error, pause)
            return None
        self.succeed()
        return result
