"""JupyterLab (kvlab.runtime.lab, ``python -m kvlab lab``): the command it runs, that stopping
the command stops JupyterLab, and, in a headless browser, notebook 01 run from JupyterLab's
Run menu with its ipywidgets explorer redrawing when its controls change (the widgets' front
end, their messages to the kernel and back). The browser works on a copy of the notebook: the
one in notebooks/ stays as it is."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.runtime.lab import JupyterLab
from kvlab.runtime.notebooks import NOTEBOOKS_DIR

NOTEBOOK = "01_kv_layouts.ipynb"
RUN_TIMEOUT_MS = 240_000  # the whole notebook; about a minute on 2 busy cores
UPDATE_TIMEOUT_MS = 30_000  # one redraw of the explorer
MAX_EXPLORER_PX = 620  # controls, map and numbers on one screen
PROMPTS = ".jp-Notebook .jp-CodeCell .jp-InputPrompt"
KERNEL_IDLE = ".jp-Notebook-ExecutionIndicator[data-status='idle']"
ERROR_OUTPUT = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"  # errors and stderr
# SHA-256 of the bytes behind an <img> (ipywidgets shows an Image widget's value as a blob: URL)
IMAGE_DIGEST = """async img => {
    const bytes = await (await fetch(img.src)).arrayBuffer();
    const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
    return Array.from(digest, b => b.toString(16).padStart(2, "0")).join("");
}"""


def test_command(tmp_path):
    lab = JupyterLab(tmp_path, port=8999, token="secret", extra_args=["--ServerApp.shutdown_no_activity_timeout=60"])
    command = lab.command()
    assert command[1:4] == ["-m", "jupyterlab", str(tmp_path)]
    assert {"--no-browser", "--IdentityProvider.token=secret"} <= set(command)
    assert command[command.index("--ip") + 1] == "127.0.0.1" and command[command.index("--port") + 1] == "8999"
    assert ("--allow-root" in command) == (os.geteuid() == 0)
    assert command[-1] == "--ServerApp.shutdown_no_activity_timeout=60"
    assert lab.lab_url(NOTEBOOK) == f"http://127.0.0.1:8999/lab/tree/{NOTEBOOK}?token=secret"
    assert len(JupyterLab(tmp_path).token) >= 32  # a random one when none is given
    with pytest.raises(FileNotFoundError, match="no notebooks folder"):
        JupyterLab(tmp_path / "missing")


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_a_stopped_lab_command_stops_jupyterlab(tmp_path, stop):
    """``python -m kvlab lab`` stopped by a service manager (SIGTERM) or a closed terminal
    (SIGHUP) stops JupyterLab, which runs in a process group of its own, and exits 0."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed")
    (tmp_path / "notebooks").mkdir()
    command = subprocess.Popen([sys.executable, "-m", "kvlab", "lab", "--no-browser", "--notebooks-dir",
                                str(tmp_path / "notebooks")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, **own_settings(tmp_path / "lab")})
    lab = None
    try:
        output = []
        for line in command.stdout:  # until it says JupyterLab is up, or exits
            output.append(line)
            if "open http://127.0.0.1:" in line:
                break
        assert output and "open http://127.0.0.1:" in output[-1], "".join(output)
        (lab,) = children(command.pid)  # JupyterLab, the leader of a process group of its own
        command.send_signal(stop)
        assert command.wait(timeout=60) == 0
        assert JupyterLab._live_members(lab) == [], "JupyterLab outlived the lab command"
    finally:
        command.kill()
        if lab is not None and JupyterLab._live_members(lab):
            os.killpg(lab, signal.SIGKILL)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that still run (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, parent = text[text.rindex(")") + 2:].split()[:2]
        if int(parent) == pid and state != "Z":
            found.append(int(stat.parent.name))
    return found


class Screenshots:
    """PNGs into the test's folder, and into $KVLAB_SCREENSHOTS when it is set."""

    def __init__(self, own: Path):
        self.folders = [own] + ([Path(os.environ["KVLAB_SCREENSHOTS"])] if os.environ.get("KVLAB_SCREENSHOTS") else [])
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)

    def save(self, name: str, png: bytes) -> None:
        for folder in self.folders:
            (folder / f"lab_{name}.png").write_bytes(png)


def own_settings(folder: Path) -> dict[str, str]:
    """JupyterLab settings and workspaces of the test's own, without the question about news
    (its pop-up covers the screenshots) and update checks (nothing to reach from here)."""
    notification = folder / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True)
    notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    return {"JUPYTERLAB_SETTINGS_DIR": str(folder / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(folder / "workspaces")}


def run_all_cells(page, code_cells: int) -> None:
    """Run > Run All Cells, as a user does, once the notebook is loaded and its kernel
    started, and wait until the last queued cell is done; fails naming the error output
    when a cell raised (Run All stops there)."""
    page.wait_for_function(f"""() => document.querySelectorAll("{PROMPTS}").length === {code_cells}
        && (document.querySelector(".jp-Toolbar-kernelName")?.getAttribute("aria-label") ?? "No Kernel") !== "No Kernel"
        && document.querySelector("{KERNEL_IDLE}") !== null""", timeout=RUN_TIMEOUT_MS)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_function(f"""() => Array.from(document.querySelectorAll("{PROMPTS}"))
        .some(p => p.textContent.includes("[*]"))""", timeout=UPDATE_TIMEOUT_MS)
    page.wait_for_function(f"""() => !Array.from(document.querySelectorAll("{PROMPTS}"))
        .some(p => p.textContent.includes("[*]"))""", timeout=RUN_TIMEOUT_MS)
    prompts = page.locator(PROMPTS).all_text_contents()
    not_run = [i for i, text in enumerate(prompts) if not any(c.isdigit() for c in text)]
    errors = "\n".join(text[-1500:] for text in page.locator(ERROR_OUTPUT).all_text_contents())
    assert not not_run, f"code cells {not_run} of {len(prompts)} did not run; error output:\n{errors}"


@pytest.mark.slow
def test_notebook_01_explorer_in_jupyterlab(tmp_path):
    from kvlab.runtime.browser import browser_missing, headless_chromium

    if browser_missing():
        pytest.skip(browser_missing())
    pytest.importorskip("ipywidgets", reason="the explorer needs ipywidgets")
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed")
    from playwright.sync_api import expect

    from kvlab.plotting.explorer import readout

    original = (NOTEBOOKS_DIR / NOTEBOOK).read_bytes()
    served = tmp_path / "notebooks"
    served.mkdir()
    shutil.copy(NOTEBOOKS_DIR / NOTEBOOK, served / NOTEBOOK)
    code_cells = sum(cell["cell_type"] == "code" for cell in json.loads(original)["cells"])
    (tmp_path / "data" / "results").mkdir(parents=True)  # the notebook writes ../data/{figures,results}
    shots = Screenshots(tmp_path / "screenshots")

    with JupyterLab(served, log_path=tmp_path / "jupyterlab.log", env=own_settings(tmp_path / "lab")) as lab, \
            headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1600})  # the whole explorer in view
        page.goto(lab.lab_url(NOTEBOOK))
        run_all_cells(page, code_cells)
        shots.save("01_ran", page.screenshot())

        output = page.locator(".jp-OutputArea-output", has=page.locator(".kvlab-explorer-map"))
        cell = page.locator(".jp-CodeCell", has=page.locator(".kvlab-explorer-map"))
        numbers = page.locator(".kvlab-explorer-numbers pre")
        picture = page.locator("img.kvlab-explorer-map")
        state = {"model": "llama-3.1-8b", "layouts": ["LBHNC", "BLHNC"], "block_size": 16, "tokens": 256}

        def expected_numbers() -> str:
            return "\n".join(readout(state["model"], state["layouts"], state["block_size"], state["tokens"]))

        expect(numbers).to_have_text(expected_numbers(), timeout=UPDATE_TIMEOUT_MS)
        output.scroll_into_view_if_needed()
        shots.save("02_explorer", output.screenshot())
        assert output.bounding_box()["height"] < MAX_EXPLORER_PX, "the explorer does not fit one screen"
        # the static gallery after the widget: what saved and exported copies keep
        expect(cell.locator(".jp-OutputArea-output[data-mime-type='image/png']")).to_have_count(1)
        map_before = picture.evaluate(IMAGE_DIGEST)

        def change(name: str, act) -> None:
            """Work one control: the numbers must become the new ones and the map must change
            (a miniature whose heads, block size and moved blocks follow the controls)."""
            nonlocal map_before
            text_before = numbers.text_content()
            act()
            expect(numbers).to_have_text(expected_numbers(), timeout=UPDATE_TIMEOUT_MS)
            assert numbers.text_content() != text_before, f"{name}: the numbers did not change"
            # the map is sent after the numbers and before the kernel says idle
            page.wait_for_selector(KERNEL_IDLE, timeout=UPDATE_TIMEOUT_MS)
            map_after = picture.evaluate(IMAGE_DIGEST)
            assert map_after != map_before, f"{name}: the map did not change"
            map_before = map_after
            shots.save(f"03_{name}", output.screenshot())

        state["model"] = "deepseek-v2-lite"  # MLA: the layout lists change, LBHNC and BLHNC stay
        change("model", lambda: page.locator(".kvlab-explorer-model select").select_option(state["model"]))
        expect(page.locator(".kvlab-explorer-layout-a select")).to_have_value("LBHNC")
        expect(page.locator(".kvlab-explorer-layout-a option[value='mla_v0.12']")).to_have_count(1)
        state["layouts"][0] = "mla_v0.12"
        change("layout_a", lambda: page.locator(".kvlab-explorer-layout-a select").select_option("mla_v0.12"))
        state["layouts"][1] = "ascend_mla_tuple"
        change("layout_b", lambda: page.locator(".kvlab-explorer-layout-b select").select_option("ascend_mla_tuple"))
        state["block_size"] = 64
        change("block_size", lambda: page.locator(".kvlab-explorer-block-size select").select_option("64"))
        assert "ascend_mla_tuple: miniature 32 segments; the real transfer 7.6 MiB in 216 segments" \
            in numbers.text_content()
        state["tokens"] = 512  # the slider's next stop
        change("tokens", lambda: page.locator(".kvlab-explorer-tokens .noUi-handle").press("ArrowRight"))
        expect(page.locator(".kvlab-explorer-tokens .widget-readout")).to_have_text("512")

    assert (NOTEBOOKS_DIR / NOTEBOOK).read_bytes() == original, "the test changed notebooks/"
