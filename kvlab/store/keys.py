"""Keys: chained block hashes as vLLM's prefix caching chains them, the signature a chunk
must match to be loaded, and a cheap fingerprint of a model's (or adapter's) files."""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path
from typing import Sequence

from kvlab.cache.allocation import KVCache
from kvlab.cache.geometry import dtype_name

# Every key is a 16-byte blake2b digest in hex; nothing else names a file.
_KEY = re.compile(r"^[0-9a-f]{32}$")


def valid_key(key: object) -> bool:
    return isinstance(key, str) and _KEY.match(key) is not None


def block_hashes(token_ids: Sequence[int], block_size: int, seed: str,
                 extra_keys: Sequence[bytes | None] | None = None) -> list[str]:
    """Chained hashes of the full blocks of ``token_ids``, as vLLM's prefix caching
    chains them: block i's hash covers every token up to the end of block i, and
    ``extra_keys[i]`` (what else decides block i's KV: a LoRA adapter, multimodal inputs,
    a cache salt) when given."""
    out, parent = [], hashlib.blake2b(seed.encode(), digest_size=16).digest()
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        block = struct.pack(f"<{block_size}q", *token_ids[start:start + block_size])
        extra = extra_keys[index] if extra_keys is not None and index < len(extra_keys) else None
        if extra:
            block += b"|extra|" + extra
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent.hex())
    return out


def holds(block_keys: Sequence[str], position: int, key: str) -> bool:
    """Whether a chunk's ``block_keys`` hold ``key`` at ``position``. A chunk is named by its
    last block, so an engine with another chunk size writes a chunk of the same name that
    starts elsewhere: a block is loaded only from where its own key is."""
    return position < len(block_keys) and block_keys[position] == key


def shard_key(key: str, rank: int, workers: int) -> str:
    """The key of one worker's shard of a block or chunk under tensor parallelism (each
    worker holds its own kv heads); the key itself with one worker."""
    if workers == 1:
        return key
    return hashlib.blake2b(f"{key}|shard {rank} of {workers}".encode(), digest_size=16).hexdigest()


def signature(cache: KVCache, num_kv_heads: int | None = None) -> str:
    """What a chunk must match to be loaded into ``cache``: the model's geometry, dtype and
    block size. Not the cache's layout: a load moves each layer's K and V by token and head
    from the chunk's layout into the cache's (kvlab.transfer.plan), so engines of any two
    layouts share one store. A quantized cache's rows carry their scales as its layout packs
    them, so its chunks name the layout and load only into it. ``num_kv_heads``: the
    signature of the same model's chunk holding that many heads (a shard stored at another
    tensor-parallel size)."""
    g = cache.geometry if num_kv_heads is None else cache.geometry.with_(num_kv_heads=num_kv_heads)
    mla = f"|MLA{g.kv_lora_rank}+{g.qk_rope_head_dim}" if g.is_mla else ""
    quant = f"|{g.quant.name}|{cache.layout.name}" if g.quant else ""  # rows of another format may have the same size
    return f"{g.name}|L{g.num_layers}|H{g.num_kv_heads}|D{g.head_size}{mla}|{dtype_name(g.dtype)}|BS{g.block_size}{quant}"


def folder_fingerprint(folder: str | Path, sample_bytes: int = 1 << 16) -> str:
    """A digest that changes when a model (or LoRA adapter) folder's weights change at the
    same path: every file's name, size and modification time, plus the first and last
    ``sample_bytes`` of each weight file (a safetensors header and some tensor data).
    Costs a few stat calls and reads, not a pass over the weights. "" for a non-folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return ""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
        if path.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json"):
            with open(path, "rb") as f:
                digest.update(f.read(sample_bytes))
                if stat.st_size > 2 * sample_bytes:
                    f.seek(-sample_bytes, os.SEEK_END)
                    digest.update(f.read(sample_bytes))
    return digest.hexdigest()
