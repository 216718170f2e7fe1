"""One headless Chromium launch shared by the browser tests (the rendered report, JupyterLab;
imported as ``from browser import ...``, as ``conftest`` is):
Debian's /usr/bin/chromium driven by Playwright, with the flags a sandboxed container needs
and without the background traffic a test has no use for."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


class BrowserUnavailable(RuntimeError):
    """Chromium or Playwright is not installed here; tests turn this into a skip."""


def browser_missing() -> str | None:
    """Why no headless browser can start here, or None when one can."""
    if not CHROMIUM.is_file() and shutil.which(str(CHROMIUM)) is None:
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install playwright)"
    return None


@contextmanager
def headless_chromium(overlay_scrollbars: bool = False) -> Iterator[Browser]:
    """``with headless_chromium() as browser: page = browser.new_page()``; closes the
    browser and Playwright on exit. Raises BrowserUnavailable when it cannot start. With
    ``overlay_scrollbars``, pages scroll as on macOS by default: a scrollbar drawn over the
    content and hidden until used (a headless browser otherwise draws none at all)."""
    missing = browser_missing()
    if missing:
        raise BrowserUnavailable(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        overlay = {"args": [*CHROMIUM_ARGS, "--enable-features=OverlayScrollbar"],
                   "ignore_default_args": ["--hide-scrollbars"]} if overlay_scrollbars else {"args": CHROMIUM_ARGS}
        browser = p.chromium.launch(executable_path=str(CHROMIUM), **overlay)
        try:
            yield browser
        finally:
            browser.close()
