"""End-to-end single-process training: loss falls, metrics, checkpoints, exact resume, eval."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from apps.llama import train
from lingua import checkpoint
from lingua.errors import ConfigError
from lingua.observe import metrics
from tests.conftest import REPO, read_metrics, run_python, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "data_s", "peak_mem_gib"}


def test_loss_falls_and_every_step_is_logged(corpus, tmp_path, monkeypatch):
    dump = tmp_path / "run"
    # The CPU peak MFU is divided by is measured before the loop (metrics.jsonl not yet open),
    # never during it, so every row's MFU has the same denominator.
    measured_in_loop = []
    measure = metrics.measure_matmul_peak
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda *a, **k: measured_in_loop.append(
        (dump / "metrics.jsonl").exists()) or measure(*a, **k))
    assert train.main(tiny_args(corpus, dump, steps=30)) == 0
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert METRIC_KEYS <= set(rows[0])
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    assert measured_in_loop == [False] * metrics.PEAK_ROUNDS
    per_token_s = [r["mfu"] / r["tokens_per_s"] for r in rows]   # FLOPs per token / peak
    assert max(per_token_s) == pytest.approx(min(per_token_s), rel=1e-12, abs=0)
    peak = json.loads((dump / "peak.json").read_text())
    assert peak["source"] == "measured" and peak["flops_per_s"] == max(peak["rounds"])
    assert "val_loss" in rows[-1] and rows[-1]["val_ppl"] > 1
    assert (dump / "config.yaml").is_file()
    assert [p.name for p in checkpoint.list_complete(dump)] == ["30"]


def test_resume_is_bit_exact(corpus, tmp_path, capfd):
    dump = tmp_path / "run"
    args = tiny_args(corpus, dump, "checkpoint.every=3", "checkpoint.keep=0", steps=6)
    train.main(args)
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(dump, uninterrupted)
    first = read_rows(dump)
    # Pretend the run died after step 3's checkpoint, then start the same command again.
    shutil.rmtree(dump / "checkpoints" / "6")
    capfd.readouterr()
    train.main(args)
    assert_resumed(dump, "".join(capfd.readouterr()), 3, first)
    assert_equivalent(dump, uninterrupted, rtol=0)  # bit-identical, final weights included


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_losses(corpus, tmp_path):
    """kill -9 mid-run, run the same command again: it resumes from the newest checkpoint and
    ends as an uninterrupted run does."""
    steps = 60
    reference = tmp_path / "reference"
    train.main(tiny_args(corpus, reference, steps=steps))
    dump = tmp_path / "killed"
    args = tiny_args(corpus, dump, "checkpoint.every=5", "checkpoint.keep=2", steps=steps)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "apps.llama.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hang_guard = time.time() + 900  # ends a hung run; no speed check (a loaded CI is slower)
    try:
        while checkpoint.newest(dump) is None or int(checkpoint.newest(dump).name) < 10:
            assert proc.poll() is None, "run ended before it could be killed"
            assert time.time() < hang_guard, "no checkpoint of step 10 after 900 s: hung?"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = int(checkpoint.newest(dump).name)
    assert killed_at < steps
    first = read_rows(dump)
    resumed = run_python("apps.llama.train", args)
    assert_resumed(dump, resumed.stdout + resumed.stderr, killed_at, first)
    assert_equivalent(dump, reference, rtol=0)


@pytest.mark.slow
def test_resume_after_a_crash_mid_write_takes_the_last_complete_checkpoint(corpus, tmp_path):
    dump = tmp_path / "run"
    args = tiny_args(corpus, dump, "checkpoint.every=2", "checkpoint.keep=0", steps=6)
    train.main(args)
    reference = tmp_path / "reference"
    shutil.copytree(dump, reference)
    # The run died while writing step 6's checkpoint: the writer leaves a tmp dir; a step dir
    # without DCP metadata (a half-copied one, say) is not complete either.
    shutil.rmtree(dump / "checkpoints" / "6")
    (dump / "checkpoints" / "6.tmp-dead").mkdir()
    (dump / "checkpoints" / "6.tmp-dead" / "__0_0.distcp").write_bytes(b"partial")
    (dump / "checkpoints" / "8").mkdir()
    (dump / "checkpoints" / "8" / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint.newest(dump).name == "4"
    first = read_rows(dump)
    proc = run_python("apps.llama.train", args)
    assert_resumed(dump, proc.stdout + proc.stderr, 4, first)
    assert_equivalent(dump, reference, rtol=0)


def test_evaluation_keeps_its_own_cadence_whatever_logging_every_is(corpus, tmp_path, capfd):
    dump = tmp_path / "run"
    train.main(tiny_args(corpus, dump, "eval.every=5", "logging.every=3", steps=10))
    rows = read_metrics(dump)
    # Logged steps 3, 6, 9, the end; evaluation steps 5 and 10 write their row too.
    assert [r["step"] for r in rows] == [3, 5, 6, 9, 10]
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 10]
    assert all(r["val_loss"] == r["val_loss"] for r in rows if "val_loss" in r)   # not NaN
    # data.val_sequences=0: no validation, said once; no val_loss NaN in any row.
    quiet = tmp_path / "no_val"
    capfd.readouterr()
    train.main(tiny_args(corpus, quiet, "data.val_sequences=0", "eval.every=1", steps=2))
    assert [r["step"] for r in read_metrics(quiet) if "val_loss" in r] == []
    assert "".join(capfd.readouterr()).count("no validation loss: data.val_sequences=0") == 1


def test_keep_prunes_old_checkpoints(corpus, tmp_path):
    dump = tmp_path / "run"
    train.main(tiny_args(corpus, dump, "checkpoint.every=1", "checkpoint.keep=2", steps=4))
    assert [p.name for p in checkpoint.list_complete(dump)] == ["3", "4"]


def test_dump_dir_of_another_model_is_refused_and_left_untouched(corpus, tmp_path):
    dump = tmp_path / "run"
    train.main(tiny_args(corpus, dump, steps=2))
    before = {p: p.stat().st_mtime_ns for p in dump.rglob("*")}
    with pytest.raises(ConfigError, match="model.dim: checkpoint 64 vs now 32"):
        train.main(tiny_args(corpus, dump, "model.dim=32", steps=4))
    with pytest.raises(ConfigError, match="data.seq_len: checkpoint 64 vs now 32"):
        train.main(tiny_args(corpus, dump, "data.seq_len=32", steps=4))
    assert {p: p.stat().st_mtime_ns for p in dump.rglob("*")} == before


def test_a_dump_dir_of_other_files_is_refused_before_any_write(corpus, tmp_path):
    theirs = tmp_path / "theirs"
    (theirs / "src").mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"not a run's \(notes.txt, src\).*new or empty"):
        train.main(tiny_args(corpus, theirs, steps=1))
    assert sorted(p.name for p in theirs.rglob("*")) == ["notes.txt", "src"]
    (theirs / "notes.txt").unlink()
    (theirs / "src").rmdir()
    assert train.main(tiny_args(corpus, theirs, steps=1)) == 0   # empty: fine
    assert train.main(tiny_args(corpus, theirs, steps=2)) == 0   # a run of ours: resumed


def test_grad_accum_matches_a_larger_batch(corpus, tmp_path):
    big = tmp_path / "big"
    train.main(tiny_args(corpus, big, "data.batch_size=8", steps=3))
    accum = tmp_path / "accum"
    train.main(tiny_args(corpus, accum, "data.batch_size=4", "data.grad_accum=2", steps=3))
    assert_equivalent(accum, big)


def test_bf16_trains(corpus, tmp_path):
    dump = tmp_path / "bf16"
    train.main(tiny_args(corpus, dump, "distributed.model_dtype=bf16", steps=10))
    rows = read_metrics(dump)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_backends_without_a_cpu_training_kernel_are_refused_before_work(corpus, tmp_path):
    for backend in ("flex", "xformers"):
        dump = tmp_path / backend
        with pytest.raises(ConfigError, match=f"attn_backend={backend}"):
            train.main(tiny_args(corpus, dump, f"model.attn_backend={backend}", steps=3))
        assert not dump.exists()


def test_wandb_offline_run_and_no_secret_on_disk(corpus, tmp_path, monkeypatch):
    secret = "sk-test-0123456789abcdef-do-not-write"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    dump = tmp_path / "wb"
    train.main(tiny_args(corpus, dump, "logging.wandb=true", steps=3))
    runs = list((dump / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    for path in dump.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_init_from_a_hugging_face_directory_starts_from_its_weights(corpus, tmp_path):
    from lingua import data
    from lingua.model.loss import token_loss_sum
    from lingua.models.llama.hf import export, load_hf

    first = tmp_path / "first"
    train.main(tiny_args(corpus, first, steps=3))
    hf_dir = tmp_path / "hf"
    export(str(first / "checkpoints" / "3"), str(hf_dir))
    tuned = tmp_path / "tuned"
    args = tiny_args(corpus, tuned, f"checkpoint.init_from={hf_dir}", steps=1)
    train.main(args)
    # Independent reference: the exported model's loss on the run's first global batch.
    model, _ = load_hf(str(hf_dir))
    cfg = train.config.load("llama", train.TrainArgs, args)
    (batch,) = data.build_train_loader(cfg.data, 0, 1, cfg.seed).next_step()
    want = (token_loss_sum(model(batch.tokens), batch.labels).item()
            / batch.labels.numel())
    assert read_metrics(tuned)[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert want < read_metrics(first)[0]["loss"] - 0.5  # it did start from trained weights


@pytest.mark.parametrize("ac", ["full", "layer", "op"])
def test_activation_checkpointing_gives_the_same_losses(corpus, tmp_path, ac):
    plain = tmp_path / "plain"
    train.main(tiny_args(corpus, plain, steps=3))
    dump = tmp_path / ac
    train.main(tiny_args(corpus, dump, f"distributed.ac={ac}", "distributed.ac_every=2", steps=3))
    # Checkpoints keep plain parameter names (the final weights are compared by name).
    assert_equivalent(dump, plain)


@pytest.mark.slow
def test_compiled_blocks_and_loss_give_the_same_losses(corpus, tmp_path, monkeypatch):
    from lingua.model import loss as loss_module

    plain = tmp_path / "plain"
    train.main(tiny_args(corpus, plain, steps=2))
    made, calls = [], []   # the loss the compiled run trains with, and its calls
    real = loss_module.for_training

    def for_training(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return lambda *a: calls.append(1) or made[-1](*a)

    monkeypatch.setattr(loss_module, "for_training", for_training)
    dump = tmp_path / "compiled"
    train.main(tiny_args(corpus, dump, "distributed.compile=true", steps=2))
    assert len(made) == 1 and made[0] is not train.APP.loss   # compiled, not the app's own
    assert len(calls) == 2                                     # and what each step's loss came from
    assert_equivalent(dump, plain)


def test_apply_ac_wraps_the_chosen_blocks_and_keeps_parameter_names():
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from lingua.models.llama.model import LlamaArgs, Transformer
    from lingua.parallel.distributed import apply_ac

    model = Transformer(LlamaArgs(dim=32, n_layers=4, n_heads=4, multiple_of=16, max_seq_len=16))
    names = list(model.state_dict())
    apply_ac(model.layers, "layer", every=2)
    assert ([isinstance(b, CheckpointWrapper) for b in model.layers.values()]
            == [True, False, True, False])
    assert list(model.state_dict()) == names
    model(torch.randint(0, 258, (1, 8))).sum().backward()


def test_full_collection_frees_a_cycle_that_young_collections_keep():
    """Automatic GC is off in a run; gc.collect(1) alone never frees a cycle that reached the
    oldest generation, so every gc_full_every steps the trainer collects all generations."""
    import gc
    import weakref

    from lingua.launch.host_memory import collect_garbage

    class Node:
        pass

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        node = Node()
        node.me = node
        alive = weakref.ref(node)
        gc.collect(1)  # it survives (still referenced) and moves to the oldest generation
        del node       # now garbage, but only reachable by a full collection
        assert collect_garbage(50, young_every=50, full_every=1000) == 1
        assert alive() is not None
        assert collect_garbage(51, young_every=50, full_every=1000) is None
        assert collect_garbage(1000, young_every=50, full_every=1000) == 2
        assert alive() is None
        assert collect_garbage(1000, young_every=0, full_every=0) is None
    finally:
        if was_enabled:
            gc.enable()


def test_an_in_process_run_gives_automatic_gc_back(corpus, tmp_path, monkeypatch):
    """The loop turns automatic GC off (collect_garbage runs it at fixed steps); main() called
    in-process (tests, notebooks) must leave the collector as it found it, also after a crash."""
    import gc

    from lingua.train import loop

    seen = []
    original = loop.Run.train_step

    def train_step(self, micro_batches):
        seen.append(gc.isenabled())
        if self.args.dump_dir.endswith("crash"):
            raise RuntimeError("a step that fails")
        return original(self, micro_batches)

    monkeypatch.setattr(loop.Run, "train_step", train_step)
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        assert train.main(tiny_args(corpus, tmp_path / "run", steps=2)) == 0
        assert seen == [False, False]  # off inside the loop
        assert gc.isenabled()
        with pytest.raises(RuntimeError, match="a step that fails"):
            train.main(tiny_args(corpus, tmp_path / "crash", steps=2))
        assert seen == [False, False, False]
        assert gc.isenabled()
        gc.disable()  # a caller that had it off keeps it off
        assert train.main(tiny_args(corpus, tmp_path / "off", steps=1)) == 0
        assert not gc.isenabled()
    finally:
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
