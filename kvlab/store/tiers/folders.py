"""The folders of the file tiers: made this user's own, and the partial files of writers."""

from __future__ import annotations

import os
import re
from pathlib import Path

# A writer's private file: <key>.<host>-<pid>.tmp (older kvlab wrote <key>.tmp<pid>).
_TMP = re.compile(r"^[0-9a-f]{32}\.(?:(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)\.tmp|tmp(?P<old_pid>\d+))$")

# A writer's leftover from another host (shared folder) is removed after this many seconds.
STALE_TMP_S = 3600.0


def own_folder(path: Path, what: str) -> None:
    """Create ``path`` and its missing parents mode 0700 (whatever the umask), or check that
    the folder there is this user's and that no one else can write to it: another local
    user who can (a pre-created /dev/shm/kvlab-<name> of mode 0777, say) could plant, swap
    or delete chunks. ValueError naming the folder, its owner and mode, and what to do."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} is a file, not a folder")
    try:
        for folder in reversed([p for p in (path, *path.parents) if not p.exists()]):
            try:
                folder.mkdir(0o700)
            except FileExistsError:
                continue  # another process made it meanwhile: checked below like any other
            folder.chmod(0o700)
        stat = path.stat()
    except OSError as error:
        raise ValueError(f"{what} cannot be created: {error}") from None
    if stat.st_uid != os.geteuid() or stat.st_mode & 0o022:
        raise ValueError(f"{what} is owned by uid {stat.st_uid} with mode {stat.st_mode & 0o7777:04o}, but the store "
                         f"needs a folder of its own user (uid {os.geteuid()}) that group and others cannot write: "
                         "another local user could plant, swap or delete its chunks. Remove it (kvlab creates it, "
                         f"mode 0700), `chmod go-w {path}` if it is yours, or choose another path")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True
