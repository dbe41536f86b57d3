"""A researcher's first day: what she types and what she sees.

- a data.root she names that does not exist is an error, not a place to build a toy corpus in;
- Ctrl-C saves at the next step and stops with one line (where, and the command that resumes);
  a second one stops at once; before the loop it is one line too; never a traceback;
- under torchrun an error is printed once and is the failure torchrun's summary reports;
- the step line shows progress and the time left.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.llama import train
from lingua import errors
from lingua.errors import ConfigError
from lingua.observe import metrics
from tests import launcher
from tests.conftest import REPO, TINY_MODEL, free_port, run_python, run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows

# The exit code of a run the user interrupted, as a shell expects it: 128 + SIGINT (2).
INTERRUPTED = 130


# ------------------------------------------------------------------------------------------------
# 1. The preset builds its embedded corpus at its own data.root only


def test_the_preset_prepares_its_corpus_only_where_it_says(tmp_path):
    def prepares(*argv):
        return train.load_config(list(argv), check=False).data.prepare_embedded

    missing = tmp_path / "nonexistent" / "data"
    assert prepares()                                       # the preset's own data/embedded
    assert prepares("data.root=./data/embedded")            # the same place, spelt otherwise
    assert not prepares(f"data.root={missing}")             # somewhere the user named
    assert prepares(f"data.root={missing}", "data.prepare_embedded=true")   # asked for there
    assert not prepares("data.prepare_embedded=false")
    with pytest.raises(ConfigError, match=re.escape(f"data.root={missing} does not exist")) as err:
        train.load_config([f"data.root={missing}"])
    assert "data.prepare_embedded=true" in str(err.value)   # the way to ask for it is named
    assert not (tmp_path / "nonexistent").exists()


@pytest.mark.slow
def test_a_missing_data_root_stops_the_command_before_anything_is_made(tmp_path):
    missing, dump = tmp_path / "nonexistent" / "data", tmp_path / "run"
    # The debug preset (data.prepare_embedded: true) with a tiny model and one step: before the
    # fix this built a corpus in `missing` and trained.
    proc = run_python("apps.llama.train", [f"data.root={missing}", f"dump_dir={dump}", "steps=1",
                                           "data.seq_len=64", "eval.every=0", *TINY_MODEL],
                      check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: data.root={missing} does not exist" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "nonexistent").exists() and not dump.exists()


# ------------------------------------------------------------------------------------------------
# 2. Ctrl-C


def _python_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


def _terminal_sigint():
    """preexec_fn: SIGINT as a terminal's foreground command has it (default). A suite started in
    the background (`cmd &` without job control, as CI runners and nohup scripts do) hands its
    children SIGINT ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C before
    the training loop's own handler would go unseen."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(cmd: list, out: Path) -> subprocess.Popen:
    """`cmd` in the repository with stdout and stderr going to out.stdout / out.stderr files,
    which the test reads while it runs (a pipe nobody reads could fill up and stall it)."""
    return subprocess.Popen(cmd, cwd=REPO, env=_python_env(),
                            stdout=open(out.with_suffix(".stdout"), "w"),
                            stderr=open(out.with_suffix(".stderr"), "w"),
                            preexec_fn=_terminal_sigint)


def _output(out: Path) -> tuple:
    return out.with_suffix(".stdout").read_text(), out.with_suffix(".stderr").read_text()


def _wait_for(condition, proc: subprocess.Popen, out: Path, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n"
                                 + "\n".join(s[-3000:] for s in _output(out)))
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} after {timeout} s:\n"
                                 + "\n".join(s[-3000:] for s in _output(out)))
        time.sleep(0.1)


def _rows_logged(dump: Path) -> int:
    path = dump / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 180) -> tuple:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the run did not stop:\n"
                             + "\n".join(s[-3000:] for s in _output(out))) from None
    return _output(out)


def _checkpoints(dump: Path) -> list:
    root = dump / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


STEPS = 150   # tiny steps (~10-50 ms): long enough to be interrupted, short enough to resume


@pytest.fixture(scope="module")
def interrupted_run(corpus, tmp_path_factory):
    """`python -m apps.llama.train` interrupted once with SIGINT (what Ctrl-C sends) after a
    few steps: (run directory, return code, stdout, stderr, rows before resuming)."""
    tmp = tmp_path_factory.mktemp("ctrl_c")
    dump, out = tmp / "run", tmp / "first"
    proc = _start([sys.executable, "-m", "apps.llama.train", *tiny_args(corpus, dump, steps=STEPS)],
                  out)
    _wait_for(lambda: _rows_logged(dump) >= 3, proc, out, "3 logged steps")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = _finish(proc, out)
    return dump, proc.returncode, stdout, stderr, read_rows(dump)


@pytest.mark.slow
def test_ctrl_c_saves_at_the_next_step_says_where_and_the_same_command_resumes(
        corpus, interrupted_run):
    dump, code, stdout, stderr, rows = interrupted_run
    assert code == INTERRUPTED, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    [saved] = _checkpoints(dump)
    assert rows[-1]["step"] == saved < STEPS
    # One line says it heard the Ctrl-C, one says where the run is and what resumes it.
    assert stderr.count("lingua: got Ctrl-C; saving a checkpoint after this step") == 1, stderr
    [where] = [line for line in stdout.splitlines() if "interrupted (Ctrl-C)" in line]
    args = tiny_args(corpus, dump, steps=STEPS)
    assert f"after step {saved}; checkpoint {dump / 'checkpoints' / str(saved)} saved" in where
    assert where.endswith("to resume, run again: python -m apps.llama.train " + " ".join(args))

    proc = _train(args)   # the command that line gave
    assert_resumed(dump, proc.stdout + proc.stderr, saved, rows)
    # ... and it ends where the same command run without a Ctrl-C ends, bit for bit.
    reference = dump.parent / "uninterrupted"
    _train(tiny_args(corpus, reference, steps=STEPS))
    assert_equivalent(dump, reference, rtol=0)


def _train(args: list) -> subprocess.CompletedProcess:
    # One thread, as the interrupted run (two thrash on 2 busy cores).
    proc = launcher.launch("apps.llama.train", args, 0, _python_env(), REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_step_line_shows_progress_and_time_left(interrupted_run):
    dump, _, stdout, _, rows = interrupted_run
    lines = [line for line in stdout.splitlines() if "train: step " in line]
    assert lines and all(f"/{STEPS} (" in line for line in lines), lines[:3]
    assert f"step 2/{STEPS} (1%)" in lines[1]
    # The first step's time is compilation and warm-up, not a pace: no ETA on its line.
    assert rows[0]["eta_s"] is None and "eta" not in lines[0]
    for row, line in zip(rows[1:], lines[1:]):
        assert row["eta_s"] > 0
        assert line.endswith(f"| eta {metrics.format_duration(row['eta_s'])}"), line


# A trainer whose checkpoint saves take seconds, so that a second Ctrl-C lands while it stops.
SLOW_SAVE = """
import sys, time
from lingua.launch import run
from lingua.train import loop
from apps.llama import train

save = loop.Run._save
def slow_save(self, *args, **kwargs):
    time.sleep(3600)   # a save that never ends within the test: only a stop at once passes
    return save(self, *args, **kwargs)
loop.Run._save = slow_save
run.exit_cli(lambda: train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_with_one_line(corpus, tmp_path):
    dump, out = tmp_path / "run", tmp_path / "out"
    proc = _start([sys.executable, "-c", SLOW_SAVE, *tiny_args(corpus, dump, steps=STEPS)], out)
    _wait_for(lambda: _rows_logged(dump) >= 2, proc, out, "2 logged steps")
    proc.send_signal(signal.SIGINT)
    _wait_for(lambda: "lingua: got Ctrl-C" in _output(out)[1], proc, out, "the first Ctrl-C's line")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = _finish(proc, out)   # waiting for the save would run into its timeout
    assert proc.returncode == INTERRUPTED, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    [line] = [line for line in stderr.splitlines() if "interrupted again" in line]
    assert "stopped at once without saving; no checkpoint saved yet" in line
    assert _checkpoints(dump) == []


@pytest.mark.slow
def test_ctrl_c_while_the_corpus_is_prepared_is_one_line_and_leaves_nothing(corpus, tmp_path):
    root, dump, out = tmp_path / "fresh" / "embedded", tmp_path / "run", tmp_path / "out"
    args = [f"data.root={root}", "data.prepare_embedded=true", f"dump_dir={dump}",
            "data.seq_len=64", "steps=2", *TINY_MODEL]
    proc = _start([sys.executable, "-m", "apps.llama.train", *args], out)
    _wait_for(lambda: "preparing the embedded corpus in" in _output(out)[0], proc, out,
              "the corpus preparation")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = _finish(proc, out)
    assert proc.returncode == INTERRUPTED, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    [line] = [line for line in stderr.splitlines() if "interrupted" in line]
    assert line.startswith("lingua: interrupted (Ctrl-C) outside the training loop")
    assert line.endswith("run again: python -m apps.llama.train " + " ".join(args))
    # Neither the corpus nor its temporary directory, nor the run directory.
    assert not root.exists() and not list(root.parent.glob(".*")) and not dump.exists()


@pytest.mark.slow
def test_the_quickstart_says_where_an_interrupted_run_is(corpus, tmp_path):
    """Ctrl-C in a terminal goes to the whole foreground process group: bash and python. The
    script goes on once python has saved and stopped, and says where the run is."""
    dump, out = tmp_path / "run", tmp_path / "out"
    args = tiny_args(corpus, dump, steps=STEPS)[1:]    # quickstart sets dump_dir from DUMP_DIR
    env = dict(_python_env(), DUMP_DIR=str(dump))
    proc = subprocess.Popen(["bash", "setup/quickstart.sh", *args], cwd=REPO, env=env,
                            stdout=open(out.with_suffix(".stdout"), "w"),
                            stderr=open(out.with_suffix(".stderr"), "w"), start_new_session=True,
                            preexec_fn=_terminal_sigint)
    _wait_for(lambda: _rows_logged(dump) >= 3, proc, out, "3 logged steps")
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = _finish(proc, out)
    assert proc.returncode == INTERRUPTED, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    [saved] = _checkpoints(dump)
    assert (f">> stopped before the end: run directory {dump}, newest checkpoint: "
            f"{dump}/checkpoints/{saved}") in stdout, stdout[-2000:]
    assert (f"run the same command again: DUMP_DIR={dump} bash {REPO}/setup/quickstart.sh "
            f"{args[0]}") in stdout
    # The trainer's line names the same command (not a relative `python -m ...` of its own).
    said = [line.split("run again: ", 1)[1] for line in (stdout + stderr).splitlines()
            if "run again: " in line]
    assert said and all(c.startswith(f"DUMP_DIR={dump} bash {REPO}/setup/quickstart.sh ")
                        for c in said), said


@pytest.mark.distributed
def test_ctrl_c_under_torchrun_saves_once_says_it_once_and_resumes(corpus, tmp_path):
    """Ctrl-C in a terminal reaches torchrun alone (its workers run in sessions of their own);
    torchrun sends each worker SIGINT. Both ranks save one checkpoint together; rank 0 says so."""
    dump, out = tmp_path / "run", tmp_path / "out"
    args = tiny_args(corpus, dump, "distributed.dp_shard=2", steps=STEPS)
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                   "-m", "apps.llama.train", *args], out)
    _wait_for(lambda: _rows_logged(dump) >= 3, proc, out, "3 logged steps")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = _finish(proc, out)
    log = stdout + stderr
    [saved] = _checkpoints(dump)
    assert log.count("lingua: got Ctrl-C") == 1, log
    assert log.count(f"interrupted (Ctrl-C) after step {saved}; checkpoint") == 1, log
    assert "to resume, run again: torchrun --nproc-per-node 2 -m apps.llama.train" in log
    # No rank prints a traceback. torchrun itself does, for the signal it got: that one is not
    # ours to remove (torch/distributed/elastic/multiprocessing/api.py raises SignalException).
    assert "KeyboardInterrupt" not in log and "]: Traceback" not in log, stderr
    assert stderr.count("Traceback") == stderr.count("SignalException: Process"), stderr

    rows = read_rows(dump)
    proc = run_torchrun(2, "apps.llama.train", args)
    assert_resumed(dump, proc.stdout + proc.stderr, saved, rows)
    assert read_rows(dump)[-1]["step"] == STEPS


# ------------------------------------------------------------------------------------------------
# 3. Errors under torchrun: printed once, and the failure torchrun reports


def _root_cause(stderr: str) -> str:
    """The `traceback :` line of the root cause in torchrun's ChildFailedError summary."""
    section = stderr.split("Root Cause (first observed failure):", 1)
    assert len(section) == 2, f"no torchrun failure summary:\n{stderr[-4000:]}"
    [line] = [line for line in section[1].splitlines() if line.strip().startswith("traceback :")]
    return line.split("traceback :", 1)[1].strip()


def _assert_reported_once(proc, message: str) -> None:
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    printed = [line for line in log.splitlines() if line.startswith("error: ")]
    assert printed == [f"error: {message}"], log[-4000:]      # once, not once per rank
    assert _root_cause(proc.stderr) == f"error: {message}"     # not "To enable traceback see"
    assert "To enable traceback" not in log, log[-4000:]
    # The one traceback is torchrun's own, ending in the summary; no rank printed one.
    assert log.count("Traceback") == log.count("errors.ChildFailedError:") == 1, log[-4000:]
    # The other rank points at it, if torchrun saw it fail too.
    assert log.count(message) == 2, log[-4000:]


@pytest.mark.distributed
def test_a_config_error_under_torchrun_is_printed_once_and_is_torchruns_root_cause(
        corpus, tmp_path):
    proc = run_torchrun(2, "apps.llama.train",
                        tiny_args(corpus, tmp_path / "run", "model.n_heads=3"), check=False,
                        fresh=True)   # torchrun's own store and failure summary
    _assert_reported_once(proc, "model.dim=64 is not divisible by model.n_heads=3: each head "
                                "gets dim / n_heads channels. Pick n_heads dividing dim (e.g. "
                                "dim=256 with n_heads=8), or set model.head_dim.")
    assert not (tmp_path / "run").exists()


@pytest.mark.distributed
def test_a_run_error_after_the_process_group_started_is_printed_once(corpus, tmp_path):
    """A damaged spikes.jsonl is found on every rank after the model is built (a RunError)."""
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "spikes.jsonl").write_text("garbage\n")
    proc = run_torchrun(2, "apps.llama.train", tiny_args(corpus, dump, "distributed.dp_shard=2"),
                        check=False, fresh=True)   # torchrun's own store and failure summary
    assert "model: " in proc.stdout   # it did get past the process group and the model
    _assert_reported_once(proc, f"{dump / 'spikes.jsonl'}, line 1 is not a rollback record "
                                f"('garbage'): each line is a JSON object with \"skip\": [first "
                                f"batch, last batch]. Repair or remove that line, then run the "
                                f"same command again.")


def test_ranks_with_another_message_still_print_theirs(tmp_path, monkeypatch, capsys):
    """errors.report through a real TCP store, as torchrun's agent serves it: the first rank
    prints and its error file holds the message; a rank with the same message stays quiet and
    points at the first; a rank with another message prints it."""
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True)   # serves while the test runs
    for key, value in {"WORLD_SIZE": "3", "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)

    def report(rank, message):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"{rank}.json"))
        errors.report(message)
        data = json.loads((tmp_path / f"{rank}.json").read_text())["message"]
        return capsys.readouterr().err, data["extraInfo"]["py_callstack"], \
            int(data["extraInfo"]["timestamp"])

    err1, file1, time1 = report(1, "error: A")
    err0, file0, time0 = report(0, "error: A")
    err2, file2, _ = report(2, "error: B")
    assert (err1, file1) == ("error: A\n", "error: A")
    assert err0 == "" and file0 == "the same error as rank 1 (its message is above)"
    assert time0 > time1   # torchrun takes the earliest as the root cause: rank 1's message
    assert (err2, file2) == ("error: B\n", "error: B")
    assert store.add("lingua/error/0/count", 0) == 3   # every rank went through the store


# ------------------------------------------------------------------------------------------------
# 12. Progress and ETA


def test_eta_is_the_recent_pace_without_the_first_step():
    assert [metrics.format_duration(s) for s in (0, 45, 59.6, 725, 3723, 180000)] == \
        ["0:00", "0:45", "1:00", "12:05", "1:02:03", "50:00:00"]
    window = metrics.Window()
    window.add(10.0, 0.0, 1, now=100.0)   # step 1 ends after 10 s of compilation
    assert window.eta_s(10) is None        # no pace yet
    for i in range(1, 4):                  # then 1 s a step, whatever happens in between
        window.add(0.9, 0.0, 1, now=100.0 + i)
        window.reset()                     # a logged step resets the window, not the pace
    assert window.eta_s(10) == pytest.approx(10.0)
    assert window.eta_s(0) == 0.0
    for i in range(4, 4 + metrics.Window.RECENT_STEPS):   # only the recent steps count
        window.add(1.9, 0.0, 1, now=100.0 + 3 + 2 * (i - 3))
    assert window.eta_s(10) == pytest.approx(20.0)


def test_the_step_line_reads_progress_first_and_eta_last():
    row = {"step": 120, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
           "mfu": 0.1, "data_s": 0.001, "peak_mem_gib": 0.5, "eta_s": 45.2}
    line = metrics.format_line(row, 200)
    assert line.startswith("step 120/200 (60%) | loss 2.5000") and line.endswith(" | eta 0:45")
    assert metrics.format_line(dict(row, eta_s=None), 200).endswith("mem 0.50GiB")
    assert metrics.format_line(row).startswith("step 120 | loss")   # no total known


@pytest.mark.slow
def test_setup_test_sh_leaves_slurm_alone_with_lingua_no_slurm():
    env = dict(os.environ, LINGUA_NO_SLURM="1", LINGUA_TEST_WORKERS="1")
    env.pop("LINGUA_REQUIRE_SLURM", None)
    proc = subprocess.run(["bash", "setup/test.sh", "-q", "-p", "no:cacheprovider",
                           "tests/test_layering.py", "-k", "finds_an_upward"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ">> LINGUA_NO_SLURM=1: the local Slurm is not started" in proc.stdout
    assert "slurm_local" not in proc.stdout + proc.stderr and "1 passed" in proc.stdout
