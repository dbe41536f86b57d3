"""Expert parallelism (lingua/parallel/expert_parallel.py) against a single process with the full
experts.

Multi-process runs launch tests/ep_worker.py under torchrun on gloo: pure EP with ep = 2 and 4
(each rank its own, uneven number of tokens, as data parallel), and ep = 2 inside dp_shard = 4 with
FSDP over `ep_meshes`' expert mesh. The reference runs every rank's tokens through one unsharded
layer; its loss is the sum of the per-rank losses.
"""

import json
from pathlib import Path

import pytest
import torch

from lingua.errors import ConfigError
from lingua.model.moe import MoE
from lingua.parallel.expert_parallel import _regroup, is_grouped_experts, validate_ep
from tests.conftest import REPO, run_torchrun

TOL = 1e-5  # fp32, relative L2 error


def _run_worker(nproc: int, mode: str, out: Path) -> list:
    run_torchrun(nproc, str(REPO / "tests" / "ep_worker.py"), [str(out), mode])
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[(2, "ep"), (4, "ep"), (4, "fsdp")],
                ids=lambda p: f"{p[1]}{p[0]}")
def results(request, tmp_path_factory):
    nproc, mode = request.param
    out = tmp_path_factory.mktemp(f"{mode}{nproc}") / "results.json"
    return nproc, mode, out.parent, _run_worker(nproc, mode, out)


CASES = {"ep": ["uneven", "grouped", "skip", "empty"], "fsdp": ["uneven", "skip"]}


@pytest.mark.distributed
def test_ep_matches_single_process(results):
    nproc, mode, _, per_rank = results
    assert len(per_rank) == nproc
    for rank, by_case in enumerate(per_rank):
        assert list(by_case) == CASES[mode], by_case  # no case errored
        for case, r in by_case.items():
            where = (mode, nproc, rank, case, r)
            assert r["names_same"], where  # FQNs stay experts.w1 / w3 / w2
            assert r["out"] <= TOL, where
            assert set(r["expert_grads"]) == {"experts.w1", "experts.w3", "experts.w2"}, where
            assert max(r["expert_grads"].values()) <= TOL, where
            assert len(r["other_grads"]) == 4 and max(r["other_grads"].values()) <= TOL, where
            if mode == "ep":
                assert r["shard_ok"] and r["placements"] == "(Shard(dim=0),)", where


@pytest.mark.distributed
def test_ep_edge_cases_were_exercised(results):
    """'skip' routes nothing to EP rank 0's experts (that rank computes on zero rows) and each rank
    avoids one more expert; 'empty' gives the last rank no tokens at all."""
    nproc, mode, _, per_rank = results
    ep = nproc if mode == "ep" else 2
    skip = per_rank[0]["skip"]["received_per_ep_rank"]
    assert skip[0] == 0 and min(skip[1:]) > 0 and len(skip) == ep
    uneven = per_rank[0]["uneven"]["received_per_ep_rank"]
    assert min(uneven) > 0


@pytest.mark.distributed
def test_ep_checkpoint_loads_into_unsharded_layer(results):
    """DCP reshards the EP (and EP x FSDP) sharded experts into one process's full tensors."""
    import torch.distributed.checkpoint as dcp

    from tests.ep_worker import build

    _, mode, root, _ = results
    expected = build("uneven").state_dict()
    target = MoE(32, 48, 8, 2, n_shared_experts=1, expert_impl="loop").state_dict()
    target = {k: torch.zeros_like(v) for k, v in target.items()}
    dcp.load(target, checkpoint_id=str(root / f"ckpt_{mode}"))
    assert set(target) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(target[k], v, rtol=0, atol=0, msg=k)


def test_regroup_permutation():
    """Rows arrive grouped by (source rank, local expert); the permutation groups them by
    (local expert, source rank), keeping order within a block; the inverse undoes it."""
    recv = torch.tensor([[2, 0, 1], [0, 3, 1]])  # [ep=2, local experts=3]
    labels = [(i, expert, n) for i in range(2) for expert in range(3)
              for n in range(int(recv[i, expert]))]
    perm, inv = _regroup(recv, 7)
    regrouped = [labels[j] for j in perm.tolist()]
    assert regrouped == sorted(labels, key=lambda t: (t[1], t[0], t[2]))
    assert [regrouped[j] for j in inv.tolist()] == labels


def test_is_grouped_experts():
    moe = MoE(32, 48, 8, 2, n_shared_experts=1)
    found = [n for n, m in moe.named_modules() if is_grouped_experts(m)]
    assert found == ["experts"]


@pytest.mark.parametrize("n_experts,ep,dp_shard,cp,needle", [
    (8, 3, 6, 1, "does not divide model.n_experts=8"),
    (8, 4, 2, 1, "dp_shard x cp = 2 x 1 = 2"),
    (8, 4, 3, 2, "dp_shard x cp = 3 x 2 = 6"),
    (8, 0, 2, 1, "at least 1"),
])
def test_validate_ep_rejects(n_experts, ep, dp_shard, cp, needle):
    with pytest.raises(ConfigError, match="distributed.ep") as info:
        validate_ep(n_experts, ep, dp_shard, cp)
    assert needle in str(info.value)


def test_validate_ep_accepts():
    validate_ep(8, 4, 2, 2)  # EP over dp_shard x cp
    validate_ep(8, 1, 1, 1)
    validate_ep(16, 8, 8, 1)
