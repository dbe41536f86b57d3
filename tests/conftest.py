"""Shared fixtures: a tiny embedded corpus, and launchers for 1-process and torchrun runs."""

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lingua.parallel.distributed import JOB_DEVICE_VAR
from tests import launcher

REPO = Path(__file__).resolve().parent.parent

# Small enough that a 4-rank run of a few steps takes seconds on 2 cores.
TINY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.multiple_of=32", "model.max_seq_len=128"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    from lingua.data import ensure_embedded_corpus

    root = tmp_path_factory.mktemp("corpus") / "embedded"
    ensure_embedded_corpus(str(root))
    return root


def tiny_args(corpus: Path, dump_dir: Path, *extra: str, steps: int = 5) -> list:
    return [f"dump_dir={dump_dir}", f"data.root={corpus}", "data.prepare_embedded=false",
            "data.seq_len=64", "data.val_sequences=8", f"steps={steps}", "optim.warmup=2",
            "optim.lr=3e-3", "logging.every=1", "eval.every=0", "checkpoint.every=0",
            *TINY_MODEL, *extra]


def read_metrics(dump_dir: Path) -> list:
    path = Path(dump_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def load_setup_script(name: str = "prepare_data"):
    """setup/<name>.py as a module (a script, not part of a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_under_test",
                                                  REPO / "setup" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_prepare_data():
    return load_setup_script("prepare_data")


def saved_tensor_bytes(run) -> int:
    """Bytes autograd keeps for backward while `run()` runs its forward and backward: one count
    per storage (a tensor saved by two ops, as log_softmax's output is by nll_loss, counts once)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


_ports = {}


def free_port() -> int:
    """A port for a rendezvous (MASTER_PORT), free now. Not the kernel's pick among the
    ephemeral ports (32768-60999), which the ranks' own connections also take, nor stool jobs'
    20000-39999: each pytest-xdist worker walks its own slice of 10000-19999, so two workers
    never race for one port."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    size = 10000 // count
    first = 10000 + worker * size
    for _ in range(size):
        port = _ports.get(worker, first + os.getpid() % size)
        _ports[worker] = first + (port + 1 - first) % size
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + size - 1}")


def run_torchrun(nproc: int, module: str, args: list, timeout: int = 240,
                 check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc -m module args` (or a script's path for module), its
    ranks forked warm from tests/launcher.py's server; fresh=True launches the real torchrun (its
    agent, its store, its failure summary, import-time output). check: fail with its output if
    it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    if fresh:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               *([] if launcher.is_script(module) else ["-m"]), module, *args]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    else:
        proc = launcher.launch(module, args, nproc, env, REPO, timeout, master_port=free_port())
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def run_python(module: str, args: list, timeout: int = 240,
               check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m module args`, forked warm from tests/launcher.py's server; fresh=True starts
    a new interpreter (import-time output, a module the server does not import)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    if fresh:
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)
    else:
        proc = launcher.launch(module, args, 0, env, REPO, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def slurm_is_up() -> str:
    """'' when the local Slurm answers, else why not (the slurm tests skip, or fail where
    setup/test.sh started Slurm and set LINGUA_REQUIRE_SLURM=1)."""
    if shutil.which("sinfo") is None:
        return "Slurm is not installed (bash setup/slurm_local.sh start installs and starts it)"
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 or not proc.stdout.strip():
        return f"Slurm is not running: {proc.stderr.strip()} (bash setup/slurm_local.sh start)"
    return ""


# On a machine with a GPU every test not marked gpu still trains on the CPU, in-process and in
# the torchrun processes it starts (they inherit the variable): their references are
# single-process CPU runs, their layouts gloo groups of up to 8 ranks that one GPU's NCCL cannot
# hold. Set for the whole session, so session- and module-scoped fixtures (reference runs that
# gpu tests compare with too) train on the CPU; gpu-marked tests lift it. Without a GPU this
# changes nothing.
_CPU_ON_GPU_MACHINE = False
if os.environ.get(JOB_DEVICE_VAR) is None and torch.cuda.is_available():
    os.environ[JOB_DEVICE_VAR] = "cpu"
    _CPU_ON_GPU_MACHINE = True


@pytest.fixture(autouse=True)
def _gpu_tests_train_on_the_gpu(request, monkeypatch):
    if _CPU_ON_GPU_MACHINE and request.node.get_closest_marker("gpu") is not None:
        monkeypatch.delenv(JOB_DEVICE_VAR)


@pytest.fixture(autouse=True)
def _root_log_handlers_do_not_leak():
    """A test that runs a trainer or CLI in-process calls metrics.setup_logging, whose
    basicConfig(force=True) binds the root logger to that test's captured stdout. Left there, a
    later test's log records go to a closed stream ("--- Logging error ---" on stderr, which
    breaks tests that count stderr lines). After each test the plain StreamHandlers it added to
    the root logger go (pytest's own capture handlers are subclasses and are left to pytest)."""
    import logging

    root = logging.getLogger()
    before = set(root.handlers)
    yield
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)


# The files whose tests submit jobs to the real local Slurm (two CPUs): under pytest-xdist they
# run one after another on one worker, while the other worker takes the rest.
SLURM_FILES = ("test_slurm.py", "test_eval_jobs.py")


def pytest_configure(config):
    # Keep the order pytest_collection_modifyitems gives the files (xdist would sort its work
    # units by their number of tests, which put files of one long test last).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (setup/test.sh): one work unit per test file, so a module's reference run
    is computed once, and the Slurm files one unit together. Our own rule rather than xdist's
    xdist_group marks, which do nothing under pytest 9.2 (xdist 3.8 renames the items' nodeid
    through an attribute pytest no longer reads)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneFileAUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if path.rsplit("/", 1)[-1] in SLURM_FILES else path

    return OneFileAUnit(config, log)


def expected_seconds(item) -> float:
    """A rough cost of one test, from its markers alone, to hand out the longest files first."""
    import torch

    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        return 0.0   # skipped
    if item.get_closest_marker("slurm"):
        return 40.0
    return 8.0 if item.get_closest_marker("slow") else 0.3


def pytest_collection_modifyitems(items):
    # The quick tier (`bash setup/test.sh -m "not slow"`) leaves out every test that starts
    # several processes or a Slurm job, besides those marked slow by hand (over ~3 s alone).
    for item in items:
        if any(item.get_closest_marker(m) for m in ("distributed", "slurm", "gpu")):
            item.add_marker(pytest.mark.slow)
    # pytest-xdist (setup/test.sh runs two workers, one file a unit): the files go longest first
    # (the longest-processing-time rule: no long file is left to start last while the other
    # worker idles).
    def unit(item):
        return "slurm" if item.path.name in SLURM_FILES else item.path.name

    unit_seconds = {}
    for item in items:
        unit_seconds[unit(item)] = unit_seconds.get(unit(item), 0.0) + expected_seconds(item)
    items.sort(key=lambda item: -unit_seconds[unit(item)])   # stable: a file keeps its order


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """What the GPU presets' validation needs: a jsonl corpus with held-out data, and a tiktoken
    ranks file (256 single bytes; 258 tokens with BOS/EOS, under every preset's vocabulary)."""
    root = tmp_path_factory.mktemp("plan_data")
    (root / "val").mkdir()
    for path in (root / "0.jsonl", root / "val" / "0.jsonl"):
        path.write_text('{"text": "a document"}\n')
    tok = root / "tokenizer.model"
    tok.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    return [f"data.root={root}", f"data.tokenizer.path={tok}"]
