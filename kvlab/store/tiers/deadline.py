"""A deadline on every call of a remote tier whose client has none of its own: Mooncake's
client blocks 4-9 s in each call to a master that died (it retries the RPC). The call runs on a
worker thread and the tier waits for it at most ``timeout_s``; a connection held open to the
server tells at once when the server dies (the kernel closes it), so the call in flight then,
and every call after it, fails without waiting for the deadline. The tier's back-off
(kvlab.store.tiers.backoff) then decides when to try again: a dead server costs at most one
deadline per back-off window, never a blocked step."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from typing import Any, Callable

# How often a caller waiting on a call looks at the server's connection.
POLL_S = 0.05
WORKERS = 4  # calls in flight at once (a scheduler's lookups, a worker's loads and saves)


class ServerWatch:
    """A TCP connection to ``host``:``port`` held open and never written to: the kernel sees
    the server's end close the moment its process dies. ``alive()`` costs one non-blocking
    ``recv`` while it is open, and a connection attempt (refused at once by a dead server's
    host) when it is not."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def alive(self) -> bool:
        with self._lock:
            if self._sock is not None:
                try:
                    if self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b"":
                        return True  # the server said something: it is there
                except BlockingIOError:
                    return True  # open, nothing to read
                except OSError:
                    pass  # reset
                self._sock.close()
                self._sock = None
            try:
                self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            except OSError:
                return False
            self._sock.setblocking(False)  # recv never waits (with a timeout it would, MSG_DONTWAIT or not)
            return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class Deadline:
    """Calls into a server's client, each waited for at most ``timeout_s``: ConnectionError
    as soon as ``watch`` finds the server gone, TimeoutError at the deadline. The call that
    overran keeps its worker until the client gives up; while it does, every new call fails at
    once rather than queue behind it."""

    def __init__(self, watch: ServerWatch, timeout_s: float, name: str) -> None:
        self.watch, self.timeout_s = watch, timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix=name)
        self._overran = 0
        self._lock = threading.Lock()

    def call(self, operation: Callable[[], Any]) -> Any:
        """``operation()``'s result or exception, within the deadline."""
        with self._lock:
            if self._overran:
                raise TimeoutError(f"a call that overran its {self.timeout_s:g} s is still waiting on the server")
        if not self.watch.alive():
            raise ConnectionError(f"nothing accepts connections at {self.watch.host}:{self.watch.port}")
        future = self._pool.submit(operation)
        end = time.monotonic() + self.timeout_s
        while True:
            try:
                return future.result(timeout=max(0.0, min(POLL_S, end - time.monotonic())))
            except concurrent.futures.TimeoutError:
                pass
            gone = not self.watch.alive()
            if gone or time.monotonic() >= end:
                with self._lock:
                    self._overran += 1
                future.add_done_callback(self._finished)
                if gone:
                    raise ConnectionError(f"the server at {self.watch.host}:{self.watch.port} went away during a call")
                raise TimeoutError(f"no answer within {self.timeout_s:g} s")

    def close(self) -> None:
        """Stop taking calls; a call still blocked in the client is left to finish."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.watch.close()

    def _finished(self, _: concurrent.futures.Future) -> None:
        with self._lock:
            self._overran -= 1
