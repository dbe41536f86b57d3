"""Replica groups with torchft (lingua/parallel/fault_tolerance.py), on CPU with gloo: real
torchft, a real lighthouse in this process, each group its own launch, started together.

With no failure, the groups together equal one process on the same global batch (4 sequences):
each group logs the loss of its own part, so the groups' mean loss is compared with the
reference's, each group's gradient norm (global: the gradients are summed across groups before
the norm) and each group's final parameters (tests/equivalence.py).
"""

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

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


def run_groups(launch, corpus, tmp_path, lighthouse, extra) -> list:
    """Both groups at once (each blocks in its quorum until the other joins); their dump dirs."""
    dumps, errors = [tmp_path / f"group{g}" for g in range(2)], []

    def one(g):
        try:
            launch(tiny_args(corpus, dumps[g], *extra, *NO_VAL, *ft_args(lighthouse, g),
                             steps=STEPS))
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
def test_two_groups_of_one_rank_equal_one_process(corpus, tmp_path, reference, lighthouse):
    dumps = run_groups(lambda a: run_python("apps.llama.train", a, timeout=120), corpus,
                       tmp_path, lighthouse, ["data.batch_size=2"])
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
                             "distributed.pp=2", "distributed.dp_replicate=2", steps=1))
    message = str(err.value)
    assert "group_id=2 must be in 0 .. replica_groups-1" in message
    assert "pipeline parallel across replica groups is not supported" in message
    assert "set fault_tolerance.replica_groups instead" in message


HEALED = "healed from a live group at step"   # FaultToleranceHook's log line
HEAL_STEPS = 300   # the survivor's steps must outlast the restart (~5 s)


def start_group(corpus, dump, lighthouse, group_id, log_name) -> subprocess.Popen:
    """One group's own interpreter (a fresh process, so that the test can SIGKILL it)."""
    args = tiny_args(corpus, dump, "data.batch_size=2", *NO_VAL, *ft_args(lighthouse, group_id),
                     "fault_tolerance.min_replicas=1", "fault_tolerance.quorum_timeout_s=20",
                     "checkpoint.save_final=true", steps=HEAL_STEPS)
    log = open(dump.parent / log_name, "w")
    return subprocess.Popen([sys.executable, "-m", "apps.llama.train", *args], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log, stderr=log)


def steps_logged(dump) -> list:
    path = dump / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] \
        if path.is_file() else []


@pytest.mark.distributed
def test_a_killed_group_heals_from_the_live_one_and_both_finish(corpus, tmp_path):
    """One group is SIGKILLed after step 3 and started again with the same command while the
    other goes on alone (min_replicas=1); it loads the survivor's state through torchft and both
    finish. The victim is a group that started with the run: one that started late has healed
    once already, so the other, which began at step 1, survives."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000,
                              quorum_tick_ms=50, heartbeat_timeout_ms=1000)
    dumps = [tmp_path / f"group{g}" for g in range(2)]
    try:
        procs = [start_group(corpus, dumps[g], server.address(), g, f"group{g}.log")
                 for g in range(2)]
        deadline = time.monotonic() + 60
        while min(max(steps_logged(d), default=0) for d in dumps) < 3:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        late = [HEALED in (tmp_path / f"group{g}.log").read_text() for g in range(2)]
        victim = 0 if late[0] else 1
        survivor = 1 - victim
        procs[victim].send_signal(signal.SIGKILL)   # mid-run: no save, no goodbye
        procs[victim].wait()
        procs[victim] = start_group(corpus, dumps[victim], server.address(), victim,
                                    "restart.log")   # the same command
        for p in procs:
            assert p.wait(timeout=90) == 0, (tmp_path / "restart.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.shutdown()
    assert f"group {victim} {HEALED}" in (tmp_path / "restart.log").read_text(), (
        "the restarted group did not heal: did the survivor finish before it joined? (the "
        "survivor's steps, HEAL_STEPS, must outlast a restart)")
    kept, healed = read_rows(dumps[survivor]), read_rows(dumps[victim])
    assert [r["step"] for r in kept] == list(range(1, HEAL_STEPS + 1))   # none lost or twice
    # The restart's log starts at the step it healed to, after the killed run's rows were dropped.
    assert [r["step"] for r in healed] == list(range(healed[0]["step"], HEAL_STEPS + 1))
    assert healed[0]["step"] > 3
    assert all(math.isfinite(r["loss"]) for r in kept + healed)
    # Equal to the last bit (exact checksums): the healed group took its peer's state, then the
    # same summed gradient every step.
    assert model_checksums(final_checkpoint(dumps[victim], HEAL_STEPS)) == \
        model_checksums(final_checkpoint(dumps[survivor], HEAL_STEPS))
