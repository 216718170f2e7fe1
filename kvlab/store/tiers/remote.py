"""What the remote tiers (Redis, Mooncake) do the same way: wait at most CALL_TIMEOUT_S on a
call; read a block's name ("<chunk>:<position>") and a chunk's header, checked before its
payload is fetched; drop a damaged chunk; tell whether a server's port answers."""

from __future__ import annotations

import io
import socket
from typing import Any, Callable

from kvlab.store.chunk import ForgedChunk, Header, parse_header
from kvlab.store.keys import valid_key

# The most a remote tier waits on one call: Redis's socket timeout, Mooncake's deadline.
CALL_TIMEOUT_S = 2.0


def location(value: bytes | None) -> tuple[str, int] | None:
    """A block name's chunk and position; None for a missing or malformed one."""
    if not value:
        return None
    chunk_key, _, position = value.decode(errors="replace").partition(":")
    return (chunk_key, int(position)) if valid_key(chunk_key) and position.isdigit() else None


def checked_header(tier: Any, key: str, head: bytes, size: int | None,
                   complete: Callable[[bytes], bytes] | None = None) -> Header | None:
    """The header of ``tier``'s chunk ``key`` (``complete`` reads what the first bytes lack),
    checked against the schema, the value's ``size`` and, with the tier's ``auth_key``, its MAC;
    a bad one is counted and dropped (``tier._reject``), and None comes back."""
    try:
        head = complete(head) if complete is not None else head
        header = parse_header(io.BytesIO(head), key, size)
        if tier.auth_key is not None and header.mac is None:
            raise ForgedChunk("no MAC, and this store has an auth_key")
    except ValueError as error:
        tier.stats.bad_headers += not isinstance(error, ForgedChunk)
        tier.stats.forged += isinstance(error, ForgedChunk)
        tier._reject(key, error)
        return None
    return header


def drop_corrupt(tier: Any, backoff: Any, label: str, chunk_key: str, error: Exception) -> None:
    """A damaged chunk of ``tier``: counted, logged once (on its ``backoff``), removed, so it
    is recomputed and never promised again."""
    tier.stats.corrupt += 1
    backoff.log_once("corrupt", "KVLabConnector store: dropping %s chunk %s (%s); recomputing instead",
                     label, chunk_key, error)
    tier.discard(chunk_key)


def reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a TCP connection at ``host``:``port`` within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
