"""What a worker does with an error a request survives (a load recomputed, a save not stored):
log it, the first of each kind with its traceback, or, in strict mode, raise it unless it is
the store's fault (kvlab.store.faults), so that a bug never looks like a recompute."""

from __future__ import annotations

import logging
import threading
import traceback
from concurrent.futures import Future
from typing import Callable

from kvlab.store.faults import is_store_fault

logger = logging.getLogger("kvlab.connector")


class Errors:
    """The worker's errors: :meth:`absorb` one where it is caught, :meth:`job_done` for a job
    of the save thread, and :meth:`raise_pending` on the model runner's thread (strict mode:
    a save job's error raises there, at its next call). ``faults`` gives the errors that are
    the store's (KVStore.faults: they change with its tiers)."""

    def __init__(self, strict: bool, faults: Callable[[], tuple[type[BaseException], ...]]) -> None:
        self.strict, self._faults = strict, faults
        self._lock = threading.Lock()
        self._logged: set[tuple] = set()  # kinds of error logged with their traceback
        self._pending: list[BaseException] = []  # strict: save jobs' errors, raised on the runner's thread

    def absorb(self, what: str, error: BaseException, then: str) -> None:
        """``what`` failed with ``error`` and the request goes on as ``then`` says: raised
        again in strict mode unless it is the store's fault; else logged, each time, the
        first of each kind (its type and where it was raised) with its traceback."""
        if self.strict and not is_store_fault(error, self._faults()):
            raise error
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        kind = (what, type(error), frame and (frame.filename, frame.lineno))
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        logger.warning("KVLabConnector: %s failed (%s: %s); %s", what, type(error).__name__, error, then,
                       exc_info=error if first else None)

    def job_done(self, future: Future) -> None:
        """A save job ended: one that raised (in strict mode, a bug) raises on the model
        runner's thread at its next call; otherwise it is logged, never lost."""
        error = future.exception()
        if error is None:
            return
        if self.strict:
            with self._lock:
                self._pending.append(error)
        else:
            self.absorb("a save job", error, "what it was to store is not stored")

    def raise_pending(self) -> None:
        """Raise the first error of a save job since the last call (strict mode)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            raise pending[0]
