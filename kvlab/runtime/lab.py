"""JupyterLab on the notebooks, for ``python -m kvlab lab`` and the browser test.

``with JupyterLab(notebooks_dir, token="...") as lab:`` starts this environment's
JupyterLab on 127.0.0.1 (a free port unless one is given), waits until its HTTP API
answers that token, and on exit stops it with its kernels (kvlab.runtime.servers.ManagedServer:
its whole process group, then what is left of each kernel's). ``lab.url`` is its base URL,
``lab.lab_url(notebook)`` the page that opens just that notebook, token included. As root it adds
``--allow-root``: JupyterLab refuses to start as root otherwise, and containers often run as root.

``working_copies(notebooks_dir)`` is what ``kvlab lab`` serves: copies of the committed notebooks
in ``lab/`` beside them, so running and saving a notebook never writes into a committed file.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Sequence

from kvlab.runtime.servers import HOST, KILL_WAIT, ManagedServer, ServerError

WORKING_COPIES = "lab"  # beside notebooks/: the notebooks' ../data/figures and ../data/results lead to data/
COPIED = ".kvlab-copied.json"  # in it: the SHA-256 of the committed notebook each copy was made from
WORKSPACE = "kvlab"  # JupyterLab's saved tabs and layout for kvlab's notebooks
KERNEL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for what is left of a kernel's process group


class LabError(ServerError):
    """JupyterLab is missing, did not start or died."""


@dataclass
class JupyterLab(ManagedServer):
    """JupyterLab serving ``notebooks_dir``, usable as a context manager.

    ``token`` None makes a random one (the printed URL carries it); "" turns the login off
    (for everyone on this machine). JupyterLab opens no browser: whoever starts it opens
    ``lab_url(...)``. ``extra_args`` go to ``jupyter lab`` as they are (e.g.
    ``--ServerApp.shutdown_no_activity_timeout=3600``); ``env`` (e.g.
    ``JUPYTERLAB_SETTINGS_DIR``) keeps a test's JupyterLab off the user's settings.
    ``port`` and ``log_path``: :class:`ManagedServer`.
    """

    notebooks_dir: str | Path
    token: str | None = None
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)  # overrides on top of os.environ
    _: KW_ONLY
    startup_timeout: float = 90.0  # about 5 s on an idle 2-core machine
    stop_grace: float = 15.0  # time to shut the kernels down

    error = LabError
    label = "jupyterlab"

    def __post_init__(self) -> None:
        self.notebooks_dir = Path(self.notebooks_dir).expanduser().resolve()
        if not self.notebooks_dir.is_dir():
            raise FileNotFoundError(f"no notebooks folder at {self.notebooks_dir}")
        if self.token is None:
            self.token = secrets.token_hex(24)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def lab_url(self, notebook: str | None = None) -> str:
        """The URL that opens JupyterLab in kvlab's own workspace (the tabs left open last time;
        the user's other JupyterLab workspaces stay as they are), logged in, or just
        ``notebook`` (relative to ``notebooks_dir``): ``?reset`` empties the workspace first,
        which would otherwise reopen an earlier session's notebooks beside it, each with its kernel."""
        page = f"{self.url}/lab/workspaces/{WORKSPACE}"
        if notebook is not None:
            page += f"/tree/{urllib.parse.quote(notebook)}?reset"
        return page + (f"{'&' if notebook else '?'}token={self.token}" if self.token else "")

    def command(self) -> list[str]:
        try:
            import jupyterlab  # noqa: F401
        except ImportError as error:
            raise LabError(f"JupyterLab is not installed for {sys.executable} (pip install jupyterlab)") from error
        args = [sys.executable, "-m", "jupyterlab", str(self.notebooks_dir), "--ip", HOST, "--port", str(self.port),
                "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}", "--no-browser"]
        if os.geteuid() == 0:
            args.append("--allow-root")
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def _ready(self) -> bool:
        """Its REST API answers with the token: the server is up and will take the browser in."""
        request = urllib.request.Request(f"{self.url}/api/status", headers={"Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> None:
        """JupyterLab's process group, then whatever is left of its kernels': jupyter_client
        starts each kernel in a session of its own, which the signals to JupyterLab's group do
        not reach. JupyterLab shuts its kernels down on SIGTERM, but what a kernel started can
        outlive it (JupyterLab signals a kernel's group only to interrupt it, and to end a kernel
        slow to go), and a JupyterLab that had to be killed shut nothing down."""
        kernels = self.kernel_groups()
        super().stop()
        for group in kernels:
            self._stop_kernel_group(group)

    def kernel_groups(self) -> list[int]:
        """The process groups JupyterLab's running processes lead: its kernels'."""
        if self.process is None:
            return []
        return [pid for pid, group in children(self.process.pid).items() if pid == group]

    def _stop_kernel_group(self, group: int) -> None:
        self._signal_group(group, signal.SIGTERM)
        if not self._wait_for_group(group, KERNEL_GRACE):
            self._signal_group(group, signal.SIGKILL)
            if not self._wait_for_group(group, KILL_WAIT):
                raise LabError(f"kernel processes {self._live_members(group)} survived SIGKILL")


def children(pid: int) -> dict[int, int]:
    """The running processes ``pid`` started, each with its process group (Linux /proc;
    zombies left out)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, parent, group = text[text.rindex(")") + 2:].split()[:3]
        if int(parent) == pid and state != "Z":
            found[int(stat.parent.name)] = int(group)
    return found


def working_copies(notebooks_dir: str | Path) -> tuple[Path, list[str]]:
    """The folder ``lab/`` beside ``notebooks_dir`` with a copy of each committed notebook, and
    a line for each copy kept as it was although its notebook changed. JupyterLab serves the
    copies, so running and saving a notebook never writes into a committed one; at the same
    depth, their parameters' ``../data/...`` lead to the same data/. A copy follows a changed
    notebook while it is what was copied (its SHA-256 in lab/.kvlab-copied.json: git keeps no
    file times, so "newer" is "different"); a copy edited or run since is the user's and kept."""
    notebooks_dir = Path(notebooks_dir).expanduser().resolve()
    folder = notebooks_dir.parent / WORKING_COPIES
    folder.mkdir(exist_ok=True)
    record_path = folder / COPIED
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    kept = [line for committed in sorted(notebooks_dir.glob("*.ipynb"))
            if (line := _refresh(committed, folder / committed.name, record))]
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return folder, kept


def _refresh(committed: Path, copy: Path, record: dict[str, str]) -> str | None:
    """Make ``copy`` the committed notebook unless the user changed it; ``record`` notes the
    digest copied. Returns why a copy was kept, or None."""
    wanted, copied = _digest(committed), record.get(copy.name)
    have = _digest(copy) if copy.is_file() else None
    if have in (None, copied, wanted):  # none yet, or as copied from this or an older notebook
        if have != wanted:
            shutil.copyfile(committed, copy)
        record[copy.name] = wanted
        return None
    if copied == wanted:  # the user's, made from this very notebook
        return None
    return (f"kept your {copy} as it is: {committed} changed since it was copied, and so did the copy "
            "(remove it to get the new one)")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def find_notebook(folder: str | Path, name: str) -> str:
    """The notebook of ``folder`` that ``name`` means: its file name, with or without
    ``.ipynb`` or a folder in front (``notebooks/07_extend_kvlab.ipynb``), or the unique one
    it starts (``07``)."""
    wanted = Path(name).name.removesuffix(".ipynb")
    names = sorted(path.name for path in Path(folder).glob("*.ipynb"))
    matches = [n for n in names if n == f"{wanted}.ipynb"] or [n for n in names if n.startswith(wanted)]
    if len(matches) != 1:
        raise ValueError(f"{'no' if not matches else 'more than one'} notebook {name!r} in {folder}; "
                         f"choose from {names}")
    return matches[0]
