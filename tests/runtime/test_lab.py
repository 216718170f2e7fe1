"""JupyterLab (kvlab.runtime.lab, ``python -m kvlab lab``): the command it runs, that stopping
the command stops JupyterLab and its kernels, that it serves working copies (a notebook saved
there leaves notebooks/ as committed), that a notebook named opens alone in the browser, and,
in a headless browser, notebook 01 run from JupyterLab's
Run menu with its ipywidgets explorer redrawing when its controls change (the widgets' front
end, their messages to the kernel and back). The browser works on a copy of the notebook: the
one in notebooks/ stays as it is."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvlab.runtime.lab import JupyterLab, children, find_notebook, working_copies
from kvlab.runtime.notebooks import NOTEBOOKS_DIR

NOTEBOOK = "01_kv_layouts.ipynb"
PYTHON3 = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
RUN_TIMEOUT_MS = 240_000  # the whole notebook; about a minute on 2 busy cores
UPDATE_TIMEOUT_MS = 30_000  # one redraw of the explorer
MAX_EXPLORER_PX = 680  # controls, map and numbers (a row per committed machine where this one was not measured) on one screen
PROMPTS = ".jp-Notebook .jp-CodeCell .jp-InputPrompt"
KERNEL_IDLE = ".jp-Notebook-ExecutionIndicator[data-status='idle']"
# the notebook's kernel started and idle
KERNEL_READY = f"""(document.querySelector(".jp-Toolbar-kernelName")?.getAttribute("aria-label") ?? "No Kernel")
    !== "No Kernel" && document.querySelector("{KERNEL_IDLE}") !== null"""
TABS = "#jp-main-dock-panel .lm-TabBar-tabLabel"  # the titles of the main area's tabs
ERROR_OUTPUT = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"  # errors and stderr


def test_command(tmp_path):
    lab = JupyterLab(tmp_path, port=8999, token="secret", extra_args=["--ServerApp.shutdown_no_activity_timeout=60"])
    command = lab.command()
    assert command[1:4] == ["-m", "jupyterlab", str(tmp_path)]
    assert {"--no-browser", "--IdentityProvider.token=secret"} <= set(command)
    assert command[command.index("--ip") + 1] == "127.0.0.1" and command[command.index("--port") + 1] == "8999"
    assert ("--allow-root" in command) == (os.geteuid() == 0)
    assert command[-1] == "--ServerApp.shutdown_no_activity_timeout=60"
    assert lab.lab_url() == "http://127.0.0.1:8999/lab/workspaces/kvlab?token=secret"
    # the workspace emptied: nothing an earlier session left open comes back beside the notebook
    assert lab.lab_url(NOTEBOOK) == f"http://127.0.0.1:8999/lab/workspaces/kvlab/tree/{NOTEBOOK}?reset&token=secret"
    assert len(JupyterLab(tmp_path).token) >= 32  # a random one when none is given
    with pytest.raises(FileNotFoundError, match="no notebooks folder"):
        JupyterLab(tmp_path / "missing")


def test_working_copies_follow_the_committed_notebooks_but_keep_a_users(tmp_path):
    """lab/ beside notebooks/ (the same ../data from both), each copy made once, replaced when
    its notebook changed while the copy is as copied, kept (and named) when the user changed it."""
    committed = tmp_path / "notebooks"
    committed.mkdir()
    for name in ("01_a", "02_b"):
        (committed / f"{name}.ipynb").write_text(f"{name} v1")
    folder, kept = working_copies(committed)
    assert folder == tmp_path / "lab" and kept == []
    assert sorted(p.name for p in folder.glob("*.ipynb")) == ["01_a.ipynb", "02_b.ipynb"]
    assert (folder / "01_a.ipynb").read_text() == "01_a v1"

    (folder / "02_b.ipynb").write_text("02_b run by the user")
    assert working_copies(committed) == (folder, [])  # nothing new to tell
    for name in ("01_a", "02_b"):
        (committed / f"{name}.ipynb").write_text(f"{name} v2")
    (committed / "03_c.ipynb").write_text("03_c v1")
    folder, kept = working_copies(committed)
    assert (folder / "01_a.ipynb").read_text() == "01_a v2" and (folder / "03_c.ipynb").read_text() == "03_c v1"
    assert (folder / "02_b.ipynb").read_text() == "02_b run by the user"
    assert kept == [f"kept your {folder / '02_b.ipynb'} as it is: {committed / '02_b.ipynb'} changed since it was "
                    "copied, and so did the copy (remove it to get the new one)"]

    (folder / "02_b.ipynb").unlink()
    assert working_copies(committed) == (folder, [])
    assert (folder / "02_b.ipynb").read_text() == "02_b v2"


def test_find_notebook(tmp_path):
    for name in ("01_kv_layouts", "05_extend_kvlab", "05_extra"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    for name in ("01", "01_kv_layouts", "01_kv_layouts.ipynb", "notebooks/01_kv_layouts.ipynb"):
        assert find_notebook(tmp_path, name) == "01_kv_layouts.ipynb"
    assert find_notebook(tmp_path, "05_extend") == "05_extend_kvlab.ipynb"
    with pytest.raises(ValueError, match="more than one notebook '05'"):
        find_notebook(tmp_path, "05")
    with pytest.raises(ValueError, match="no notebook '06'"):
        find_notebook(tmp_path, "06")


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_lab_command_stops_jupyterlab_and_its_kernels(tmp_path, stop):
    """``python -m kvlab lab`` stopped by a service manager (SIGTERM), Ctrl-C or ``kill -INT``
    (SIGINT) or a closed terminal (SIGHUP) stops JupyterLab and its kernels, then exits 0.
    JupyterLab and each kernel lead process groups of their own, out of reach of the signal;
    the kernel here started a process that ignores the interrupt JupyterLab sends a kernel's
    group before asking the kernel to shut down, and the SIGTERM it sends when the kernel is
    slow to go (it signals the group only then). The command starts as a script's background
    job does, with SIGINT ignored (Python then installs no Ctrl-C handler of its own)."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed")
    from jupyter_client import BlockingKernelClient

    (tmp_path / "notebooks").mkdir()
    command, url, token, _ = lab_command(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lab = kernel = None
    try:
        (lab,) = children(command.pid)  # JupyterLab
        kernel_id = api(url, token, "POST", "/api/kernels", {})["id"]
        client = BlockingKernelClient(connection_file=str(tmp_path / "runtime" / f"kernel-{kernel_id}.json"))
        client.load_connection_file()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=60)
            reply = client.execute_interactive(STRAY, timeout=60)
            assert reply["content"]["status"] == "ok", reply["content"]
        finally:
            client.stop_channels()
        (kernel,) = children(lab)
        assert len(children(kernel)) == 1, "the kernel did not start its stray process"
        command.send_signal(stop)
        assert command.wait(timeout=STOP_SECONDS) == 0
        assert JupyterLab._live_members(lab) == [], "JupyterLab outlived the lab command"
        assert JupyterLab._live_members(kernel) == [], "the kernel's processes outlived the lab command"
    finally:
        command.kill()
        for group in (lab, kernel):
            if group is not None and JupyterLab._live_members(group):
                os.killpg(group, signal.SIGKILL)


STOP_SECONDS = 30  # JupyterLab and its kernels' groups go in seconds, also on 2 busy cores
# a process the kernel starts in its process group, deaf to the signals JupyterLab may send it
STRAY = ("import subprocess, sys\n"
         "stray = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
         "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "time.sleep(600)'])")


def lab_command(tmp_path: Path, *args: str, **popen: object) -> tuple[subprocess.Popen, str, str, str]:
    """``python -m kvlab lab --no-browser`` on ``tmp_path/notebooks`` with the test's own
    JupyterLab settings and runtime folder (the kernels' connection files), once it printed
    its URL: the process, JupyterLab's base URL, its token and the page it opens (after the
    base URL: /lab, or a notebook's)."""
    env = {**os.environ, **own_settings(tmp_path / "lab-settings"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    command = subprocess.Popen([sys.executable, "-m", "kvlab", "lab", "--no-browser", "--notebooks-dir",
                                str(tmp_path / "notebooks"), *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, **popen)
    output = []
    for line in command.stdout:  # until it says JupyterLab is up, or exits
        output.append(line)
        found = re.search(r"open (http://127\.0\.0\.1:\d+)(\S*?)[?&]token=(\w+)", line)
        if found:
            return command, found[1], found[3], found[2]
    command.wait()
    pytest.fail("the lab command exited before JupyterLab was up:\n" + "".join(output))


def api(url: str, token: str, method: str, path: str, body: object = None) -> dict | list:
    """One request to JupyterLab's REST API; its JSON answer."""
    request = urllib.request.Request(url + path, method=method, headers={"Authorization": f"token {token}"},
                                     data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read()
    return json.loads(text) if text else {}


@pytest.mark.slow
def test_a_notebook_saved_in_the_lab_leaves_the_committed_one_alone(tmp_path):
    """``python -m kvlab lab 07`` serves working copies: a notebook saved with its outputs (as
    JupyterLab saves one that ran, PUT /api/contents) lands in lab/, and git sees notebooks/
    unchanged, byte for byte; the committed notebook is out of the server's reach."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed")
    notebook = "07_extend_kvlab.ipynb"
    (tmp_path / "notebooks").mkdir()
    shutil.copy(NOTEBOOKS_DIR / notebook, tmp_path / "notebooks" / notebook)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=kvlab", "-c", "user.email=kvlab@localhost"]
    for step in (["init", "-q"], ["add", "notebooks"], ["commit", "-q", "-m", "notebooks"]):
        subprocess.run(git + step, check=True)
    original = (tmp_path / "notebooks" / notebook).read_bytes()

    command, url, token, page = lab_command(tmp_path, "07")
    try:
        assert page == f"/lab/workspaces/kvlab/tree/{notebook}?reset"
        model = api(url, token, "GET", f"/api/contents/{notebook}")
        cell = next(cell for cell in model["content"]["cells"] if cell["cell_type"] == "code")
        cell["execution_count"] = 1
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran in the lab\n"}]
        api(url, token, "PUT", f"/api/contents/{notebook}", {"type": "notebook", "format": "json",
                                                              "content": model["content"]})
        with pytest.raises(urllib.error.HTTPError):  # outside the folder it serves
            api(url, token, "GET", f"/api/contents/../notebooks/{notebook}")
    finally:
        command.send_signal(signal.SIGTERM)
        command.wait(timeout=STOP_SECONDS)
    assert subprocess.run(git + ["status", "--porcelain", "notebooks"], capture_output=True, text=True,
                          check=True).stdout == ""
    assert (tmp_path / "notebooks" / notebook).read_bytes() == original
    assert "ran in the lab" in (tmp_path / "lab" / notebook).read_text()


@pytest.mark.slow
def test_a_named_notebook_opens_alone(tmp_path):
    """The page ``lab_url(notebook)`` opens shows just that notebook with one kernel, although
    the workspace JupyterLab saved last had another notebook open (which it would reopen
    beside it, starting a second kernel)."""
    from browser import browser_missing, headless_chromium

    if browser_missing():
        pytest.skip(browser_missing())
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed")
    served = tmp_path / "notebooks"
    served.mkdir()
    for name in ("earlier.ipynb", "wanted.ipynb"):  # each starts its kernel when it opens
        (served / name).write_text(json.dumps({"cells": [], "metadata": {"kernelspec": PYTHON3}, "nbformat": 4,
                                                "nbformat_minor": 5}))

    with JupyterLab(served, log_path=tmp_path / "jupyterlab.log", env=own_settings(tmp_path / "lab")) as lab, \
            headless_chromium() as browser:
        page = browser.new_page()
        page.goto(lab.lab_url("earlier.ipynb"))  # kvlab lab earlier, stopped
        wait_until_open(page, "earlier.ipynb")
        page.wait_for_function(SAVED, arg="earlier.ipynb", timeout=UPDATE_TIMEOUT_MS)
        page.close()
        for session in api(lab.url, lab.token, "GET", "/api/sessions"):
            api(lab.url, lab.token, "DELETE", f"/api/sessions/{session['id']}")

        page = browser.new_page()
        page.goto(lab.lab_url("wanted.ipynb"))
        wait_until_open(page, "wanted.ipynb")
        assert page.locator(TABS).all_text_contents() == ["wanted.ipynb"]
        sessions = []
        for _ in range(UPDATE_TIMEOUT_MS // 500):  # the tab shows before its kernel's session is made
            sessions = [s["path"] for s in api(lab.url, lab.token, "GET", "/api/sessions")]
            if sessions:
                break
            page.wait_for_timeout(500)
        page.wait_for_timeout(1000)  # and a second notebook's session, had one opened, would come as soon
        assert [s["path"] for s in api(lab.url, lab.token, "GET", "/api/sessions")] == ["wanted.ipynb"], sessions


# whether the page's workspace (in its URL, else JupyterLab's default) was saved with the notebook open
SAVED = """async notebook => {
    const name = location.pathname.match(/\\/lab\\/workspaces\\/([^/]+)/)?.[1] ?? "default";
    const saved = await (await fetch(`/lab/api/workspaces/${name}`)).json();
    return JSON.stringify(saved).includes(notebook);
}"""


def wait_until_open(page, notebook: str) -> None:
    """Until ``notebook``'s tab is there and a kernel idle: JupyterLab opens a URL's notebook
    after it restored the saved workspace's tabs, so those are there by then too."""
    page.wait_for_function(f"""() => Array.from(document.querySelectorAll("{TABS}"))
        .some(tab => tab.textContent === "{notebook}") && {KERNEL_READY}""", timeout=RUN_TIMEOUT_MS)


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
        && {KERNEL_READY}""", timeout=RUN_TIMEOUT_MS)
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
    from browser import browser_missing, headless_chromium

    if browser_missing():
        pytest.skip(browser_missing())
    pytest.importorskip("ipywidgets", reason="the explorer needs ipywidgets")
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed")
    import base64
    import io

    import matplotlib.image
    from playwright.sync_api import expect

    from kvlab.plotting.explorer import map_figure, map_png, numbers

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
        numbers_box = page.locator(".kvlab-explorer-numbers")
        picture = page.locator("img.kvlab-explorer-map")
        state = {"model": "llama-3.1-8b", "layouts": ["LBHNC", "BLHNC"], "block_size": 16, "tokens": 256}
        # the bytes behind the map's <img>, base64 (ipywidgets shows an Image widget's value as a blob: URL)
        image_bytes = """async img => {
            const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
            return btoa(Array.from(bytes, b => String.fromCharCode(b)).join(""));
        }"""

        def view() -> tuple:
            return state["model"], state["layouts"], state["block_size"], state["tokens"]

        def shows_numbers() -> None:
            """The notes and every cell of the table, as this process computes them."""
            notes, table = numbers(*view())
            for text in notes + [str(value) for value in table.to_numpy().flatten() if str(value)]:
                expect(numbers_box).to_contain_text(text, timeout=UPDATE_TIMEOUT_MS)

        def shown_maps() -> list:
            """The map the browser shows, once it is the controls' map, cut into each map
            panel's pixels: the figure puts them at fixed places, titles and legends outside."""
            expected = map_png(*view())
            for _ in range(UPDATE_TIMEOUT_MS // 500):  # the map is sent after the numbers
                png = base64.b64decode(picture.evaluate(image_bytes))
                if png == expected:
                    break
                page.wait_for_timeout(500)
            assert png == expected, "the map shown is not the one of the controls"
            image = matplotlib.image.imread(io.BytesIO(png), format="png")
            height, width = image.shape[:2]
            boxes = [ax.get_position() for ax in map_figure(*view()).axes if ax.images]
            return [image[round((1 - b.y1) * height):round((1 - b.y0) * height),
                          round(b.x0 * width):round(b.x1 * width)] for b in boxes]

        shows_numbers()
        output.scroll_into_view_if_needed()
        shots.save("02_explorer", output.screenshot())
        assert output.bounding_box()["height"] < MAX_EXPLORER_PX, "the explorer does not fit one screen"
        # the first view after the widget, as a picture and a table: what saved and exported copies keep
        expect(cell.locator(".jp-OutputArea-output[data-mime-type='image/png']")).to_have_count(1)
        expect(cell.locator(".jp-OutputArea-output[data-mime-type='text/html'] table.dataframe")).to_have_count(1)
        maps_before = shown_maps()
        assert len(maps_before) == 4  # two layouts (columns), two colourings (rows)

        def change(name: str, act, changed=(0, 1, 2, 3)) -> None:
            """Work one control: the numbers must become the new ones, and every map panel in
            ``changed`` must draw something else inside its frame (not only a new title)."""
            nonlocal maps_before
            text_before = numbers_box.text_content()
            act()
            shows_numbers()
            assert numbers_box.text_content() != text_before, f"{name}: the numbers did not change"
            page.wait_for_selector(KERNEL_IDLE, timeout=UPDATE_TIMEOUT_MS)
            maps_after = shown_maps()
            for panel in changed:
                assert (maps_after[panel] != maps_before[panel]).any(), f"{name}: map panel {panel} did not change"
            maps_before = maps_after
            shots.save(f"03_{name}", output.screenshot())

        state["model"] = "deepseek-v2-lite"  # MLA: the layout lists change, LBHNC and BLHNC stay
        change("model", lambda: page.locator(".kvlab-explorer-model select").select_option(state["model"]))
        expect(page.locator(".kvlab-explorer-layout-a select")).to_have_value("LBHNC")
        expect(page.locator(".kvlab-explorer-layout-a option[value='mla_v0.12']")).to_have_count(1)
        state["layouts"][0] = "mla_v0.12"
        change("layout_a", lambda: page.locator(".kvlab-explorer-layout-a select").select_option("mla_v0.12"),
               changed=(0, 2))  # layout A's column
        state["layouts"][1] = "ascend_mla_tuple"
        change("layout_b", lambda: page.locator(".kvlab-explorer-layout-b select").select_option("ascend_mla_tuple"),
               changed=(1, 3))
        state["block_size"] = 64
        change("block_size", lambda: page.locator(".kvlab-explorer-block-size select").select_option("64"))
        # segments; a row per machine estimated on (each committed one where this machine has no results)
        expect(numbers_box.locator("tr", has_text="ascend_mla_tuple").first).to_contain_text("216")
        state["tokens"] = 512  # the slider's next stop
        change("tokens", lambda: page.locator(".kvlab-explorer-tokens .noUi-handle").press("ArrowRight"))
        expect(page.locator(".kvlab-explorer-tokens .widget-readout")).to_have_text("512")

    assert (NOTEBOOKS_DIR / NOTEBOOK).read_bytes() == original, "the test changed notebooks/"
