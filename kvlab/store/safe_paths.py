"""Folders and secret files opened so that no other local user can redirect them.

A path is walked from ``/`` one name at a time, each folder opened relative to the one before
(``openat``), never through the path again. Every folder on the way must be root's or this
user's and writable by no one else, or sticky (/tmp, /dev/shm: there others cannot rename what
they do not own); a symbolic link on the way is followed only when root or this user owns it.
A store's folder itself must be this user's and writable by no one else. What is opened is kept
as a file descriptor (:class:`Folder`) and its files are opened relative to it with
``O_NOFOLLOW``, so renaming the path, or a folder above it, afterwards changes nothing for a
store that holds it."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

# Folders of the system or shared by every user: never a store's own (a store evicts the chunk
# files it finds in its folder, and others' files would lie beside its own).
SYSTEM_FOLDERS = ("/", "/bin", "/boot", "/dev", "/dev/shm", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media",
                  "/mnt", "/opt", "/proc", "/root", "/run", "/run/shm", "/sbin", "/srv", "/sys", "/tmp", "/usr",
                  "/usr/bin", "/usr/lib", "/usr/local", "/usr/sbin", "/usr/share", "/var", "/var/cache", "/var/lib",
                  "/var/log", "/var/tmp")
MAX_LINKS = 40  # symbolic links followed on one path, as Linux's own limit
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO planted as a secret never blocks


class Folder:
    """A folder checked once and held open: its files are named relative to it, never through
    its path again (``path`` is for messages). Symbolic links inside it are never followed."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def stat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def replace(self, old: str, new: str) -> None:
        os.replace(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def utime(self, name: str, ns: tuple[int, int]) -> None:
        os.utime(name, ns=ns, dir_fd=self.fd, follow_symlinks=False)

    def entries(self, wanted: Callable[[str], bool]) -> list[tuple[str, os.stat_result]]:
        """The names ``wanted`` picks and their stats (files removed meanwhile left out), read
        through a descriptor of its own: two threads listing at once do not share a position."""
        fd = os.open(".", FOLDER_FLAGS, dir_fd=self.fd)
        out = []
        try:
            with os.scandir(fd) as listing:
                for entry in listing:
                    if wanted(entry.name):
                        try:
                            out.append((entry.name, entry.stat(follow_symlinks=False)))
                        except FileNotFoundError:
                            continue
        finally:
            os.close(fd)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def open_folder(path: str | Path, what: str, create: bool = True) -> Folder:
    """``path`` walked as this module says and held open; missing folders are created mode 0700
    (whatever the umask) when ``create``. ValueError, saying what to do, for a folder another
    user could write or redirect, a system folder (SYSTEM_FOLDERS) or one that cannot be made."""
    path = Path(os.path.abspath(path))
    try:
        fd, where = _walk(path, what, create, FOLDER_FLAGS)
    except NotADirectoryError as error:
        raise ValueError(f"{what}: {error.filename} is a file, not a folder") from None
    except OSError as error:
        raise ValueError(f"{what} cannot be opened or created: {error}") from None
    if system_folder(where):
        os.close(fd)
        raise ValueError(f"{what} is {where}, a folder of the system's: a store needs a folder of its own "
                         "(it evicts the chunk files it finds there), e.g. /var/cache/kvlab or /dev/shm/kvlab-<name>")
    found = os.fstat(fd)
    if found.st_uid != os.geteuid() or found.st_mode & 0o022:
        os.close(fd)
        raise ValueError(f"{what} is owned by uid {found.st_uid} with mode {found.st_mode & 0o7777:04o}, but the "
                         f"store needs a folder of its own user (uid {os.geteuid()}) that group and others cannot "
                         "write: another local user could plant, swap or delete its chunks. Remove it (kvlab "
                         f"creates it, mode 0700), `chmod go-w {path}` if it is yours, or choose another path")
    return Folder(path, fd)


def read_private_file(path: str | Path, what: str) -> bytes:
    """The bytes of a file holding a secret (a password, a MAC key): its path walked as a
    store's folder is, and the file itself root's or this user's, writable by no one else
    (whoever could rewrite it would choose the secret). OSError where it cannot be read;
    ValueError naming what another user controls."""
    path = Path(os.path.abspath(path))
    fd, where = _walk(path, what, False, FILE_FLAGS)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise ValueError(f"{what}: {where} is not a regular file")
        if found.st_uid not in (0, os.geteuid()) or found.st_mode & 0o022:
            raise ValueError(f"{what}: {where} is owned by uid {found.st_uid} with mode {found.st_mode & 0o7777:04o}; "
                             "a secret's file must be root's or this user's and writable by no one else "
                             f"(chmod 600 {where})")
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read()
    finally:
        os.close(fd)


def system_folder(path: str) -> bool:
    """Whether ``path`` (resolved: no links, no ``..``) is one of SYSTEM_FOLDERS or this user's home."""
    return path in {os.path.realpath(folder) for folder in (*SYSTEM_FOLDERS, os.path.expanduser("~"))}


def _redirectable(found: os.stat_result) -> bool:
    """Whether another user could rename or replace what lies in a folder: they own it, or may
    write it and it is not sticky."""
    return (found.st_uid not in (0, os.geteuid())
            or bool(found.st_mode & 0o022 and not found.st_mode & stat.S_ISVTX))


def _walk(path: Path, what: str, create: bool, flags: int) -> tuple[int, str]:
    """A descriptor of ``path``'s last name opened with ``flags`` and the path resolved, every
    folder on the way opened relative to the one before and checked (:func:`_redirectable`),
    every link on the way root's or this user's. OSError for what cannot be opened."""
    pending = list(reversed(path.parts[1:]))  # the names still to walk, the next one last
    held = [os.open("/", FOLDER_FLAGS)]  # the folders walked so far, "/" first
    names: list[str] = []
    made, links = None, 0
    try:
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if len(held) > 1:
                    os.close(held.pop())
                    names.pop()
                continue
            where = "/" + "/".join([*names, name])
            parent, found = held[-1], os.fstat(held[-1])
            if _redirectable(found):
                raise ValueError(f"{what}: {'/' + '/'.join(names)} on its way is owned by uid {found.st_uid} with "
                                 f"mode {found.st_mode & 0o7777:04o}, so another user could rename or replace "
                                 f"what lies below it; every folder above must be root's or this user's (uid "
                                 f"{os.geteuid()}) and writable by no one else, or sticky (as /tmp): choose another "
                                 "path")
            last = not pending
            try:
                fd = os.open(name, flags if last else FOLDER_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), where) from None
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                    made = where
                except FileExistsError:
                    pass  # another process made it meanwhile: checked like any other
                pending.append(name)
                continue
            except OSError as error:
                if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                found = os.lstat(name, dir_fd=parent)
                if not stat.S_ISLNK(found.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), where) from None
                if found.st_uid not in (0, os.geteuid()):
                    raise ValueError(f"{what}: {where} is a symbolic link of uid {found.st_uid}, another user's, who "
                                     "could point it elsewhere at any time: use a path without it") from None
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), where) from None
                target = os.readlink(name, dir_fd=parent)
                if target.startswith("/"):
                    while len(held) > 1:
                        os.close(held.pop())
                    names.clear()
                pending.extend(reversed(Path(target).parts[1 if target.startswith("/") else 0:]))
                continue
            if made == where:
                os.fchmod(fd, 0o700)  # the umask may have taken bits off mkdir's mode
            held.append(fd)
            names.append(name)
        if len(held) == 1 and flags != FOLDER_FLAGS:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), "/")
        return held.pop(), "/" + "/".join(names)
    finally:
        for fd in held:
            os.close(fd)
