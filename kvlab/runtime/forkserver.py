"""A process that imports vLLM once and forks each child job from itself: an engine child
then starts without the seconds its imports take (about 8 s of a 19 s engine start on a
2-core EPYC). The server runs with the pinned environment (kvlab.runtime.processes); a job
whose environment differs from it in anything but vLLM's own variables, which vLLM reads
when it uses them, runs as a plain ``python -m`` instead, as does every job where forking is
off (``KVLAB_FORK_SERVER=0``) or the server cannot start. The server only imports: it runs
no torch work before a fork, so no thread pool is copied half-made."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

PRELOADED = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "transformers")
LAZY_PREFIX = "VLLM_"  # vllm.envs reads these at each use, so a forked child may set its own
VOLATILE = {"PYTEST_CURRENT_TEST"}  # pytest's name of the running test: changes with each, read by nothing imported


def same_imports(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether two environments agree in everything an import may read: all but vLLM's own
    variables and pytest's name of the running test."""
    return all(a.get(name) == b.get(name) for name in set(a) | set(b)
               if not name.startswith(LAZY_PREFIX) and name not in VOLATILE)


class ForkServer:
    """One server process, the jobs sent to it one at a time; :meth:`run` returns the
    job's exit code, or None when this job cannot be forked (the caller runs it plainly)."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] | None = None) -> None:
        self.env, self.cwd = dict(env), os.getcwd()
        self.lock = threading.Lock()
        self.process = subprocess.Popen([sys.executable, "-m", __name__, *(preload or PRELOADED)], env=self.env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True)
        if self.process.stdout.readline().strip() != "ready":
            self.close()
            raise OSError("kvlab's fork server did not start")

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a job with environment ``env``, started from this folder, may be forked
        from this server."""
        return self.process.poll() is None and os.getcwd() == self.cwd and same_imports(env, self.env)

    def run(self, module: str, args: list[str], env: dict[str, str], log: Path, timeout: float) -> int | None:
        """``python -m module args`` forked from the server, with ``env``, its output in
        ``log``; its exit code (killed after ``timeout`` s: subprocess.TimeoutExpired, as
        subprocess.run raises). None where it cannot be forked: the caller starts it plainly."""
        if not self.accepts(env) or not self.lock.acquire(blocking=False):
            return None
        try:
            request = {"module": module, "args": args, "env": env, "log": str(log)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            forked = self.process.stdout.readline()
            if not forked.strip():  # the server is gone: nothing was started
                return None
            pid = int(forked)
            answer: list[str] = []
            reader = threading.Thread(target=lambda: answer.append(self.process.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():  # killed as subprocess.run kills a child past its time
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                reader.join()
                raise subprocess.TimeoutExpired(f"python -m {module}", timeout)
            if not answer or not answer[0].strip():
                raise OSError("kvlab's fork server stopped")
            return int(answer[0])
        finally:
            self.lock.release()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


def _serve(preload: list[str]) -> None:
    """The server: import ``preload``, then fork a child per request line and answer its
    pid, then its exit code."""
    for name in preload:
        __import__(name)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


def _child(request: dict) -> None:
    """In the forked child: its own environment and output, then the module as ``python -m``
    runs it; never returns. It stays in the server's process group, as a plain child stays in
    its parent's: what stops the group (JupyterLab stopping a kernel) stops it too."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdin = open(os.devnull)
        sys.argv = [request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - whatever it was, the log says it and the code is 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1:])
