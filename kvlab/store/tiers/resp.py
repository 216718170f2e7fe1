"""A Redis GET whose value is read from the socket straight into memory of its own (one
``recv_into`` a tensor), not through redis-py's parser, which grows a buffer of its own and
then copies it into a bytes object: a chunk's megabytes are written once instead of three
times. Only GET: every other command goes through redis-py."""

from __future__ import annotations

import socket
import threading
from typing import Any

import torch

_LINE_MAX = 1024  # a bulk reply's first line is "$<length>\r\n"; an error line, a sentence


class BulkReader:
    """GETs on a connection of its own per thread, opened as redis-py's connection
    ``settings`` say (host and port or a Unix socket, username, password, database).
    Every fault is an OSError (the Redis tier absorbs it); a connection a fault left
    mid-reply is closed, never reused."""

    def __init__(self, settings: dict[str, Any], timeout_s: float) -> None:
        self._settings = settings
        self._timeout = timeout_s
        self._local = threading.local()

    def get(self, name: str) -> memoryview | None:
        """The value of ``name``, None when it does not exist."""
        sock = self._socket()
        try:
            sock.sendall(_command(b"GET", name.encode()))
            line = _line(sock)
            if line == b"$-1":
                return None
            if not line.startswith(b"$") or not line[1:].isdigit():
                raise OSError(f"Redis answered GET with {line[:80]!r}")
            size = int(line[1:])
            buffer = torch.empty(size + 2, dtype=torch.uint8)
            view = memoryview(buffer.numpy())
            got = 0
            while got < size + 2:
                count = sock.recv_into(view[got:], size + 2 - got)
                if not count:
                    raise OSError("Redis closed the connection mid-reply")
                got += count
            if view[size:] != b"\r\n":
                raise OSError("a bulk reply that does not end in CRLF")
            return view[:size]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close this thread's connection (the next GET opens another)."""
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()

    def _socket(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._connect()
            self._local.sock = sock
        return sock

    def _connect(self) -> socket.socket:
        settings = self._settings
        if settings.get("path"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout)
            sock.connect(settings["path"])
        else:
            sock = socket.create_connection((settings.get("host", "localhost"), int(settings.get("port", 6379))),
                                            timeout=self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if settings.get("password"):
                who = [settings["username"].encode()] if settings.get("username") else []
                _expect_ok(sock, _command(b"AUTH", *who, str(settings["password"]).encode()), "AUTH")
            if int(settings.get("db") or 0):
                _expect_ok(sock, _command(b"SELECT", str(int(settings["db"])).encode()), "SELECT")
        except BaseException:
            sock.close()
            raise
        return sock


def _command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)


def _line(sock: socket.socket) -> bytes:
    """The reply's first line, read a byte at a time so that nothing past it is read (a
    dozen bytes: a dozen calls, nothing beside a value's megabytes)."""
    line = bytearray()
    while not line.endswith(b"\r\n"):
        byte = sock.recv(1)
        if not byte:
            raise OSError("Redis closed the connection mid-reply")
        line += byte
        if len(line) > _LINE_MAX:
            raise OSError(f"a reply line longer than {_LINE_MAX} bytes")
    return bytes(line[:-2])


def _expect_ok(sock: socket.socket, command: bytes, what: str) -> None:
    sock.sendall(command)
    line = _line(sock)
    if line != b"+OK":
        raise OSError(f"Redis refused {what}: {line[:80].decode(errors='replace')}")
