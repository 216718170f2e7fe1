"""Where a hit from a file tier (shm, or disk while its files are in the page cache) spends
its time, part by part, read both ways kvlab reads one: into a buffer that is then copied
into the paged cache (a layerwise load, or a store with an ``auth_key``, still reads so), and
straight into the cache's blocks (:func:`kvlab.store.chunk.read_payload`). Beside them, the
memory tier's copy and the STREAM copy of the same bytes, on the machine's threads and on one
(what a vLLM CPU worker with one compute thread can copy), in the same run. Notebook 05,
section 2, and docs/results.md."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import statistics
from pathlib import Path
from typing import Callable, Iterator

import torch

from kvlab.cache import ModelGeometry, allocate
from kvlab.experiments.scaling import stream_copy_samples
from kvlab.experiments.timing import repeated
from kvlab.runtime.progress import progress
from kvlab.store import KVStore
from kvlab.store.chunk import FILE_SUFFIX, Chunk, Placement, checksum, parse_header, payload_runs
from kvlab.transfer import file_reads
from kvlab.transfer.engine import Transfer, run_all

CHUNK_TOKENS = 256  # the connector's default chunk
FILE_TIERS = ("shm", "disk")
STREAM = "STREAM copy of the bytes"
ONE_THREAD_STREAM = "STREAM copy of the bytes, one thread"
RUNS_ALONE = "the kernel's read into the cache's runs"  # as a read straight into the cache makes them, unchecked


def tier_read_profile(geometry: ModelGeometry, workdir: str | Path, tokens: int = 2048, repeats: int = 15,
                      layout: str = "CPU_LBHNC", shm_root: str | Path = "/dev/shm") -> list[dict]:
    """A hit of ``tokens`` tokens in chunks of CHUNK_TOKENS, timed ``repeats`` times on one
    thread (the connector reads two chunks at once), part by part: each file tier's header
    reads, its buffered read (open, read or map, checksum) and the copy of those buffers into
    the cache, its read straight into the cache (open, read, checksum as the bytes arrive),
    the same reads into the cache's runs with nothing checked (what the runs cost), and the
    kernel's read of the same files into memory already in place, nothing checked (what the
    medium costs); the memory tier's copy; the checksum of the bytes in memory; the STREAM copy of
    them on one thread and on the machine's threads. One row per (tier, path, part): the median milliseconds and every sample.
    ``workdir`` holds the disk tier's folder, ``shm_root`` the shm tier's."""
    if tokens < CHUNK_TOKENS or tokens % geometry.block_size or repeats < 1:
        raise ValueError(f"need whole blocks of at least one chunk ({CHUNK_TOKENS} tokens) and a repeat, got "
                         f"{tokens} tokens of {geometry.block_size}-token blocks and {repeats} repeats")
    per_chunk = CHUNK_TOKENS // geometry.block_size
    blocks = tokens // geometry.block_size
    cache = allocate(layout, geometry, 2 * blocks)
    for tensor in cache.storage:
        tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(0))
    targets = [list(range(blocks + start, min(blocks + start + per_chunk, 2 * blocks)))
               for start in range(0, blocks, per_chunk)]
    chunks = [_chunk(cache, [b - blocks for b in ids], f"{layout}-{i}") for i, ids in enumerate(targets)]
    nbytes = sum(c.nbytes for c in chunks)
    method = "memcpy" if file_reads.unavailable() is None else "gather"

    def copy_in(found: list[Chunk]) -> None:
        run_all([Transfer(c.buffer, list(range(len(ids))), cache, ids, method) for c, ids in zip(found, targets)])

    parts: dict[tuple[str, str, str], list[float]] = {}
    timed = _timer(parts, repeats)
    with _one_thread():  # as a vLLM CPU worker with one compute thread copies
        timed(("memory", "buffered", "copy into the cache"), lambda: copy_in(chunks))
        timed(("memory", "reference", "checksum of the bytes"), lambda: [checksum(c.buffer.storage) for c in chunks])
        for tier in progress(FILE_TIERS, desc="file tiers", unit="tier"):
            root = Path(shm_root if tier == "shm" else workdir) / f"kvlab-tier-reads-{tier}"
            store = KVStore(tiers={tier: {"path": str(root)}}, promote=False)
            for chunk in chunks:
                store.save(chunk, memory=False)
            source, keys = store.tier(tier), [c.key for c in chunks]
            timed((tier, "buffered", "open and check the headers"), lambda: store.describe(tier, keys))
            held: list[Chunk | None] = []

            def read() -> None:
                held[:] = [source.get(k) for k in keys]  # the last read's buffers go as the next one's come
                if None in held:
                    raise RuntimeError(f"the {tier} tier did not give back a chunk it holds")

            timed((tier, "buffered", "read and checksum"), read)
            timed((tier, "buffered", "copy into the cache"), lambda: copy_in(held))
            parts[(tier, "buffered", "in all")] = [a + b for a, b in zip(parts[(tier, "buffered", "read and checksum")],
                                                                         parts[(tier, "buffered", "copy into the cache")])]
            held.clear()
            def read_into() -> None:
                for key, ids in zip(keys, targets):
                    if source.read_into(key, Placement(cache, list(range(len(ids))), ids), lambda header: True) is None:
                        raise RuntimeError(f"the {tier} tier did not read a chunk it holds into the cache")

            files = [root / f"{key}{FILE_SUFFIX}" for key in keys]
            if source.can_read_into(cache):
                timed((tier, "into the cache", "read and checksum"), read_into)
                timed((tier, RUNS_ALONE, "in all"), _reads_into_runs(files, keys, targets, cache))
            resident = torch.ones(max(f.stat().st_size for f in files), dtype=torch.uint8)  # its pages in place
            timed((tier, "the kernel's read alone", "in all"), lambda: [_read_whole(f, resident) for f in files])
            shutil.rmtree(root, ignore_errors=True)
        parts[("memory", "reference", ONE_THREAD_STREAM)] = stream_copy_samples(nbytes, repeats)
    parts[("memory", "reference", STREAM)] = stream_copy_samples(nbytes, repeats)
    return [{"tier": tier, "path": path, "part": part, "ms": 1e3 * statistics.median(times),
             "samples_ms": [1e3 * t for t in times], "tokens": tokens, "kv_bytes": nbytes, "chunks": len(chunks),
             "layout": layout, "method": method} for (tier, path, part), times in parts.items()]


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch (and kvlab's batch copy, which takes torch's thread count) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _chunk(cache, block_ids: list[int], name: str) -> Chunk:  # noqa: ANN001 - a KVCache
    """The cache's blocks ``block_ids`` as a sealed chunk under keys made from ``name``."""
    buffer = allocate(cache.layout, cache.geometry, len(block_ids))
    Transfer(cache, block_ids, buffer).run()
    keys = [hashlib.blake2b(f"{name}-{b}".encode(), digest_size=16).hexdigest() for b in block_ids]
    return Chunk(keys, buffer, "tier-read-profile").seal()


def _reads_into_runs(files: list[Path], keys: list[str], targets: list[list[int]], cache) -> Callable[[], None]:  # noqa: ANN001
    """The kernel's reads of the chunk files into the cache's runs, as a read straight into
    the cache makes them (:func:`kvlab.store.chunk.payload_runs`), nothing checked."""
    plans = []
    for path, key, ids in zip(files, keys, targets):
        with path.open("rb", buffering=0) as f:
            header = parse_header(f, key, path.stat().st_size)
        plans.append((path, header.payload_start, *payload_runs(header, Placement(cache, list(range(len(ids))), ids))))

    def read() -> None:
        for path, start, addresses, lengths, scratch in plans:
            fd = os.open(path, os.O_RDONLY)
            try:
                file_reads.read_runs(fd, start, addresses, lengths, scratch, checked=False)
            finally:
                os.close(fd)

    return read


def _read_whole(path: Path, into: torch.Tensor) -> None:
    """The file's bytes into memory already in place: what its medium costs, nothing checked."""
    with path.open("rb", buffering=0) as f:
        f.readinto(memoryview(into.numpy())[:path.stat().st_size])


def _timer(parts: dict[tuple[str, str, str], list[float]], repeats: int) -> Callable:
    """Time a call ``repeats`` times after two that warm up, into ``parts[key]``."""
    def timed(key: tuple[str, str, str], call: Callable[[], object]) -> None:
        repeated(call, 2)
        parts[key] = repeated(call, repeats)

    return timed
