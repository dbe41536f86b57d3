"""Context parallelism: sharding layout and config checks (unit), and CP forward/backward on gloo
with 2 and 4 ranks against the same model run in one process (tests/cp_worker.py)."""

import json
from pathlib import Path

import pytest
import torch

from lingua.errors import ConfigError
from lingua.parallel.context_parallel import shard_positions, shard_sequence, validate_cp
from tests.conftest import REPO, run_torchrun

# ---------------------------------------------------------------------------------------------
# Unit: layout and validation


@pytest.mark.parametrize("seq_len", [16, 64])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_positions_cover_and_balance(seq_len, cp):
    shards = [shard_positions(seq_len, r, cp) for r in range(cp)]
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(seq_len))  # each position once
    assert {len(s) for s in shards} == {seq_len // cp}
    # Causal work of a query at position p is p + 1 keys: head + tail chunks make it equal.
    work = {int((s + 1).sum()) for s in shards}
    assert len(work) == 1, work
    for s in shards:  # local order: a head chunk then a tail chunk, each ascending
        half = len(s) // 2
        assert (torch.all(s[1:half] - s[:half - 1] == 1)
                and torch.all(s[half + 1:] - s[half:-1] == 1))


@pytest.mark.parametrize("cp", [2, 4])
def test_layout_matches_torch_ring_attention(cp):
    # torch's ring attention shards with its own head-tail balancer; both backends must agree.
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    torch_order = _HeadTailLoadBalancer(32, cp, "cpu")._generate_indices()[0].view(cp, -1)
    for r in range(cp):
        assert torch.equal(shard_positions(32, r, cp), torch_order[r].long())


def test_shard_sequence():
    t = torch.arange(2 * 16 * 3).view(2, 16, 3)
    local = shard_sequence(t, 1, 4, dim=1)
    assert torch.equal(local, t[:, [2, 3, 12, 13]])
    assert torch.equal(shard_sequence(t[0, :, 0], 0, 2, dim=0),
                       t[0, [0, 1, 2, 3, 12, 13, 14, 15], 0])


def test_validate_cp_accepts():
    validate_cp(64, 2, 2)
    validate_cp(64, 4, 1, "allgather", "cpu", doc_masking=True)
    validate_cp(10, 1, 1)  # cp=1: nothing to shard
    validate_cp(64, 2, 1, "ring", "cuda")


@pytest.mark.parametrize("kwargs, words", [
    (dict(seq_len=40, cp=4, tp=2),
     ["data.seq_len=40", "2 x 4 x 2 = 16", "multiple of 16", "data.seq_len=32"]),
    (dict(seq_len=30, cp=2, tp=1), ["data.seq_len=30", "= 4", "data.seq_len=28"]),
    (dict(seq_len=64, cp=2, backend="ring", device_type="cpu"),
     ["needs CUDA", "cp_backend=allgather"]),
    (dict(seq_len=64, cp=2, backend="ring", device_type="cuda", doc_masking=True),
     ["block_causal", "cp_backend=allgather", "document"]),
    (dict(seq_len=64, cp=2, backend="ulysses"), ["ulysses", "allgather, ring"]),
])
def test_validate_cp_messages(kwargs, words):
    with pytest.raises(ConfigError) as e:
        validate_cp(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# ---------------------------------------------------------------------------------------------
# Distributed: CP on gloo against one process


def _run_worker(nproc: int, out: Path, *extra: str) -> dict:
    run_torchrun(nproc, str(REPO / "tests" / "cp_worker.py"), [str(out), *extra])
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def cp_results(request, tmp_path_factory):
    cp = request.param
    return cp, _run_worker(cp, tmp_path_factory.mktemp(f"cp{cp}") / "results.json")


# fp32: summed loss within 1e-5 relative, logits and every parameter's gradient within 1e-5
# (relative L2 norm of the difference). bf16 runs compare against a bf16 reference: bf16 rounding
# in a different accumulation order, so a few 1e-3 on gradients.
TOLERANCES = {"fp32": (1e-5, 1e-5, 1e-5), "bf16": (1e-3, 1e-2, 3e-2)}


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["causal", "doc", "doc_ac_full", "doc_ac_op", "causal_bf16",
                                  "doc_bf16"])
def test_cp_matches_single_process(cp_results, case):
    cp, results = cp_results
    r = results[case]
    loss_tol, logits_tol, grads_tol = TOLERANCES["bf16" if case.endswith("bf16") else "fp32"]
    assert r["n_grads"] == 21  # every parameter of the 2-layer model got a gradient
    assert r["loss_rel"] <= loss_tol, (cp, case, r)
    assert r["logits_rel"] <= logits_tol, (cp, case, r)
    assert r["grads_rel"] <= grads_tol, (cp, case, r)


@pytest.mark.distributed
def test_cp_attention_outside_batch_raises(cp_results):
    _, results = cp_results
    assert "outside `cp_batch`" in results["outside_error"]


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="ring attention CP needs 2 CUDA devices (NCCL)")
def test_ring_attention_matches_single_process(tmp_path):
    results = _run_worker(2, tmp_path / "ring.json", "ring")
    assert set(results) == {"causal", "causal_bf16"}
    for case, r in results.items():
        # Flash / memory-efficient kernels and the ring's log-sum-exp merge: looser than CPU fp32.
        loss_tol, logits_tol, grads_tol = (TOLERANCES["bf16"] if case.endswith("bf16")
                                           else (1e-5, 1e-4, 1e-4))
        assert r["loss_rel"] <= loss_tol, (case, r)
        assert r["logits_rel"] <= logits_tol, (case, r)
        assert r["grads_rel"] <= grads_tol, (case, r)
