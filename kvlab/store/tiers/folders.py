"""The partial files of the file tiers' writers: named after their writer, so that the next
store to open the folder removes those of writers that are gone."""

from __future__ import annotations

import os
import re

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
