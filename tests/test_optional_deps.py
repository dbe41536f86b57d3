"""Training needs none of the optional heavy dependencies: lm-eval (downstream evaluation),
wandb (logging.wandb), submitit (stool, async evaluation), pyarrow (data.format=parquet) and
torchft (fault_tolerance.enabled) are imported where used."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, read_metrics, tiny_args

OPTIONAL = ("lm_eval", "wandb", "submitit", "pyarrow", "torchft")

# Runs the trainer in a process where importing any OPTIONAL package (or a submodule) fails as
# it would where the package is not installed. Each attempt is appended to the file named by
# argv[1] as it happens (the trainer leaves through os._exit, past any finally or atexit).
BLOCKER = f"""
import importlib.abc, runpy, sys
attempts = sys.argv.pop(1)
class Unimportable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            with open(attempts, "a") as f:
                print(name, file=f)
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Unimportable())
sys.argv = ["apps.llama.train", *sys.argv[1:]]
runpy.run_module("apps.llama.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_the_debug_preset_trains_without_lm_eval_wandb_submitit_and_pyarrow(corpus, tmp_path):
    dump, attempts = tmp_path / "run", tmp_path / "import_attempts.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-c", BLOCKER, str(attempts),
                           *tiny_args(corpus, dump, steps=3)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert [row["step"] for row in read_metrics(dump)] == [1, 2, 3]
    # Not even tried: training has no code path that reaches for them.
    assert not attempts.exists(), attempts.read_text()
