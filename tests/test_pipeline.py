"""Pipeline parallelism (lingua/parallel/pipeline.py): stage splits, validation, and every torch
schedule on 2 gloo CPU ranks compared with the same batch in one process."""

import json

import pytest
import torch

from lingua.errors import ConfigError
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.parallel.pipeline import (
    _torch_schedules,
    schedule_name,
    split_model,
    stage_ids_of_rank,
    stage_layer_ids,
    validate_pp,
)
from tests.conftest import REPO, run_torchrun

# (name, schedule, stages per rank, micro-batches, pp_split, block_causal). 4 layers, pp=2.
CASES = [
    ("GPipe", "GPipe", 1, 2, [], False),
    ("1F1B", "1F1B", 1, 2, [], False),
    ("1F1B-split-docs", "1F1B", 1, 4, [1], True),
    ("Interleaved1F1B", "Interleaved1F1B", 2, 4, [], False),
    ("Interleaved1F1B-v1", "Interleaved1F1B", 1, 2, [], False),
    ("LoopedBFS", "LoopedBFS", 2, 2, [], False),
    ("InterleavedZeroBubble", "InterleavedZeroBubble", 2, 4, [], True),
    ("ZBVZeroBubble", "ZBVZeroBubble", 2, 4, [], False),
    ("DualPipeV", "DualPipeV", 2, 4, [], False),
]


def tiny_model(**kw) -> Transformer:
    with torch.device("meta"):
        return Transformer(LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=32,
                                     max_seq_len=32, **kw))


# ---------------------------------------------------------------------------------------------
# Unit tests


def test_even_split_gives_extra_layers_to_early_stages():
    assert stage_layer_ids(4, 2) == [[0, 1], [2, 3]]
    assert stage_layer_ids(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_layer_ids(7, 4) == [[0, 1], [2, 3], [4, 5], [6]]
    assert stage_layer_ids(3, 3) == [[0], [1], [2]]
    assert stage_layer_ids(4, 2, [1]) == [[0], [1, 2, 3]]
    assert stage_layer_ids(6, 3, [1, 5]) == [[0], [1, 2, 3, 4], [5]]


@pytest.mark.parametrize("n_layers, n_stages, split, words", [
    (4, 5, [], ["5 stages", "n_layers=4"]),
    (4, 2, [1, 2], ["2 entries", "needs 1", "[2]"]),
    (4, 3, [2, 2], ["[2, 2]", "strictly increasing", "1..3"]),
    (4, 2, [4], ["[4]", "1..3"]),
    (4, 2, [0], ["[0]", "1..3"]),
])
def test_bad_split_errors(n_layers, n_stages, split, words):
    with pytest.raises(ConfigError) as err:
        stage_layer_ids(n_layers, n_stages, split)
    for w in words:
        assert w in str(err.value)


def test_stage_ids_of_rank_match_torch_mapping():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for schedule, style, virtual in (("1F1B", "loop", 1), ("Interleaved1F1B", "loop", 3),
                                     ("ZBVZeroBubble", "v", 2), ("DualPipeV", "v", 2)):
        for pp in (2, 4):
            torch_map = generate_stage_to_rank_mapping(pp, pp * virtual, style=style)
            for r in range(pp):
                assert stage_ids_of_rank(r, pp, virtual, schedule) == \
                    sorted(s for s, owner in torch_map.items() if owner == r)
    assert stage_ids_of_rank(1, 2, 2, "Interleaved1F1B") == [1, 3]
    assert stage_ids_of_rank(0, 2, 2, "ZBVZeroBubble") == [0, 3]


def test_split_model_keeps_names_and_drops_the_rest():
    model = tiny_model()
    names = {n for n, _ in model.named_parameters()}
    first = split_model(model, [0, 1], True, False)
    last = split_model(model, [2, 3], False, True)
    assert list(first.layers) == ["0", "1"] and first.norm is None and first.output is None
    assert list(last.layers) == ["2", "3"] and last.tok_embeddings is None
    first_names = {n for n, _ in first.named_parameters()}
    last_names = {n for n, _ in last.named_parameters()}
    assert first_names | last_names == names and not first_names & last_names
    assert list(model.layers) == ["0", "1", "2", "3"] and model.output is not None  # untouched
    with pytest.raises(ConfigError, match="tie_embeddings"):
        split_model(tiny_model(tie_embeddings=True), [0, 1], True, False)
    whole = split_model(tiny_model(tie_embeddings=True), [0, 1, 2, 3], True, True)
    assert whole.tok_embeddings is not None


def test_validate_pp_accepts_good_layouts():
    assert schedule_name("interleaved1f1b") == "Interleaved1F1B"
    validate_pp(4, 1, 1, "1F1B", 0, 1, True)  # pp=1: nothing is split
    validate_pp(4, 2, 1, "1F1B", 0, 4, False)
    validate_pp(4, 2, 2, "Interleaved1F1B", 0, 4, False)
    validate_pp(4, 2, 2, "ZBVZeroBubble", 2, 4, False)
    validate_pp(8, 4, 2, "Interleaved1F1B", 3, 3, False)  # fewer micro-batches than pp: one round
    validate_pp(4, 2, 1, "GPipe", 1, 4, False, [3])


@pytest.mark.parametrize("kw, words", [
    (dict(schedule="Zigzag"), ["'Zigzag'", "1F1B", "GPipe"]),
    (dict(schedule="GPipe", virtual=2), ["GPipe", "pp_virtual_stages=2", "pp_virtual_stages=1"]),
    (dict(schedule="ZBVZeroBubble", virtual=1), ["ZBVZeroBubble", "pp_virtual_stages=2"]),
    (dict(pp=1, virtual=2), ["pp_virtual_stages=2", "pp > 1"]),
    (dict(tie=True), ["tie_embeddings", "pp=2"]),
    (dict(n_layers=3, virtual=2, schedule="Interleaved1F1B"), ["4 stages", "n_layers=3"]),
    (dict(split=[5]), ["pp_split=[5]", "1..3"]),
    (dict(n_mb=3), ["batch_size=4", "pp_microbatches=3", "multiple of 3"]),
    (dict(n_mb=0, batch=6, virtual=2, schedule="LoopedBFS"), ["batch_size=6", "= 4"]),
    (dict(n_mb=1), ["1F1B", "(2)", "pp_microbatches=1"]),
    (dict(schedule="DualPipeV", virtual=2, n_mb=2), ["DualPipeV", "(4)", "pp_microbatches=2"]),
    (dict(schedule="Interleaved1F1B", virtual=2, n_mb=5, batch=5), ["2 rounds", "5", "4 or 6"]),
    (dict(n_mb=-1), ["pp_microbatches=-1"]),
])
def test_validate_pp_errors(kw, words):
    args = dict(n_layers=4, pp=2, virtual=1, schedule="1F1B", n_mb=2, batch=4, tie=False, split=[])
    args.update(kw)
    with pytest.raises(ConfigError) as err:
        validate_pp(args["n_layers"], args["pp"], args["virtual"], args["schedule"], args["n_mb"],
                    args["batch"], args["tie"], args["split"])
    for w in words:
        assert w in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------
# Every schedule on 2 gloo ranks against one process


@pytest.fixture(scope="module")
def pp_results(tmp_path_factory):
    """One torchrun launch runs every case (start-up dominates); {case: [rank0, rank1]}."""
    out = tmp_path_factory.mktemp("pp")
    cases = [dict(name=n, schedule=s, virtual=v, microbatches=m, split=sp, block_causal=bc)
             for n, s, v, m, sp, bc in CASES]
    (out / "cases.json").write_text(json.dumps(cases))
    run_torchrun(2, str(REPO / "tests" / "pp_worker.py"), [str(out), str(out / "cases.json")])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {name: [ranks[0][name], ranks[1][name]] for name, *_ in CASES}


def test_every_torch_schedule_is_covered():
    assert set(_torch_schedules()) <= {c[1] for c in CASES}


def _check_grads(grads: dict, what: str):
    for name, (diff, scale) in grads.items():
        assert diff <= 1e-5 * scale + 1e-8, f"{what}: {name} differs by {diff} (scale {scale})"


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_schedule_matches_single_process(pp_results, case):
    ranks = pp_results[case]
    ref = ranks[0]["ref_loss"]
    assert ranks[1]["ref_loss"] == ref
    # Every parameter lives on exactly one rank.
    fqns = ranks[0]["fqns"] + ranks[1]["fqns"]
    assert sorted(fqns) == sorted(n for n, _ in tiny_model().named_parameters())
    holders = [r for r in ranks if r["loss"] is not None]
    assert len(holders) == 1, "exactly one rank holds the last stage and reports the loss"
    last = holders[0]
    for key in ("loss", "eval", "loss2"):  # step, eval_loss, step again after evaluation
        assert abs(last[key] - ref) <= 1e-5 * abs(ref), f"{key}={last[key]} vs reference {ref}"
    assert abs(last["eval_twice"] - 2 * ref) <= 2e-5 * abs(ref), "eval on a batch of another shape"
    # loss_fn's calls on real micro-batches, those not marked inferring_shapes() (torch 2.13
    # makes one extra, marked call on a first step, 2.11 none): one per micro-batch, adding up.
    recorded = last["recorded"]
    assert len(recorded) == dict((c[0], c[3]) for c in CASES)[case], recorded
    assert abs(sum(recorded) - ref) <= 1e-5 * abs(ref), f"recorded {recorded} vs reference {ref}"
    for r, res in enumerate(ranks):
        _check_grads(res["grads"], f"rank {r}")
        _check_grads(res["grads2"], f"rank {r} second step")
        _check_grads(res["grads_accum"], f"rank {r} accumulated over two steps")
