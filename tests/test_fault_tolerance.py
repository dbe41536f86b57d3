"""Replica groups with torchft (lingua/parallel/fault_tolerance.py), on CPU with gloo: real
torchft, a real lighthouse in this process, each group its own launch, started together.

With no failure, the groups together equal one process on the same global batch (4 sequences):
each group logs the loss of its own part, so the groups' mean loss is compared with the
reference's, each group's gradient norm (global: the gradients are summed across groups before
the norm) and each group's final parameters (tests/equivalence.py).
"""

import threading

import pytest

from apps.llama import train
from lingua.errors import ConfigError
from tests.conftest import run_python, run_torchrun, tiny_args
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
def test_two_fsdp_groups_of_two_ranks_equal_one_process(corpus, tmp_path, reference, lighthouse):
    dumps = run_groups(lambda a: run_torchrun(2, "apps.llama.train", a, timeout=120), corpus,
                       tmp_path, lighthouse, ["data.batch_size=1", "distributed.dp_shard=2"])
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
