"""Checked reads from a file straight into a cache's runs (``native/read_runs.c``): the
kernel copies a stored chunk's bytes from the page cache into the paged cache's blocks, with
no buffer between, and each batch is checksummed (CRC32C) while it is still in the core's
cache. The GIL is released for the whole call, so several fetch threads read and checksum
side by side. Needs a C compiler and a CPU with hardware CRC32C (x86-64 with SSE4.2);
:func:`unavailable` says why not, and callers then read into a buffer as before."""

from __future__ import annotations

import ctypes
import errno
import functools
import os

import torch

from kvlab.transfer import native


@functools.cache
def _library() -> ctypes.CDLL | str:
    library = native.library("read_runs", "checked file reads")
    if isinstance(library, str):
        return library
    if not library.kvlab_crc32c_hardware():
        return "this CPU has no hardware CRC32C that kvlab's checked reads use (x86-64 with SSE4.2)"
    library.kvlab_crc32c.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    library.kvlab_crc32c.restype = ctypes.c_uint32
    library.kvlab_read_runs.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_uint32)]
    library.kvlab_read_runs.restype = ctypes.c_int
    return library


def unavailable() -> str | None:
    """Why checked reads cannot run on this machine; None when they can."""
    library = _library()
    return library if isinstance(library, str) else None


def crc32c(addresses: torch.Tensor, lengths: torch.Tensor, crc: int = 0) -> int:
    """CRC32C of the bytes at host ``addresses`` (``lengths`` bytes each; contiguous int64
    tensors), in order, extending ``crc``: google_crc32c's value for the same bytes."""
    return _library().kvlab_crc32c(crc, addresses.data_ptr(), lengths.data_ptr(), lengths.numel())


def read_runs(fd: int, offset: int, addresses: torch.Tensor, lengths: torch.Tensor, scratch: int,
              checked: bool = True) -> int | None:
    """Read the file ``fd``'s bytes from ``offset`` on into host ``addresses`` (``lengths``
    bytes each, in order): their CRC32C (None with ``checked`` False: what the reads alone
    cost, for a profile; what lands then is no one's to trust). A run at address ``scratch``
    receives bytes that are only checksummed (several may share it). OSError when the file
    cannot be read or ends first."""
    crc = ctypes.c_uint32(0)
    status = _library().kvlab_read_runs(fd, offset, addresses.data_ptr(), lengths.data_ptr(), lengths.numel(),
                                        scratch, ctypes.byref(crc) if checked else None)
    if status:
        raise OSError(status, "the file ended before its payload" if status == errno.ENODATA else os.strerror(status))
    return crc.value if checked else None
