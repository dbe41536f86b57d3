"""Loss spikes (spikes.policy=off|log|skip|rollback, lingua/optim/spikes.py): a spike is injected
into a chosen data batch (its loss, and so its gradients, multiplied: tests/workers/spike_train.py)
and each policy is checked against a run that reaches the same outcome another way:
  off and log apply the update (the same weights as each other), skip equals
  optim.nonfinite=skip on a NaN at the same steps, rollback equals a run told from the start to
  skip the same data batches; every layout decides as one process does (tests/equivalence.py),
  and a resumed run as the uninterrupted one.
"""

import json
import math
import shutil

import pytest
import torch

from apps.llama import train
from lingua.errors import ConfigError, RunError
from lingua.optim import spikes
from lingua.optim.spikes import SpikeArgs, SpikeMonitor
from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import (
    assert_equivalent,
    assert_resumed,
    assert_same_checksums,
    assert_same_rows,
    final_checkpoint,
    model_checksums,
    read_rows,
)
from tests.workers.spike_train import (
    MUTATION_VAR,
    RANKS_VAR,
    ROWS_VAR,
    SPIKES_VAR,
    inject,
    spikes_env,
)

STEPS = 12
SKIP_SPIKES = {8: 10.0, 10: 10.0}   # data batch -> loss factor
ROLLBACK_SPIKES = {8: 10.0}
COUNTS = ("spike_steps", "spike_skipped_steps", "rollbacks", "skipped_batches")


def spike_args(corpus, dump, policy, *extra):
    return tiny_args(corpus, dump, f"spikes.policy={policy}", "spikes.window=5", *extra,
                     steps=STEPS)


def skip_args(corpus, dump, *extra):
    return spike_args(corpus, dump, "skip", "checkpoint.every=4", "checkpoint.keep=0", *extra)


def rollback_args(corpus, dump, *extra):
    return spike_args(corpus, dump, "rollback", "checkpoint.every=3", "checkpoint.keep=0",
                      "spikes.skip_before=1", "spikes.skip_after=1", *extra)


def train_with_spikes(args, batches: dict, rows=None) -> None:
    with pytest.MonkeyPatch.context() as patch:
        inject(patch.setattr, batches, rows=rows)
        train.main(args)


def rows_by_step(dump) -> dict:
    return {row["step"]: row for row in read_rows(dump)}


def probe_steps(dump) -> list:
    path = dump / "probe" / "probe.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def skip_run(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("skip") / "run"
    train_with_spikes(skip_args(corpus, dump), SKIP_SPIKES)
    return dump


@pytest.fixture(scope="module")
def rollback_run(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("rollback") / "run"
    train_with_spikes(rollback_args(corpus, dump), ROLLBACK_SPIKES)
    return dump


# The first half of the global batch of 8 sequences: what data-parallel rank 0 of 2 reads.
HALF = 4


@pytest.fixture(scope="module")
def half_runs(corpus, tmp_path_factory):
    """One-process skip and rollback runs whose spikes are in the first half of the batch only."""
    root = tmp_path_factory.mktemp("half")
    train_with_spikes(skip_args(corpus, root / "skip"), SKIP_SPIKES, rows=HALF)
    train_with_spikes(rollback_args(corpus, root / "rollback"), ROLLBACK_SPIKES, rows=HALF)
    return {"skip": root / "skip", "rollback": root / "rollback"}


# -- the rules ------------------------------------------------------------------------------------

def monitor(**kw) -> SpikeMonitor:
    return SpikeMonitor(SpikeArgs(**{"policy": "skip", "window": 4, **kw}), verbose=False)


def feed(m: SpikeMonitor, values, name="loss") -> None:
    for step, value in enumerate(values, 1):
        assert m.check(step, {"loss": value, "grad_norm": value}) is None
        m.accept({"loss": value, "grad_norm": value})


def test_median_rule_waits_for_a_full_window_and_keeps_skipped_values_out():
    m = monitor()
    feed(m, [4.0, 4.4, 3.8])
    assert m.check(4, {"loss": 1e6}) is None          # 3 values: no decision yet
    m.accept({"loss": 4.2})                            # median 4.1 -> threshold 8.2
    assert m.check(5, {"loss": 8.1}) is None
    spike = m.check(5, {"loss": 8.3})
    assert (spike.on, spike.value, spike.threshold) == ("loss", 8.3, pytest.approx(8.2))
    m.skipped(spike)
    assert list(m.windows["loss"]) == [4.0, 4.4, 3.8, 4.2]   # not added
    assert (m.spike_steps, m.skipped_steps, m.in_a_row) == (1, 1, 1)
    assert m.check(6, {"loss": math.nan}) is not None        # a non-finite loss is a spike
    assert monitor(warmup=10).check(5, {"loss": 1e9}) is None


def test_sigma_rule_and_both_values():
    m = monitor(rule="sigma", sigmas=2.0, on="both")
    feed(m, [1.0, 2.0, 3.0, 4.0])                      # mean 2.5, stdev 1.291: threshold 5.082
    assert m.check(5, {"loss": 5.0, "grad_norm": 5.0}) is None
    spike = m.check(5, {"loss": 5.0, "grad_norm": 5.1})
    assert spike.on == "grad_norm" and spike.threshold == pytest.approx(2.5 + 2 * 1.2909944)


def test_caps_stop_a_spike_that_does_not_go_away():
    m = monitor(max_skips=2)
    feed(m, [1.0] * 4)
    for step in (5, 6):
        m.skipped(m.check(step, {"loss": 9.0}))
    with pytest.raises(RunError, match=r"Steps 5\.\.7: 3 spike steps in a row.*spikes.policy=log"):
        m.skipped(m.check(7, {"loss": 9.0}))
    m = monitor(max_rollbacks=1)
    feed(m, [1.0] * 4)
    record = m.record_rollback(m.check(5, {"loss": 9.0}), batch=5, checkpoint_step=3,
                               checkpoint_dir="ckpt/3")
    assert record["skip"] == [5, 5] and m.skips_batch(5) is record and m.skips_batch(6) is None
    with pytest.raises(RunError, match=r"after 1 rollbacks to checkpoint ckpt/3"):
        m.record_rollback(m.check(5, {"loss": 9.0}), batch=6, checkpoint_step=3,
                          checkpoint_dir="ckpt/3")


def test_state_survives_a_weights_only_checkpoint(tmp_path):
    m = monitor(on="both")
    feed(m, [1.0, 2.0, 3.0, 4.0, 5.0])
    m.record_rollback(m.check(6, {"loss": 99.0, "grad_norm": 1.0}), 9, 3, "ckpt/3")
    torch.save({"spikes": m.state_dict()}, tmp_path / "state.pt")
    again = monitor(on="both", window=3)   # a shorter window keeps the newest
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True)["spikes"])
    assert list(again.windows["loss"]) == [3.0, 4.0, 5.0] and again.rollbacks == m.rollbacks


@pytest.mark.parametrize("override, message", [
    ("spikes.policy=sometimes", r"spikes.policy='sometimes' is unknown: use one of off \| log"),
    ("spikes.rule=mean", r"spikes.rule='mean' is unknown"),
    ("spikes.on=weights", r"spikes.on='weights' is unknown"),
    ("spikes.factor=1.0", r"spikes.factor=1.0 must be above 1"),
    ("spikes.window=1", r"spikes.window=1 must be at least 2"),
    ("logging.spike_factor=3", r"logging.spike_factor was moved to spikes.factor.*"
                               r"Write spikes.factor=\.\.\. instead"),
    ("logging.spike_window=20", r"logging.spike_window was moved to spikes.window"),
    ("optim.spike_window=20", r"optim.spike_window was moved to spikes.window"),
    ("spikes.policy=rollback", r"checkpoint.every=0 none is saved.*checkpoint.every=N"),
])
def test_bad_spike_settings_are_refused(corpus, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        train.load_config(tiny_args(corpus, tmp_path / "run", override))


def test_the_contracts_optim_spike_still_sets_the_policy(corpus, tmp_path):
    args = train.load_config(tiny_args(corpus, tmp_path / "run", "optim.spike=skip"))
    assert args.spikes.policy == "skip"


def test_an_older_runs_config_reads_its_spike_keys_under_the_new_names(corpus, tmp_path):
    """A run directory from before the spikes section (optim.spike*, logging.spike_* null)
    still evaluates: lingua.config.migrate reads its keys under their new names."""
    from omegaconf import OmegaConf

    from lingua import config
    from lingua.eval import eval_cli

    saved = OmegaConf.create(config.to_dict(train.load_config(tiny_args(corpus, tmp_path / "r"))))
    saved.pop("spikes")
    saved.optim.spike, saved.optim.spike_window, saved.logging.spike_factor = "skip", 7, None
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    OmegaConf.save(saved, ckpt / "config.yaml")
    loaded = eval_cli.run_config(train.TrainArgs, ckpt, [])
    assert (loaded.spikes.policy, loaded.spikes.window, loaded.spikes.factor) == ("skip", 7, 2.0)


# -- each policy in one process ------------------------------------------------------------------

@pytest.mark.slow
def test_log_warns_and_marks_off_does_nothing_both_apply_the_update(corpus, tmp_path, capfd):
    """log: a warning, loss_spike at the spike's step and the next step probed in full beside
    the regular probe steps (probe.every=4), which lingua.observe.probe's plot draws; off: no spike
    keys. Both apply the spike's update: the same losses and weights."""
    log, off = tmp_path / "log", tmp_path / "off"
    train_with_spikes(spike_args(corpus, log, "log", "probe.every=4"), {8: 10.0})
    train_with_spikes(spike_args(corpus, off, "off"), {8: 10.0})
    out = "".join(capfd.readouterr())
    rows = rows_by_step(log)
    assert [s for s, r in rows.items() if r["loss_spike"]] == [8]
    assert [rows[s]["spike_steps"] for s in (7, 8, 12)] == [0, 1, 1]
    assert rows[8]["spike_skipped_steps"] == 0 and rows[8]["rollbacks"] == 0
    assert "loss spike at step 8" in out and "the update was applied (spikes.policy=log)" in out
    assert "loss_spike" not in rows_by_step(off)[8]
    assert_equivalent(log, off, rtol=0)
    assert probe_steps(log) == [4, 8, 9, 12]
    from lingua.observe.probe_report import plot

    assert plot(log)   # irregular probe steps draw


def test_skip_drops_the_update_as_nonfinite_skip_does(corpus, tmp_path, skip_run):
    """With probe.every=0 the step after each spike is probed all the same."""
    nan = tmp_path / "nan"
    train_with_spikes(tiny_args(corpus, nan, "spikes.policy=off", "optim.nonfinite=skip",
                                steps=STEPS), {b: math.nan for b in SKIP_SPIKES})
    rows = rows_by_step(skip_run)
    assert [rows[s]["spike_skipped_steps"] for s in range(6, 13)] == [0, 0, 1, 1, 2, 2, 2]
    assert [s for s, r in rows.items() if r["loss_spike"]] == [8, 10]
    assert rows[8]["loss"] > 5 * rows[7]["loss"]
    same = [r for s, r in rows.items() if s not in SKIP_SPIKES]
    assert_same_rows(same, [r for r in read_rows(nan) if r["step"] not in SKIP_SPIKES], rtol=0)
    assert_same_checksums(model_checksums(final_checkpoint(skip_run, STEPS)),
                          model_checksums(final_checkpoint(nan, STEPS)), rtol=0)
    assert probe_steps(skip_run) == [9, 11]


def test_resume_carries_the_windows_and_counts(corpus, tmp_path, skip_run, capfd):
    """Resumed at step 8 (after the first spike), the second spike (step 10) is found only if the
    window came back with the checkpoint: a fresh one would not be full yet."""
    dump = tmp_path / "resumed"
    shutil.copytree(skip_run, dump)
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / "12")
    capfd.readouterr()
    train_with_spikes(skip_args(corpus, dump), SKIP_SPIKES)
    assert_resumed(dump, "".join(capfd.readouterr()), 8, first)
    assert_equivalent(dump, skip_run, rtol=0, keys=("loss", "grad_norm", "loss_spike") + COUNTS)
    assert probe_steps(dump) == probe_steps(skip_run) == [9, 11]   # step 9 too, after resuming


def test_rollback_reloads_and_skips_the_batches_around_the_spike(corpus, tmp_path, rollback_run):
    """Spike on batch 8 at step 8: back to checkpoint 6, batches 7..9 skipped, so steps 7..12
    train on batches 10..15, as a run told from the start to skip 7..9 does. The spiking batch
    was re-run with the probe on (probe.every=0) and recorded as step 8."""
    records = spikes.read_records(rollback_run)
    assert len(records) == 1, records
    record = records[0]
    assert {k: record[k] for k in ("step", "on", "batch", "checkpoint", "skip", "rule")} == {
        "step": 8, "on": "loss", "batch": 8, "checkpoint": 6, "skip": [7, 9], "rule": "median"}
    assert (record["value"] > record["threshold"]
            and record["checkpoint_dir"].endswith("checkpoints/6"))
    rows = rows_by_step(rollback_run)
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert [rows[s]["rollbacks"] for s in (6, 7, 12)] == [0, 1, 1]
    assert [rows[s]["skipped_batches"] for s in (6, 7, 12)] == [0, 3, 3]
    assert [s for s, r in rows.items() if r["loss_spike"]] == [7]   # the first row after it
    assert probe_steps(rollback_run) == [8]

    told = tmp_path / "told"
    told.mkdir()
    (told / spikes.RECORDS).write_text(json.dumps({"skip": [7, 9]}) + "\n")
    train_with_spikes(rollback_args(corpus, told), ROLLBACK_SPIKES)
    # (`rollbacks` counts real ones: the hand-written range is none)
    assert_equivalent(rollback_run, told, rtol=0, keys=("loss", "grad_norm", "spike_steps",
                                                        "spike_skipped_steps", "skipped_batches"))
    assert rows_by_step(told)[12]["rollbacks"] == 0


def test_rollback_with_no_checkpoint_before_the_spike_skips_it(corpus, tmp_path, skip_run):
    """The loop finds no checkpoint to go back to (Run.roll_back): each spike's update is skipped
    and the next step probed, as spikes.policy=skip does; nothing is recorded."""
    dump = tmp_path / "no_checkpoint"
    train_with_spikes(spike_args(corpus, dump, "rollback", "checkpoint.every=50"), SKIP_SPIKES)
    assert spikes.read_records(dump) == []
    assert_equivalent(dump, skip_run, rtol=0, keys=("loss", "grad_norm", "loss_spike") + COUNTS)
    assert probe_steps(dump) == [9, 11]


def test_a_crash_after_a_rollback_resumes_with_the_range_applied(corpus, tmp_path, rollback_run,
                                                                   capfd):
    """Checkpoints after the rollback lost: the run resumes from the one before the spike, whose
    train state knows nothing of the range; spikes.jsonl does."""
    dump = tmp_path / "crashed"
    shutil.copytree(rollback_run, dump)
    first = read_rows(dump)
    for step in (9, 12):
        shutil.rmtree(dump / "checkpoints" / str(step))
    capfd.readouterr()
    train_with_spikes(rollback_args(corpus, dump), ROLLBACK_SPIKES)
    assert_resumed(dump, "".join(capfd.readouterr()), 6, first)
    assert_equivalent(dump, rollback_run, rtol=0, keys=("loss", "grad_norm") + COUNTS)
    assert len(spikes.read_records(dump)) == 1   # no second rollback: batch 8 stayed skipped


# -- every layout decides as one process does ----------------------------------------------------

LAYOUTS = {"dp_shard=2": ["distributed.dp_shard=2", "data.batch_size=4"],
           "pp=2": ["distributed.pp=2", "distributed.dp_shard=1"],
           "tp=2": ["distributed.tp=2", "distributed.dp_shard=1"]}
# A rank that judged its own loss would hang or part ways with the others: fail fast.
TIMEOUT = "distributed.timeout_s=60"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_every_rank_takes_the_one_process_decision(corpus, tmp_path, monkeypatch, layout, policy,
                                                   skip_run, rollback_run, half_runs):
    """Under dp_shard=2 the spike is in rank 0's half of the batch only (rank 1's own loss does
    not move): only the reduced loss of the global batch decides as one process does."""
    dump = tmp_path / "run"
    make_args, batches = {"skip": (skip_args, SKIP_SPIKES),
                          "rollback": (rollback_args, ROLLBACK_SPIKES)}[policy]
    monkeypatch.setenv(SPIKES_VAR, spikes_env(batches))
    if layout == "dp_shard=2":
        monkeypatch.setenv(ROWS_VAR, str(HALF))
        monkeypatch.setenv(RANKS_VAR, "0")
        reference = half_runs[policy]
    else:
        reference = {"skip": skip_run, "rollback": rollback_run}[policy]
    run_torchrun(2, "tests.workers.spike_train", make_args(corpus, dump, *LAYOUTS[layout], TIMEOUT))
    assert_equivalent(dump, reference, keys=("loss", "grad_norm", "loss_spike") + COUNTS)
    rows = rows_by_step(dump)
    assert sum(r["spike_skipped_steps" if policy == "skip" else "rollbacks"] > 0
               for r in rows.values()) > 0   # the spike was found, not missed by both
    assert probe_steps(dump) == probe_steps(reference)
    if policy == "rollback":
        keys = ("step", "batch", "checkpoint", "skip")
        assert [{k: r[k] for k in keys} for r in spikes.read_records(dump)] == \
               [{k: r[k] for k in keys} for r in spikes.read_records(reference)]


@pytest.mark.distributed
def test_a_rank_that_decides_alone_is_caught(corpus, tmp_path, monkeypatch, skip_run):
    """The check above can fail: rank 1 applies the spike's update that rank 0 skips."""
    dump = tmp_path / "alone"
    monkeypatch.setenv(SPIKES_VAR, spikes_env(SKIP_SPIKES))
    monkeypatch.setenv(MUTATION_VAR, "rank1_decides_alone")
    run_torchrun(2, "tests.workers.spike_train", skip_args(corpus, dump, *LAYOUTS["dp_shard=2"],
                                                           TIMEOUT))
    with pytest.raises(AssertionError):
        assert_equivalent(dump, skip_run, keys=("loss", "grad_norm") + COUNTS)
