"""The file tiers' folders: the partial files of their writers (named after their writer, so
that the next store to open the folder removes those of writers that are gone), and each
file's last use, which eviction follows."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Iterable

from kvlab.store.safe_paths import Folder

# A writer's private file: <key>.<host>-<pid>.tmp (older kvlab wrote <key>.tmp<pid>).
TMP_FILE = re.compile(r"^[0-9a-f]{32}\.(?:(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)\.tmp|tmp(?P<old_pid>\d+))$")

# A writer's leftover from another host (shared folder) is removed after this many seconds.
STALE_TMP_S = 3600.0


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def stale_temporary(entries: Iterable[tuple[str, os.stat_result]], host: str, now: float) -> list[str]:
    """The partial files among ``entries`` (name, stat) whose writers died: this ``host``'s
    whose process is gone, another host sharing the folder's older than STALE_TMP_S."""
    stale = []
    for name, stat in entries:
        match = TMP_FILE.match(name)
        if match is None:
            continue
        same_host = match["host"] in (host, None)
        pid = int(match["pid"] or match["old_pid"])
        if (same_host and not process_alive(pid)) or (not same_host and now - stat.st_mtime_ns / 1e9 > STALE_TMP_S):
            stale.append(name)
    return stale


_last_use_ns = 0
_stamp_lock = threading.Lock()  # every tier of the process stamps from the one clock


def stamp_used(folder: Folder, name: str) -> None:
    """Mark file ``name`` used now, strictly after every use this process marked before (any
    thread, any tier): a file system's clock ticks in milliseconds, and uses in one tick would
    tie and evict in any order. Gone or read-only: eviction order is only a preference."""
    global _last_use_ns
    with _stamp_lock:
        _last_use_ns = used = max(time.time_ns(), _last_use_ns + 1)
    try:
        folder.utime(name, (used, used))
    except OSError:
        pass
