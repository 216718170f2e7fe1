"""Every code block of README.md and of docs/*.md runs as written, so neither the README nor the
docs it links can rot (their measured numbers are rendered from the committed results and
checked in tests/plotting/test_documents.py).

The policy of each block lives beside it in its file, as an HTML comment on the line right
before the fence (invisible on GitHub):

- none: a fast test runs it;
- ``<!-- readme-test: slow -->``: it starts vLLM engines, servers or LMCache: the slow test runs it;
- ``<!-- readme-test: server (URL) -->``: a console command that serves until stopped (slow): it
  must answer ``URL/health``, then it is stopped;
- ``<!-- readme-test: test (path) -->``: the set-up of the test module at ``path``, which runs it
  as written (:func:`code_run_by`) and shares its engines;
- ``<!-- readme-test: skip (reason) -->``: never run, for the reason given.

``python`` blocks run in a fresh ``.venv/bin/python`` from the repository root; ``console``
blocks are ``$ command`` lines (``\\`` continues one), each followed by the output it must print;
``bash`` blocks run as one script, except the set-up commands themselves (``SETUP_COMMANDS``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvlab.runtime.servers import check_port_free

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The README and the reference pages it links: every code block of any of them is tested the same way.
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = ROOT / ".venv" / "bin" / "python"

# The commands that build what the README's blocks need, or the whole suite: running them from a
# test would recurse or take an hour.
SETUP_COMMANDS = {
    "make run": "executes every notebook, measuring for an hour",
    "make test-extended": "is the extended engine suite of these tests (CI runs it after make test)",
    "make test": "is this test suite: it would recurse",
    "make lab": "starts JupyterLab and waits for a browser",
    "make figures": "redraws every figure from the committed results (the notebooks' tests cover it)",
    "make conformance": "runs the connector's tests against the newest vLLM's code (CI runs it after these)",
    "conda env create": "builds a second environment",
}
POLICIES = ("fast", "slow", "server", "test", "skip")
MARKER = re.compile(r"<!--\s*readme-test:\s*(\w+)\s*(?:\((.*)\))?\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
FAST_TIMEOUT_S = 600
SLOW_TIMEOUT_S = 3600
SERVER_START_TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    """One fenced code block of the README (or a docs/ page), with the section it sits in and
    its policy."""

    language: str
    code: str
    line: int  # of the opening fence
    section: str
    policy: str = "fast"
    detail: str = ""  # the reason to skip, or the URL a server answers on
    path: str = "README.md"  # the file, relative to the repository root

    @property
    def id(self) -> str:
        where = "" if self.path == "README.md" else re.sub(r"[^a-z0-9]+", "-", Path(self.path).stem.lower()) + "-"
        return f"{where}{re.sub(r'[^a-z0-9]+', '-', self.section.lower()).strip('-')}-L{self.line}"


def readme_blocks(text: str, path: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text`` (the file at ``path``) in order; a marker names an unknown
    policy, or a fence is left open: a clear error."""
    blocks, section, lines = [], "top", text.splitlines()
    number = 0
    while number < len(lines):
        line = lines[number]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        opening = FENCE.match(line)
        if not opening:
            number += 1
            continue
        end = next((i for i in range(number + 1, len(lines)) if lines[i].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path}:{number + 1}: a fence that is never closed")
        policy, detail = "fast", ""
        marker = MARKER.fullmatch(lines[number - 1].strip()) if number else None
        if marker:
            policy, detail = marker[1], marker[2] or ""
            if policy not in POLICIES:
                raise ValueError(f"{path}:{number}: unknown readme-test policy {policy!r}; choose from {POLICIES}")
            if policy in ("skip", "server", "test") and not detail:
                needs = {"skip": "reason", "server": "URL", "test": "test module's path"}[policy]
                raise ValueError(f"{path}:{number}: readme-test: {policy} needs its ({needs})")
        blocks.append(Block(opening[1], "\n".join(lines[number + 1:end]) + "\n", number + 1, section, policy, detail,
                            path))
        number = end + 1
    return blocks


@dataclass(frozen=True)
class ConsoleCommand:
    """One ``$`` line of a console block (continuations joined) and the output shown under it."""

    command: str
    expected: str


def console_commands(code: str) -> list[ConsoleCommand]:
    commands: list[list[str]] = []  # [command, *output lines]
    continued = False
    for line in code.splitlines():
        if continued:
            commands[-1][0] += "\n" + line
        elif line.startswith("$ "):
            commands.append([line[2:]])
        elif commands:
            commands[-1].append(line)
        else:
            raise ValueError(f"a console block starts with output, not a '$ ' command: {line!r}")
        continued = line.endswith("\\")
    return [ConsoleCommand(_with_venv(c[0]), _normalised("\n".join(c[1:]))) for c in commands]


def _with_venv(command: str) -> str:
    """A leading ``python`` is the venv's."""
    return re.sub(r"^python3?(?=\s)", str(PYTHON), command)


def _normalised(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.strip("\n").splitlines())


def setup_reason(block: Block) -> str | None:
    """Why a bash block is not run: every command in it is a set-up command."""
    commands = [line.split("#")[0].strip() for line in block.code.splitlines()]
    commands = [c for c in commands if c]
    reasons = [next((f"`{c}` {why}" for name, why in SETUP_COMMANDS.items() if c.startswith(name)), None)
               for c in commands]
    return "; ".join(reasons) if commands and all(reasons) else None


def user_env() -> dict[str, str]:
    """The environment a reader has: without what the test suite sets for itself (conftest
    sizes vLLM's KV cache; a block must say so itself when it needs it)."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE" and not k.startswith("PYTEST_")}


def run_shell(command: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=ROOT, env=user_env(), text=True,
                          capture_output=True, timeout=timeout, check=False)


def check_ran(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, (f"{what} exited with {result.returncode}\n--- stdout (tail)\n"
                                    f"{result.stdout[-3000:]}\n--- stderr (tail)\n{result.stderr[-5000:]}")


def run_block(block: Block, tmp_path: Path) -> None:
    timeout = SLOW_TIMEOUT_S if block.policy == "slow" else FAST_TIMEOUT_S
    where = f"{block.path}:{block.line} ({block.section})"
    if block.language == "python":
        script = tmp_path / f"readme_L{block.line}.py"
        script.write_text(block.code)
        check_ran(subprocess.run([str(PYTHON), str(script)], cwd=ROOT, env=user_env(), text=True,
                                 capture_output=True, timeout=timeout, check=False), where)
    elif block.language == "console":
        for command in console_commands(block.code):
            result = run_shell(command.command, timeout)
            check_ran(result, f"{where}: $ {command.command}")
            if command.expected:
                assert _normalised(result.stdout) == command.expected, f"{where}: $ {command.command} printed otherwise"
    elif block.language == "bash":
        check_ran(run_shell(block.code, timeout), where)
    else:
        language = block.language or "plain"
        raise ValueError(f"{where}: no way to run a {language!r} block; mark it readme-test: skip (why)")


def run_server(block: Block, tmp_path: Path) -> None:
    """Start the block's one command, wait until it answers ``<URL>/health``, ask it the same
    completion twice (the repeat must report cached prompt tokens), then stop its process group."""
    (command,) = console_commands(block.code)
    url = block.detail.rstrip("/")
    host, port = urlsplit(url).hostname, urlsplit(url).port
    check_port_free(host, port)  # a clear error naming the port, before anything starts
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(["bash", "-c", command.command], cwd=ROOT, env=user_env(), stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(server, url, log)
        model = _get_json(f"{url}/v1/models")["data"][0]["id"]
        prompt = "The quick brown fox jumps over the lazy dog. " * 40
        usages = [_post_json(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4})["usage"]
                  for _ in range(2)]
        cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usages]
        assert None not in cached and cached[1] > 0, f"the repeat reports no cached prompt tokens: {usages}"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_healthy(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode} before answering:\n{log.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    pytest.fail(f"no answer from {url}/health within {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-5000:]}")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def _post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


BLOCKS = [block for doc in DOCS for block in readme_blocks(doc.read_text(), relative(doc))]


def params(*policies: str) -> list:
    """One param per block of these policies; skipped blocks and set-up commands say why."""
    chosen = []
    for block in (b for b in BLOCKS if b.policy in policies):
        setup = setup_reason(block) if block.language == "bash" else None
        reason = block.detail if block.policy == "skip" else setup and f"set-up commands: {setup}"
        chosen.append(pytest.param(block, id=block.id, marks=[pytest.mark.skip(reason=reason)] if reason else []))
    return chosen


@pytest.mark.parametrize("block", params("fast", "skip"))
def test_readme_block(block: Block, tmp_path: Path):
    run_block(block, tmp_path)


@pytest.mark.slow
@pytest.mark.extended  # they start vLLM engines: the extended engine suite (CI runs it)
@pytest.mark.parametrize("block", params("slow", "server"))
def test_readme_block_slow(block: Block, tmp_path: Path):
    (run_server if block.policy == "server" else run_block)(block, tmp_path)


def code_run_by(test_file: str | Path) -> str:
    """The code of the one block marked ``readme-test: test (<test_file>)``: that test module
    runs it as written, as its set-up."""
    mine = [b for b in BLOCKS if b.policy == "test" and ROOT / b.detail == Path(test_file).resolve()]
    if len(mine) != 1:
        raise LookupError(f"{len(mine)} blocks are marked readme-test: test ({test_file}); one is")
    return mine[0].code


def test_blocks_run_by_a_test_name_a_test_that_runs_them():
    for block in (b for b in BLOCKS if b.policy == "test"):
        test = ROOT / block.detail
        assert test.is_file() and "code_run_by(__file__)" in test.read_text(), \
            f"{block.path}:{block.line}: {block.detail} does not run the block (code_run_by(__file__))"


def test_every_connector_example_recomputes_a_failed_load():
    """A user copies these (the README's, docs/lmeval.md's, any docs page's): with vLLM's
    default kv_load_failure_policy ("fail") a load that fails its check fails the request
    instead of being recomputed."""
    examples = [b for b in BLOCKS if "KVLabConnector" in b.code]
    assert {"README.md", "docs/lmeval.md"} <= {b.path for b in examples}
    for block in examples:
        assert re.search(r"""["']?kv_load_failure_policy["']?\s*[=:]\s*["']recompute["']""", block.code), \
            f"{block.path}:{block.line} configures KVLabConnector without kv_load_failure_policy recompute"


def test_readme_blocks_have_a_runner():
    """Every block not skipped is in a language this test runs (else: mark it skip, with why)."""
    assert {b.language for b in BLOCKS if b.policy != "skip"} <= {"python", "console", "bash"}


def test_console_parsing():
    commands = console_commands("$ python -m kvlab x \\\n    --y 1\nline one  \n\n$ true\n")
    assert [c.command for c in commands] == [f"{PYTHON} -m kvlab x \\\n    --y 1", "true"]
    assert [c.expected for c in commands] == ["line one", ""]
    with pytest.raises(ValueError, match="starts with output"):
        console_commands("output\n$ true\n")
    with pytest.raises(ValueError, match="unknown readme-test policy"):
        readme_blocks("<!-- readme-test: later -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        readme_blocks("```python\npass\n")
    with pytest.raises(ValueError, match=r"docs/x\.md:1: unknown"):
        readme_blocks("<!-- readme-test: later -->\n```python\npass\n```\n", "docs/x.md")


def test_docs_blocks_are_collected():
    """The docs pages' blocks are checked as the README's are, each named by its file."""
    paths = {block.path for block in BLOCKS}
    assert "README.md" in paths and "docs/lmeval.md" in paths
    assert all(block.id.startswith(Path(block.path).stem.lower()) for block in BLOCKS if block.path != "README.md")
