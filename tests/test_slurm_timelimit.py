"""Slurm's time-limit warning (SIGUSR2) may reach a stool job while it is still starting: Slurm
sends it up to 30 s before the asked-for moment, so a job whose slurm.signal_delay_s is close to
its slurm.time gets it within seconds of starting. No Slurm needed here (tests/test_slurm.py
runs the real thing)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Sends this process SIGUSR2 as torch starts to import (the slowest part of a job's start-up),
# then runs a stool job whose app exits with 40 + the signal it recorded (REQUEUE is 2).
JOB = """
import os, signal, sys
from lingua.launch import stool

class SignalOnTorchImport:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGUSR2)

sys.meta_path.insert(0, SignalOnTorchImport())
stool.TrainJob("fake_app", [])()
"""


@pytest.mark.slow   # starts a process
def test_a_time_limit_warning_during_start_up_is_recorded_not_fatal(tmp_path):
    (tmp_path / "fake_app.py").write_text(
        "from lingua.train import preemption\n\n"
        "def main(argv):\n    return 40 + preemption.SIGNALS.received\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", JOB], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    # Listening only after torch's import, the job died of the signal (-12), or under submitit's
    # handler failed with exit code 1 ("timed-out and not checkpointable").
    assert proc.returncode == 42, proc.stdout + proc.stderr
    assert "got SIGUSR2" in proc.stderr, proc.stderr
