"""What a worker's failed loads mean for the KV it stores: one object, named transitions."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvlab.connector.messages import SaveSpec


class FailureRules:
    """The worker's rules for failed loads, as transitions named for what happened.

    **Never save over a failed load.** A load that fails leaves its blocks holding whatever
    they held before (another request's KV), and all the forward computes on top of them is
    wrong too. So a save of a request is cancelled from the step one of its loads fails until
    the scheduler has planned the request again over the recomputed blocks, and so is a save
    of the failing step that touches a failed block (another request sharing it); vLLM
    recomputes the blocks, and the scheduler is told which requests to plan again and which
    chunks to forget.

    - :meth:`load_failed`: blocks of a request did not load (vLLM is told to recompute them);
    - :meth:`replanned`: the scheduler planned these requests again: their saves may store;
    - :meth:`forward_done`: the step's forward ran: its failed requests' saves are cancelled
      from now on, and the scheduler hears of them;
    - :meth:`cancels`: whether a save must store nothing;
    - :meth:`save_cancelled`, :meth:`chunk_failed`: a memory chunk the scheduler counted on is
      not there (a save stored nothing, or the chunk failed its check): it forgets it;
    - :meth:`tier_missed`: a tier could not give a chunk: it is checked again before it is promised;
    - :meth:`finished`: finished requests are forgotten.

    Thread-safe: fetch threads and the save thread report beside the model runner."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()  # blocks vLLM has yet to be told to recompute
        self._step_requests: set[str] = set()  # requests whose load failed in this step
        self._step_blocks: set[int] = set()  # and their blocks
        self._wrong_blocks: set[int] = set()  # blocks whose load failed in the step whose saves are planned now
        self._cancelled: set[str] = set()  # requests whose saves store nothing until replanned
        self._reported: set[str] = set()  # requests the scheduler is to plan again
        self._failed_chunks: set[str] = set()  # memory chunks the scheduler is to forget
        self._missed: set[tuple[str, str]] = set()  # (tier, chunk key) a tier could not give

    # ---- transitions ---------------------------------------------------------------------
    def load_failed(self, req_id: str, block_ids: Iterable[int]) -> None:
        """Blocks of ``req_id`` did not load: vLLM recomputes them, and none of the request's
        saves may store what its cache holds until it is planned again."""
        with self._lock:
            self._load_errors.update(block_ids)
            self._step_blocks.update(block_ids)
            self._step_requests.add(req_id)

    def replanned(self, req_ids: Iterable[str]) -> None:
        """The scheduler planned these requests again over recomputed blocks: their saves
        store again (unless a load of theirs fails in this step too)."""
        with self._lock:
            self._cancelled.difference_update(req_ids)

    def forward_done(self) -> None:
        """The step's forward ran: the saves of the requests whose load failed in it are
        cancelled until they are replanned, the saves planned now are checked against its
        failed blocks, and the scheduler is told of them in the step's report."""
        with self._lock:
            self._cancelled |= self._step_requests
            self._reported |= self._step_requests
            self._wrong_blocks, self._step_blocks, self._step_requests = self._step_blocks, set(), set()

    def save_cancelled(self, spec: SaveSpec) -> None:
        """A save stored nothing (cancelled): the chunk the scheduler reserved in memory for it
        is given back."""
        if spec.memory:
            self.chunk_failed(spec.block_keys[-1])

    def chunk_failed(self, chunk_key: str) -> None:
        """A memory chunk the scheduler counts on is not there (not kept, or dropped after it
        failed its check): it forgets it everywhere."""
        with self._lock:
            self._failed_chunks.add(chunk_key)

    def tier_missed(self, tier: str, chunk_key: str) -> None:
        """``tier`` could not give the chunk: the scheduler checks it again before it promises it."""
        with self._lock:
            self._missed.add((tier, chunk_key))

    def finished(self, req_ids: Iterable[str]) -> None:
        """Finished requests: nothing of theirs is saved any more."""
        with self._lock:
            self._cancelled.difference_update(req_ids)

    # ---- what they decide --------------------------------------------------------------------
    def saves_cancelled(self, req_id: str) -> bool:
        """Whether ``req_id``'s saves store nothing (a load of it failed, not yet replanned)."""
        with self._lock:
            return req_id in self._cancelled

    def cancels(self, spec: SaveSpec) -> bool:
        """Whether ``spec`` must store nothing: its request's saves are cancelled, or it
        touches a block whose load failed in the step."""
        with self._lock:
            return spec.req_id in self._cancelled or not self._wrong_blocks.isdisjoint(spec.block_ids)

    def take_load_errors(self) -> set[int]:
        """The blocks vLLM is to recompute, once (``get_block_ids_with_load_errors``)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_reports(self) -> tuple[set[str], set[str], set[tuple[str, str]]]:
        """For the step's report to the scheduler, once: the memory chunks to forget, the
        requests to plan again, and the (tier, chunk key) pairs a tier could not give."""
        with self._lock:
            taken = self._failed_chunks, self._reported, self._missed
            self._failed_chunks, self._reported, self._missed = set(), set(), set()
        return taken
