"""Another local user against the folders and secret files kvlab trusts (kvlab.store.safe_paths):
each attack of issue 42 played by ``nobody`` through ``runuser`` while the store runs as root, as
CI runs the tests. A symbolic link another user owns, a folder on the way another user owns or
can write, a system folder as ``disk_path``, an epochs folder or a secret's file behind any of
these: refused at start-up with what to do. A store keeps the folder it checked, so swapping the
path afterwards changes nothing."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from functools import partial
from pathlib import Path

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.connector import weights
from kvlab.connector.config import ConnectorConfig
from kvlab.harness.chunks import random_chunk, same_bytes
from kvlab.store import KVStore
from kvlab.store import chunk as chunk_format
from kvlab.store.secrets import read_auth_key, resolve_redis_url

GEOMETRY = ModelGeometry("others-test", 2, 2, 32, torch.bfloat16, 16)
chunk = partial(random_chunk, GEOMETRY, salt="o")


def _nobody() -> int | None:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return None


NOBODY = _nobody()
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser") or NOBODY is None,
                                reason="plays another local user (nobody) through runuser: needs root, runuser "
                                       "and a nobody user, as CI has")


def as_nobody(*command: str) -> None:
    subprocess.run(["runuser", "-u", "nobody", "--", *command], check=True, capture_output=True)


@pytest.fixture
def place():
    """A root-owned 0755 folder every user can reach, holding ``shared``: sticky and writable
    by all, as /tmp and /dev/shm are."""
    root = Path(tempfile.mkdtemp(prefix="kvlab-others-", dir="/tmp"))
    root.chmod(0o755)
    (root / "shared").mkdir(mode=0o1777)
    (root / "shared").chmod(0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def forged_file(folder: Path, genuine: int) -> Path:
    """A forger's chunk file: the keys of ``chunk(genuine)``, other KV, a valid CRC."""
    forged = chunk(genuine, fill=99)
    path = folder / f"{forged.key}.kvchunk"
    path.write_bytes(chunk_format.encode_header(forged) + b"".join(chunk_format.payload(forged)))
    path.chmod(0o644)
    return path


# ---- 1: a symbolic link at the shared-memory tier's default path ----------------------------------
def test_a_link_another_user_planted_at_the_shm_path_is_refused(place: Path) -> None:
    """nobody links /dev/shm/kvlab-<name> to a root-owned 0755 folder before the engine starts:
    it passed the owner and mode check (which followed the link), and nobody could re-point it."""
    target = place / "roots"
    target.mkdir(mode=0o755)
    link = Path("/dev/shm") / f"kvlab-victim-{uuid.uuid4().hex[:12]}"
    as_nobody("ln", "-s", str(target), str(link))
    try:
        with pytest.raises(ValueError, match=rf"{link} is a symbolic link of uid {NOBODY}, another user's"):
            KVStore(tiers={"shm": {"path": link}})
        assert not list(target.iterdir()), "nothing written through the link"
    finally:
        link.unlink()


@pytest.mark.parametrize("tier", ["shm", "disk"])
def test_a_store_keeps_the_folder_it_checked(place: Path, tier: str) -> None:
    """The link at the store's path is re-pointed, the way the issue's attacker did it, to a
    folder holding a forged chunk of the same keys: the running store still reads its own
    folder (it holds it open), lookups and reads alike."""
    own, other = place / "own", place / "other"
    own.mkdir(mode=0o700)
    other.mkdir(mode=0o700)
    link = place / "store"
    link.symlink_to(own)
    store = KVStore(capacity_bytes=1, tiers={tier: {"path": link}})
    genuine = chunk(1)
    assert store.put(genuine) and (own / f"{genuine.key}.kvchunk").exists()
    forged_file(other, 1)
    (place / "store.new").symlink_to(other)
    os.replace(place / "store.new", link)  # ln -sfn other store.new && mv -T store.new store
    got = store.get(genuine.key)
    assert got is not None and same_bytes(got, genuine), "the store read the folder the path points to now"
    own.rename(place / "moved")  # the folder itself renamed away, a new one in its place
    (place / "own").mkdir(mode=0o700)
    forged_file(place / "own", 1)
    got = store.get(genuine.key)
    assert got is not None and same_bytes(got, genuine)


# ---- 2: a folder on the way that another user can write ---------------------------------------
@pytest.mark.parametrize("owner, mode", [("nobody", 0o777), ("nobody", 0o755), ("root", 0o777)],
                         ids=["nobody-0777", "nobody-0755", "root-0777"])
def test_a_folder_on_the_way_another_user_controls_is_refused(place: Path, owner: str, mode: int) -> None:
    """disk_path inside a folder nobody owns or may write (not sticky): kvlab made the leaf 0700
    and accepted it, and nobody could rename the leaf away and put a folder of forged chunks in its
    place. Now the store refuses it at start-up, naming the folder on the way."""
    theirs = place / "shared" / "theirs"
    if owner == "nobody":
        as_nobody("mkdir", "-m", f"{mode:o}", str(theirs))
    else:
        theirs.mkdir()
    theirs.chmod(mode) if owner == "root" else as_nobody("chmod", f"{mode:o}", str(theirs))
    uid = NOBODY if owner == "nobody" else 0
    with pytest.raises(ValueError, match=rf"{theirs} on its way is owned by uid {uid} with mode {mode:04o}"):
        KVStore(tiers={"disk": {"path": theirs / "kv"}})
    assert not (theirs / "kv").exists()


def test_a_sticky_folder_on_the_way_is_fine(place: Path) -> None:
    """As /tmp and /dev/shm: others may write it, but not rename what is not theirs."""
    store = KVStore(capacity_bytes=1, tiers={"disk": {"path": place / "shared" / "mine" / "kv"}})
    assert store.put(chunk(2))
    assert (place / "shared" / "mine").stat().st_mode & 0o7777 == 0o700


# ---- 3: a system folder as disk_path -----------------------------------------------------------
@pytest.mark.parametrize("folder", ["/", "/etc", "/usr/lib", "/var/tmp", "/dev/shm", "//etc/../etc/"])
def test_a_system_folder_is_refused_as_disk_path(folder: str) -> None:
    with pytest.raises(ValueError, match="KVLabConnector: the disk tier: path must be a folder of kvlab's own"):
        ConnectorConfig.parse({"tiers": ["memory", "disk"], "disk": {"path": folder}})
    with pytest.raises(ValueError, match="^the disk tier: path must be a folder of kvlab's own"):
        KVStore(tiers={"disk": {"path": folder}})


# ---- 4: the weights epochs folder ------------------------------------------------------------------
def test_an_epochs_folder_behind_another_users_link_is_refused(place: Path, monkeypatch) -> None:
    """nobody links $TMPDIR/kvlab-0 (to a root-owned folder) before the engine makes it: the
    epochs went where nobody could later re-point them."""
    monkeypatch.setattr(tempfile, "tempdir", str(place / "shared"))
    target = place / "roots"
    (target / "weights").mkdir(parents=True, mode=0o700)
    target.chmod(0o755)
    as_nobody("ln", "-s", str(target), str(place / "shared" / f"kvlab-{os.geteuid()}"))
    with pytest.raises(ValueError, match=rf"kvlab-{os.geteuid()} is a symbolic link of uid {NOBODY}"):
        weights.new_weights_epoch("engine-under-attack")
    assert not list((target / "weights").iterdir())


def test_a_password_folder_in_a_temporary_folder_another_user_controls_is_refused(place: Path,
                                                                                  monkeypatch) -> None:
    """kvlab's Redis server writes its password into a new folder of $TMPDIR: one another user
    owns (they could rename it away and read or choose the password) is refused."""
    from kvlab.runtime.redis import new_password_folder

    as_nobody("mkdir", "-m", "755", str(place / "shared" / "theirs"))
    monkeypatch.setattr(tempfile, "tempdir", str(place / "shared" / "theirs"))
    with pytest.raises(ValueError, match=rf"theirs on its way is owned by uid {NOBODY}"):
        new_password_folder()
    monkeypatch.setattr(tempfile, "tempdir", str(place / "shared"))
    assert (new_password_folder() / "password").stat().st_mode & 0o777 == 0o600


# ---- 5: secret files -------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["their folder", "their file", "their link"])
def test_a_secret_another_user_could_swap_is_refused(place: Path, how: str) -> None:
    """An auth_key file or a Redis password file another user could rewrite or re-point: they
    would choose the MAC key (and forge chunks) or the password. Refused, naming what they control."""
    shared = place / "shared"
    if how == "their folder":  # root's file in nobody's folder: nobody renames it away, writes another
        as_nobody("mkdir", "-m", "755", str(shared / "theirs"))
        secret = shared / "theirs" / "key"
        as_nobody("chmod", "777", str(shared / "theirs"))
        secret.write_bytes(b"k" * 32)
        secret.chmod(0o600)
        why = f"on its way is owned by uid {NOBODY}"
    elif how == "their file":
        secret = shared / "key"
        as_nobody("sh", "-c", f"umask 077; printf %s {'k' * 32} > {secret}")
        why = f"{secret} is owned by uid {NOBODY} with mode 0600"
    else:
        real = place / "key"
        real.write_bytes(b"k" * 32)
        real.chmod(0o600)
        secret = shared / "key"
        as_nobody("ln", "-s", str(real), str(secret))
        why = f"{secret} is a symbolic link of uid {NOBODY}"
    with pytest.raises(ValueError, match=why):
        read_auth_key(f"file:{secret}")
    with pytest.raises(ValueError, match=why):
        resolve_redis_url(f"redis://127.0.0.1:6379/0?password_file={secret}")
    with pytest.raises(ValueError, match=why):
        ConnectorConfig.parse({"tiers": ["memory", "disk"], "disk": {"path": str(place / "kv")},
                               "auth_key": f"file:{secret}"})


def test_a_secret_of_root_or_this_user_behind_trusted_links_is_read(place: Path) -> None:
    """As a Kubernetes secret is mounted: root's links to a root's file, writable by no one else."""
    data = place / "..data-1"
    data.mkdir(mode=0o755)
    (data / "key").write_bytes(b"s" * 32 + b"\n")
    (data / "key").chmod(0o644)
    (place / "..data").symlink_to(data.name)
    (place / "key").symlink_to("..data/key")
    assert read_auth_key(f"file:{place / 'key'}") == b"s" * 32
