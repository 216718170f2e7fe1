"""Which errors are the store's faults, not kvlab's: what the connector recomputes even in
its strict mode, where any other error (a bug) is raised."""

from __future__ import annotations


class StoreFault(Exception):
    """A fault of the store or of the KV it holds (a tier down or full, a damaged chunk, KV
    looked up under other weights), not of kvlab's code. A tier's own error class derives
    from it, or the tier names its client's in ``errors``."""


class FailedCheck(StoreFault, ValueError):
    """KV that failed a check: a checksum, a MAC, a header, or weights loaded since the lookup."""


# What is a store's fault whatever its tiers (KVStore.faults adds the errors each tier names as its own).
FAULTS: tuple[type[BaseException], ...] = (OSError, StoreFault)


def is_store_fault(error: BaseException, faults: tuple[type[BaseException], ...] = FAULTS) -> bool:
    """Whether ``error``, or an error it was raised from, is one of ``faults``."""
    while error is not None:
        if isinstance(error, faults):
            return True
        error = error.__cause__
    return False
