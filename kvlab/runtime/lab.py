"""JupyterLab on the notebooks, for ``python -m kvlab lab`` and the browser test.

``with JupyterLab(notebooks_dir, token="...") as lab:`` starts this environment's
JupyterLab on 127.0.0.1 (a free port unless one is given), waits until its HTTP API
answers that token, and on exit stops it (kvlab.runtime.servers.ManagedServer: its whole
process group; JupyterLab shuts its kernels down on SIGTERM). ``lab.url`` is its base URL,
``lab.lab_url(notebook)`` the page that opens a notebook, token included. As root it adds
``--allow-root``: JupyterLab refuses to start as root otherwise, and containers often run as root.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvlab.runtime.servers import HOST, ManagedServer, ServerError


class LabError(ServerError):
    """JupyterLab is missing, did not start or died."""


@dataclass
class JupyterLab(ManagedServer):
    """JupyterLab serving ``notebooks_dir``, usable as a context manager.

    ``token`` None makes a random one (the printed URL carries it); "" turns the login off
    (for everyone on this machine). ``open_browser`` lets JupyterLab open the desktop's
    browser. ``extra_args`` go to ``jupyter lab`` as they are (e.g.
    ``--ServerApp.shutdown_no_activity_timeout=3600``); ``env`` (e.g.
    ``JUPYTERLAB_SETTINGS_DIR``) keeps a test's JupyterLab off the user's settings.
    ``log_path`` None writes the log into a new temporary file, kept after the server stops.
    """

    notebooks_dir: str | Path
    port: int | None = None
    token: str | None = None
    open_browser: bool = False
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)  # overrides on top of os.environ
    log_path: str | Path | None = None
    startup_timeout: float = 90.0  # about 5 s on an idle 2-core machine
    stop_grace: float = 15.0  # seconds between SIGTERM and SIGKILL: time to shut the kernels down
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    startup_seconds: float | None = field(default=None, init=False)

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
        """The URL that opens JupyterLab, or ``notebook`` (relative to ``notebooks_dir``) in
        it, logged in."""
        page = f"{self.url}/lab" + (f"/tree/{urllib.parse.quote(notebook)}" if notebook else "")
        return page + (f"?token={self.token}" if self.token else "")

    def command(self) -> list[str]:
        try:
            import jupyterlab  # noqa: F401
        except ImportError as error:
            raise LabError(f"JupyterLab is not installed for {sys.executable} (pip install jupyterlab)") from error
        args = [sys.executable, "-m", "jupyterlab", str(self.notebooks_dir), "--ip", HOST, "--port", str(self.port),
                "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}"]
        if not self.open_browser:
            args.append("--no-browser")
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
