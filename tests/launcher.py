"""Start the tests' training processes warm: forked from a server that imported torch and the
project once, instead of a fresh interpreter (and a torchrun agent) per run.

A fresh `python -m apps.llama.train` spends about 2.5 s of a core importing torch, torch.distributed
and the apps before it builds anything, and torchrun spends as much again in its agent before the
ranks start; the suite starts a few hundred such processes. Python's own forkserver
(multiprocessing's "forkserver" start method, with set_forkserver_preload) imports them once in a
server process that has started no thread and run no op; every rank is then a fork of it that
runs the module as `python -m` would (runpy, as __main__, with sys.argv and its environment set),
so each run still gets processes of its own, and nothing a run does reaches the next.

What a real launch gives that this does not, and where the tests keep the real one
(`fresh=True` in tests/conftest.py's run_torchrun and run_python):
  - torchrun's agent: its TCP store (lingua.errors reports an error once through it), its
    failure summary, restarts and signal forwarding; here every rank prints its own error, and
    the launcher stops the others when one fails, as torchrun does;
  - import-time behaviour: what importing the project prints or warns happened once, in the
    server, not in the run's own output.
The environment a rank sees is the one torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK, ...), on top of the caller's.
"""

import multiprocessing
import multiprocessing.connection
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

# What every rank imports anyway; the server imports it before it forks anything.
PRELOAD = ["tests.launcher_preload"]

_context = None


def _server():
    """The forkserver context, started on first use with OMP_NUM_THREADS=1: GNU OpenMP reads the
    variable when torch loads it, in the server, and the tests' ranks run one thread each."""
    global _context
    if _context is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _context = ctx
    return _context


def is_script(target: str) -> bool:
    return target.endswith(".py") or os.sep in target


def _run_module(module: str, argv: list, env: dict, cwd: str, out: str, err: str) -> None:
    """In the forked process: what `python -m module argv` (or `python module argv` for a
    script's path) does, with env as its environment
    and its stdout / stderr appended to the files `out` and `err` (file descriptors 1 and 2, so
    C-level output goes there too)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    code = 0
    try:
        if is_script(module):   # `python path/to/script.py argv`
            sys.argv = [module, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
            runpy.run_path(module, run_name="__main__")
        else:
            sys.argv = [module, *argv]
            # As in a fresh `python -m`, the module is not yet imported when it runs as __main__
            # (runpy warns otherwise); the server's copy stays with whatever imported it.
            sys.modules.pop(module, None)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # What the interpreter does at exit, which a multiprocessing child skips: wait for
    # non-daemon threads, run atexit handlers.
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(module: str, args: list, nproc: int, env: dict, cwd, timeout: float,
           master_port: Optional[int] = None) -> subprocess.CompletedProcess:
    """Run `module` (a module's name, or a script's path) on nproc ranks (nproc=0: one process
    with no distributed environment, as `python -m`); returns what subprocess.run would
    (torchrun's exit code 1 if any rank failed). When a rank fails the others are stopped, as
    torchrun stops them."""
    ctx = _server()
    cmd = ["launcher", *(["--nproc-per-node", str(nproc)] if nproc else []),
           *([] if is_script(module) else ["-m"]), module, *args]
    with tempfile.TemporaryDirectory(prefix="launch_") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        procs = []
        for rank in range(max(nproc, 1)):
            rank_env = dict(env)
            if nproc:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                                ROLE_RANK=str(rank), ROLE_NAME="default",
                                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                                ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
                                TORCHELASTIC_RUN_ID="tests", TORCHELASTIC_RESTART_COUNT="0",
                                TORCHELASTIC_MAX_RESTARTS="0")
            p = ctx.Process(target=_run_module, args=(module, list(args), rank_env, str(cwd),
                                                      str(out), str(err)), daemon=False)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        failed = False
        while any(p.exitcode is None for p in procs):
            if time.monotonic() > deadline:
                _stop(procs)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
            if not failed and any(p.exitcode not in (None, 0) for p in procs):
                failed = True
                _stop(procs)
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None],
                                            timeout=0.5)
        codes = [p.exitcode for p in procs]
        returncode = 0 if all(c == 0 for c in codes) else (
            next(c for c in codes if c != 0) if not nproc else 1)
        return subprocess.CompletedProcess(cmd, returncode, out.read_text(), err.read_text())


def _stop(procs) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(5)
        if p.exitcode is None:
            p.kill()
            p.join()
