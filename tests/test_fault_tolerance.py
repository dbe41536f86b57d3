"""Replica groups with torchft (lingua/parallel/fault_tolerance.py), on CPU with gloo: real
torchft, a real lighthouse in this process, each group its own launch, started together.

With no failure, the groups together equal one process on the same global batch (4 sequences):
each group logs the loss of its own part, so the groups' mean loss is compared with the
reference's, each group's gradient norm (global: the gradients are summed across groups before
the norm) and each group's final parameters (tests/equivalence.py).
"""

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from apps.llama import train
from lingua.errors import ConfigError
from tests.conftest import REPO, run_python, run_torchrun, tiny_args
from tests.equivalence import (
    assert_same_checksums,
    assert_same_rows,
    final_checkpoint,
    model_checksums,
    read_rows,
)

STEPS = 3
NO_VAL = ["eval.at_end=false"]   # each group would validate on its own part only


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("reference") / "run"
    train.main(tiny_args(corpus, dump, "data.batch_size=4", *NO_VAL, steps=STEPS))
    return dump


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer

    # min_replicas=2: the first quorum waits for both groups, as the reference has both parts.
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10000,
                              quorum_tick_ms=50)
    yield server.address()
    server.shutdown()


def ft_args(lighthouse, group_id):
    return ["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2",
            f"fault_tolerance.group_id={group_id}", f"fault_tolerance.lighthouse={lighthouse}",
            "fault_tolerance.min_replicas=2", "fault_tolerance.quorum_timeout_s=60"]


def run_groups(launch, corpus, tmp_path, lighthouse, extra, outputs=None) -> list:
    """Both groups at once (each blocks in its quorum until the other joins); their dump dirs.
    outputs: a dict given gets each group's output."""
    dumps, errors = [tmp_path / f"group{g}" for g in range(2)], []
    outputs = {} if outputs is None else outputs

    def one(g):
        try:
            proc = launch(tiny_args(corpus, dumps[g], *extra, *NO_VAL, *ft_args(lighthouse, g),
                                    steps=STEPS))
            outputs[g] = proc.stdout + proc.stderr
        except Exception as err:   # re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(g,)) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return dumps


def assert_groups_equal_one_process(dumps, reference) -> None:
    rows = [read_rows(d) for d in dumps]
    want = read_rows(reference)
    for group_rows in rows:   # the norm is of the summed gradient: the same in every group
        assert_same_rows(group_rows, want, keys=("grad_norm",), what="group")
    mean = [dict(a, loss=(a["loss"] + b["loss"]) / 2) for a, b in zip(*rows)]
    assert_same_rows(mean, want, keys=("loss",), what="groups' mean")
    for d in dumps:
        assert_same_checksums(model_checksums(final_checkpoint(d, STEPS)),
                              model_checksums(final_checkpoint(reference, STEPS)), what="group")


@pytest.mark.distributed
def test_two_groups_of_one_rank_equal_one_process_and_restart_exactly(corpus, tmp_path,
                                                                      reference, lighthouse):
    """Then both groups are started again from their checkpoint of step 2 (the last one
    removed, as if they had stopped after step 2): the same result."""
    launch = functools.partial(run_groups, lambda a: run_python("apps.llama.train", a,
                                                                timeout=120),
                               corpus, tmp_path, lighthouse, ["data.batch_size=2",
                                                              "checkpoint.every=2"])
    dumps = launch()
    assert_groups_equal_one_process(dumps, reference)
    for d in dumps:
        shutil.rmtree(d / "checkpoints" / str(STEPS))
    outputs = {}
    launch(outputs=outputs)
    assert all("resumed from" in outputs[g] and "(step 2)" in outputs[g] for g in range(2))
    assert_groups_equal_one_process(dumps, reference)


@pytest.mark.distributed
def test_the_local_recipe_two_fsdp_groups_of_two_ranks_equal_one_process(corpus, tmp_path,
                                                                         reference):
    """docs/parallelism.md's local recipe as written: the `torchft_lighthouse` command, then a
    real `torchrun` per group (FSDP over its 2 ranks)."""
    from tests.conftest import free_port

    port = free_port()
    command = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    server = subprocess.Popen([command, "--min_replicas", "2", "--quorum_tick_ms", "100",
                               "--join_timeout_ms", "10000", "--bind", f"127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        dumps = run_groups(lambda a: run_torchrun(2, "apps.llama.train", a, timeout=120,
                                                  fresh=True),
                           corpus, tmp_path, f"http://127.0.0.1:{port}",
                           ["data.batch_size=1", "distributed.dp_shard=2"])
    finally:
        server.kill()
        server.wait()
    assert_groups_equal_one_process(dumps, reference)


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("jsonl_corpus")
    (root / "val").mkdir()
    for path, n in ((root / "0.jsonl", 120), (root / "val" / "0.jsonl", 8)):
        path.write_text("".join(json.dumps({"text": f"Document {i}. " + " ".join(
            f"w{(i * 7 + j) % 50}" for j in range(30))}) + "\n" for i in range(n)))
    return root


@pytest.mark.distributed
def test_a_group_behind_heals_and_reads_its_own_jsonl_stream_forward(jsonl_corpus, tmp_path,
                                                                     lighthouse):
    """jsonl: each data rank's stream position is its own, so a healing group cannot take its
    peer's. Both groups equal the reference; started again from different checkpoints (group 0
    from step 2, group 1 from step 1), group 1 heals from group 0 at its first quorum, reads its
    own stream one batch forward, and step 3 equals the reference's again. The reference is one
    job of 2 data ranks: jsonl's rank r reads lines r, r + dp, ..., so one process's batch of 4
    is packed from other lines."""
    reference = tmp_path / "reference"
    run_torchrun(2, "apps.llama.train", tiny_args(jsonl_corpus, reference, "data.format=jsonl",
                                                  "data.batch_size=2", "distributed.dp_shard=2",
                                                  *NO_VAL, steps=STEPS))
    launch = functools.partial(
        run_groups, lambda a: run_python("apps.llama.train", a, timeout=120), jsonl_corpus,
        tmp_path, lighthouse, ["data.format=jsonl", "data.batch_size=2", "checkpoint.every=1",
                               "checkpoint.keep=0"])
    dumps = launch()
    assert_groups_equal_one_process(dumps, reference)
    shutil.rmtree(dumps[0] / "checkpoints" / str(STEPS))
    for step in (2, 3):
        shutil.rmtree(dumps[1] / "checkpoints" / str(step))
    outputs = {}
    launch(outputs=outputs)
    assert "group 1 heals from a live group: step 2" in outputs[1], outputs[1][-3000:]
    rows, want = [read_rows(d) for d in dumps], read_rows(reference)
    assert [r["step"] for r in rows[1]] == [1, 3]   # step 2 was its peer's
    assert_same_rows(rows[0], want, keys=("grad_norm",), what="group 0")
    assert_same_rows(rows[1][1:], want[2:], keys=("grad_norm",), what="healed group 1")
    # Each group's loss is its own part's: the healed group read the batch it should have.
    mean = [dict(rows[0][2], loss=(rows[0][2]["loss"] + rows[1][1]["loss"]) / 2)]
    assert_same_rows(mean, want[2:], keys=("loss",), what="groups' mean at step 3")
    for d in dumps:
        assert_same_checksums(model_checksums(final_checkpoint(d, STEPS)),
                              model_checksums(final_checkpoint(reference, STEPS)), what="group")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_groups_on_two_gpus_over_nccl_equal_one_gpu(corpus, tmp_path, lighthouse):
    """torchft's ProcessGroupNCCL between the groups (one GPU each, CUDA_VISIBLE_DEVICES)
    against one GPU on the whole batch (GPU_RUNBOOK.md: two GPUs)."""
    reference = tmp_path / "reference"
    run_python("apps.llama.train", tiny_args(corpus, reference, "data.batch_size=4", *NO_VAL,
                                             steps=STEPS), fresh=True)

    def on_its_gpu(args):
        group = next(a for a in args if a.startswith("fault_tolerance.group_id=")).split("=")[1]
        proc = subprocess.run([sys.executable, "-m", "apps.llama.train", *args], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO),
                                       CUDA_VISIBLE_DEVICES=group),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc

    dumps = run_groups(on_its_gpu, corpus, tmp_path, lighthouse, ["data.batch_size=2"])
    assert_groups_equal_one_process(dumps, reference)


def test_an_unreachable_lighthouse_is_refused_at_start(corpus, tmp_path):
    from tests.conftest import free_port

    dump = tmp_path / "run"
    address = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    with pytest.raises(ConfigError, match="cannot be reached") as err:
        train.main(tiny_args(corpus, dump, "fault_tolerance.enabled=true",
                             f"fault_tolerance.lighthouse={address}", steps=1))
    assert address in str(err.value) and "torchft_lighthouse" in str(err.value)
    assert not dump.exists()


def test_the_layouts_fault_tolerance_cannot_take_are_refused(corpus, tmp_path):
    with pytest.raises(ConfigError) as err:
        train.main(tiny_args(corpus, tmp_path / "run", "fault_tolerance.enabled=true",
                             "fault_tolerance.lighthouse=http://127.0.0.1:1",
                             "fault_tolerance.replica_groups=2", "fault_tolerance.group_id=2",
                             "distributed.pp=2", "distributed.dp_replicate=2",
                             "spikes.policy=rollback", "checkpoint.every=1", steps=1))
    message = str(err.value)
    assert "group_id=2 must be in 0 .. replica_groups-1" in message
    assert "pipeline parallel across replica groups is not supported" in message
    assert "set fault_tolerance.replica_groups instead" in message
    assert "use spikes.policy=skip with fault_tolerance" in message


HEALING = "healing required"   # torchft's line, as a group starts fetching a peer's state
HEALED = "heals from a live group: step"   # FaultToleranceHook's, once the state is received
SAVE_EVERY = 5


def start_group(corpus, dump, lighthouse, group_id, log_name, steps=100_000) -> subprocess.Popen:
    """One group: a real torchrun of 2 ranks (FSDP), in a session of its own so that the test can
    kill it. Its steps are many: the test stops the run with SIGTERM once it has what it checks
    (so that the survivor never has to outlast a restart), then resumes it to a near end."""
    args = tiny_args(corpus, dump, "data.batch_size=1", "distributed.dp_shard=2", *NO_VAL,
                     *ft_args(lighthouse, group_id), "fault_tolerance.min_replicas=1",
                     "fault_tolerance.quorum_timeout_s=20", f"checkpoint.every={SAVE_EVERY}",
                     "checkpoint.keep=0", "logging.every=1", steps=steps)
    from tests.conftest import free_port

    log = open(dump.parent / log_name, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "apps.llama.train",
         *args], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
        stdout=log, stderr=log, start_new_session=True)


def steps_logged(dump) -> list:
    path = dump / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] \
        if path.is_file() else []


def workers(proc) -> list:
    """The torchrun's rank processes (its children)."""
    path = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    return [int(pid) for pid in path.read_text().split()] if path.is_file() else []


def kill(proc, sig=signal.SIGKILL) -> None:
    """The torchrun and its ranks (each rank is in a session of its own: not in the agent's).
    Only while the torchrun is not reaped: after that its pid may be another process's."""
    if proc.poll() is not None:
        return
    for pid in [*workers(proc), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_for(condition, procs, what, limit_s=180) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"a group ended while waiting for {what}"
        time.sleep(0.01)


@pytest.mark.distributed
def test_a_killed_group_heals_from_the_live_one_even_after_a_kill_during_its_heal(corpus,
                                                                                   tmp_path):
    """Two groups of two FSDP ranks. One rank of a group is SIGKILLed mid-run; the group is
    started again with the same command while the other trains alone (min_replicas=1) and is
    SIGKILLed again as its heal starts (torchft's "healing required"); its checkpoints are all
    intact. Started a third time, it heals from the live group; both then save the same weights
    at the same steps. SIGTERM ends both (save and stop). The victim is the group that started
    late and healed once already, so that the survivor's rows go from step 1."""
    from torchft.coordination import LighthouseServer

    from lingua.checkpoint import integrity

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000,
                              quorum_tick_ms=50, heartbeat_timeout_ms=1000)
    servers = [server]
    dumps = [tmp_path / f"group{g}" for g in range(2)]
    start = functools.partial(start_group, corpus, lighthouse=server.address())
    procs = []
    try:
        procs = [start(dumps[g], group_id=g, log_name=f"group{g}.log") for g in range(2)]
        wait_for(lambda: min(max(steps_logged(d), default=0) for d in dumps) >= 3, procs,
                 "3 steps in both groups")
        victim = 0 if HEALED in (tmp_path / "group0.log").read_text() else 1
        survivor = 1 - victim
        os.kill(workers(procs[victim])[0], signal.SIGKILL)   # one rank: no save, no goodbye
        procs[victim].wait(timeout=60)
        killed_at = max(steps_logged(dumps[victim]))

        procs[victim] = start(dumps[victim], group_id=victim, log_name="restart1.log")
        wait_for(lambda: HEALING in (tmp_path / "restart1.log").read_text(), procs,
                 "the restarted group's heal", limit_s=120)
        kill(procs[victim])   # the whole group, while it heals
        procs[victim].wait()
        for ckpt in integrity.step_dirs(integrity.checkpoints_dir(dumps[victim])):
            assert integrity.verify(ckpt) is None, f"{ckpt}: {integrity.verify(ckpt)}"

        procs[victim] = start(dumps[victim], group_id=victim, log_name="restart2.log")
        def healed_line():
            return [line for line in (tmp_path / "restart2.log").read_text().splitlines()
                    if HEALED in line]

        wait_for(healed_line, procs, "the second restart's heal", limit_s=120)
        healed_at = int(healed_line()[0].rsplit(" ", 1)[1])
        common = (healed_at // SAVE_EVERY + 2) * SAVE_EVERY   # saved by both after the heal
        wait_for(lambda: min(max(steps_logged(d), default=0) for d in dumps) >= common, procs,
                 f"step {common} in both groups")
        for p in procs:   # Slurm's way to stop a run: each rank saves and stops
            for pid in workers(p):
                os.kill(pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
        kept, healed = read_rows(dumps[survivor]), read_rows(dumps[victim])
        # Both started again (each resumes its own stop checkpoint; one behind heals) and run to
        # an end a few steps on: the run finishes. Their lighthouse waits for both (the first one
        # up would otherwise train the last steps alone, gone before the other joins).
        servers.append(LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10000,
                                        quorum_tick_ms=50))
        end = max(kept[-1]["step"], healed[-1]["step"]) + 3
        procs = [start_group(corpus, dumps[g], servers[-1].address(), g, f"end{g}.log", steps=end)
                 for g in range(2)]
        for g, p in enumerate(procs):
            assert p.wait(timeout=180) == 0, (tmp_path / f"end{g}.log").read_text()[-3000:]
    finally:
        for p in procs:
            kill(p)
        for one in servers:
            one.shutdown()
    assert model_checksums(final_checkpoint(dumps[0], end)) == \
        model_checksums(final_checkpoint(dumps[1], end))
    assert killed_at < healed_at
    steps_kept = [r["step"] for r in kept]
    assert steps_kept == list(range(1, steps_kept[-1] + 1))   # none lost or twice
    # The healed group's rows: its own before the kill, then from the step after the heal on (the
    # killed runs' rows past their checkpoint were dropped at each restart).
    after = [r["step"] for r in healed if r["step"] > healed_at]
    assert after == list(range(healed_at + 1, after[-1] + 1)) and after[-1] >= common
    assert all(math.isfinite(r["loss"]) for r in kept + healed)
    # The survivor trained alone while the other was down; a step a group died in is skipped
    # (uncommitted) by the groups alive, counted in every row from then on.
    assert {r["ft_live_groups"] for r in kept} == {1, 2}
    assert kept[-1]["ft_uncommitted_steps"] == healed[-1]["ft_uncommitted_steps"] <= 3
    # Bit for bit at the first checkpoints after the heal: the healed group took its peer's state,
    # then the same summed gradient every step.
    for step in (common - SAVE_EVERY, common):
        assert model_checksums(final_checkpoint(dumps[victim], step)) == \
            model_checksums(final_checkpoint(dumps[survivor], step)), step
