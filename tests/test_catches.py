"""The equivalence and resume checks catch the bugs they exist for (a mutation check).

A dp_shard=2 run is compared with one process, as every layout test does (tests/equivalence.py),
but through tests/workers/mutant_train.py, which injects one named bug into the real trainer
(LINGUA_TEST_MUTATION; nothing else reads it). Each bug must make the check fail; the same
launcher without a bug must pass, so the failures come from the bugs.

The bugs, and what in the check catches them:
  rank1_gradients_x1.001     rank 1's gradients 0.1% too large before the reduction: the gradient
                             norm at step 1 (losses move by far less than 1e-5 at first)
  gradients_halved           every gradient divided once more by dp_shard (x0.5): the gradient
                             norm (AdamW and clipping hide it from the losses)
  last_update_lost_on_rank1  rank 1 drops its shard's last optimizer update: only the final
                             parameters (every logged loss and norm precedes that update)
  resume_without_model       resume restores optimizer, data and schedule but not the weights
  resume_from_scratch        resume ignores the checkpoint and starts at step 0; the rewritten
                             metrics have the same losses, so only "where did it resume, and were
                             earlier steps kept" shows it
"""

import shutil

import pytest

from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, assert_same_rows, read_rows
from tests.workers.mutant_train import MUTATION_VAR, MUTATIONS

pytestmark = pytest.mark.distributed
STEPS = 5
FSDP2 = ["distributed.dp_shard=2", "data.batch_size=4"]
SAVES = ["checkpoint.every=3", "checkpoint.keep=0"]   # 3 and 5: a resume point, and the end
# No validation after the last step: it would see the lost last update too, and the point of
# that bug is that the final parameters alone must catch it.
NO_VAL = ["eval.at_end=false"]


def launch(corpus, dump, mutation: str, monkeypatch):
    monkeypatch.setenv(MUTATION_VAR, mutation)
    return run_torchrun(2, "tests.workers.mutant_train",
                        tiny_args(corpus, dump, *FSDP2, *SAVES, *NO_VAL, steps=STEPS))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    from apps.llama import train

    dump = tmp_path_factory.mktemp("catches") / "one_process"
    train.main(tiny_args(corpus, dump, "data.batch_size=8", *NO_VAL, steps=STEPS))
    return dump


@pytest.fixture(scope="module")
def unmutated(corpus, tmp_path_factory, reference):
    """The launcher with no bug: it must pass the checks, or the failures below prove nothing."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        dump = tmp_path_factory.mktemp("catches") / "fsdp2"
        launch(corpus, dump, "", monkeypatch)
    finally:
        monkeypatch.undo()
    return dump


def test_the_unmutated_launcher_passes(unmutated, reference):
    assert_equivalent(unmutated, reference)


def test_every_mutation_is_tested():
    tested = set(TRAINING_BUGS) | set(RESUME_BUGS)
    assert tested == set(MUTATIONS), set(MUTATIONS) ^ tested


TRAINING_BUGS = ["rank1_gradients_x1.001", "gradients_halved", "last_update_lost_on_rank1"]
RESUME_BUGS = ["resume_without_model", "resume_from_scratch"]


@pytest.mark.parametrize("mutation", TRAINING_BUGS)
def test_a_training_bug_fails_the_equivalence_check(corpus, tmp_path, monkeypatch, reference,
                                                    mutation):
    dump = tmp_path / mutation
    launch(corpus, dump, mutation, monkeypatch)
    with pytest.raises(AssertionError) as caught:
        assert_equivalent(dump, reference)
    print(f"{mutation}: {str(caught.value).splitlines()[0]}")
    if mutation == "last_update_lost_on_rank1":
        # The per-step rows cannot see it: the final parameters are what caught it.
        assert_same_rows(read_rows(dump), read_rows(reference))
        assert "final" in str(caught.value)
    else:
        assert "grad_norm" in str(caught.value) or "final" in str(caught.value)


@pytest.mark.parametrize("mutation", RESUME_BUGS)
def test_a_resume_bug_fails_the_resume_check(corpus, tmp_path, monkeypatch, reference, unmutated,
                                             mutation):
    """Resume the unmutated run from its step-3 checkpoint with the bug in place."""
    dump = tmp_path / mutation
    shutil.copytree(unmutated, dump)
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    proc = launch(corpus, dump, mutation, monkeypatch)
    with pytest.raises(AssertionError) as caught:
        assert_resumed(dump, proc.stdout + proc.stderr, 3, first)
        assert_equivalent(dump, reference)
    print(f"{mutation}: {str(caught.value).splitlines()[0]}")


def test_the_unmutated_resume_passes(corpus, tmp_path, monkeypatch, reference, unmutated):
    dump = tmp_path / "resumed"
    shutil.copytree(unmutated, dump)
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    proc = launch(corpus, dump, "", monkeypatch)
    assert_resumed(dump, proc.stdout + proc.stderr, 3, first)
    assert_equivalent(dump, reference)
