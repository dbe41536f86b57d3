"""Tensor + sequence parallelism (lingua/parallel/tensor_parallel.py, lingua/parallel/tp_plan.py,
lingua/models/llama/parallelize.py).

Unit: validate_tp / check_async_tp messages. Distributed: this file is also the worker script,
run under `torch.distributed.run` (see `_launch`): every rank builds the same tiny model from one
seed, keeps an untouched deepcopy as the single-process reference, applies TP and compares loss,
logits and every gradient (gathered with full_tensor) with the reference on the same batch.
Rank 0 writes the errors as JSON; the assertions run here in the pytest process.
"""

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# Run as a script by torchrun, this file's directory (tests/) is on sys.path, not the repository:
# the imports below need REPO inserted first.
sys.path.insert(0, str(REPO))

from lingua.errors import ConfigError  # noqa: E402
from lingua.model.loss import token_loss_sum  # noqa: E402
from lingua.models.llama.model import LlamaArgs, Transformer  # noqa: E402
from lingua.models.llama.parallelize import tp_plans as decoder_tp_plans  # noqa: E402
from lingua.models.llama.parallelize import validate_tp  # noqa: E402
from lingua.parallel.distributed import exit_process  # noqa: E402
from lingua.parallel.tensor_parallel import (  # noqa: E402
    apply_tp,
    check_async_tp,
    loss_parallel_context,
)

# Tolerances (fp32, CPU). Loss and logits: relative error of the whole tensor (norm of the
# difference / norm of the reference). Gradients: every element within GRAD_ATOL + GRAD_RTOL *
# |reference| (like torch.testing), plus a 1e-5 relative-norm bound per parameter. Sharded
# matmuls and all-reduces change only the summation order, so errors are ~1e-7.
LOSS_RTOL = 1e-5
GRAD_ATOL, GRAD_RTOL, GRAD_NORM_RTOL = 1e-6, 1e-4, 1e-5
# FSDP x TP training vs one process: losses of 2 AdamW steps and the loss after them within
# 1e-5 relative; parameters after the steps within 1e-4 (norm-relative, per parameter): Adam
# divides by sqrt(v), so on its first step an element with a near-zero gradient moves by ~lr
# whatever its tiny value, which amplifies summation-order differences (measured: ~4e-5).
TRAIN_LOSS_RTOL, PARAM_RTOL = 1e-5, 1e-4


def tiny_args(**kw) -> LlamaArgs:
    base = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32,
            "max_seq_len": 64, "vocab_size": 258}
    base.update(kw)
    return LlamaArgs(**base)


# ---------------------------------------------------------------------------------------------
# Unit: validation


def test_validate_tp_accepts():
    validate_tp(tiny_args(), 1)
    validate_tp(tiny_args(), 2, seq_len=32)
    validate_tp(tiny_args(n_kv_heads=4), 4, seq_len=64)
    validate_tp(tiny_args(n_kv_heads=None), 4)        # None -> n_heads
    validate_tp(tiny_args(tie_embeddings=True), 1)    # tying is fine without TP


@pytest.mark.parametrize("args, tp, seq_len, words", [
    (tiny_args(n_heads=4, n_kv_heads=2), 3, None, ["model.n_heads=4", "distributed.tp=3"]),
    (tiny_args(n_heads=8, n_kv_heads=2), 4, None,
     ["model.n_kv_heads=2", "distributed.tp=4", "multiple of 4"]),
    (tiny_args(tie_embeddings=True), 2, None, ["tie_embeddings=true", "distributed.tp=2",
                                               "tie_embeddings=false"]),
    (tiny_args(), 2, 33, ["data.seq_len=33", "distributed.tp=2", "data.seq_len=32"]),
    (tiny_args(), 0, None, ["distributed.tp=0"]),
])
def test_validate_tp_messages(args, tp, seq_len, words):
    with pytest.raises(ConfigError) as e:
        validate_tp(args, tp, seq_len)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_check_async_tp():
    check_async_tp(False, "cpu", False)
    check_async_tp(True, "cuda", True)
    with pytest.raises(ConfigError, match="needs CUDA"):
        check_async_tp(True, "cpu", True)
    with pytest.raises(ConfigError, match="distributed.compile=true"):
        check_async_tp(True, "cuda", False)


def test_token_loss_sum_plain():
    logits, labels = torch.randn(2, 5, 7), torch.randint(7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.view(10, 7), labels.view(10),
                                                 reduction="sum")
    torch.testing.assert_close(token_loss_sum(logits, labels), expected)
    with loss_parallel_context(False):  # a no-op context
        torch.testing.assert_close(token_loss_sum(logits.bfloat16(), labels), expected,
                                   atol=0.1, rtol=0.02)


# ---------------------------------------------------------------------------------------------
# Distributed (launched from pytest below)


def _launch(nproc: int, case: str, out: Path, timeout: int = 240) -> dict:
    from tests.conftest import run_torchrun

    run_torchrun(nproc, __file__, [case, str(out)], timeout=timeout)
    return json.loads(out.read_text())


def _check_run(r: dict) -> None:
    name = r["name"]
    assert r["loss_rel"] <= LOSS_RTOL, (name, r["loss"], r["ref_loss"])
    assert r["logits_rel"] <= LOSS_RTOL, (name, r["logits_rel"])
    assert r["n_grads"] == r["n_params"], name  # every parameter got a gradient
    for pname, (excess, norm_rel) in r["grads"].items():
        assert excess <= 0, (name, pname, "max |g - ref| - (atol + rtol |ref|) =", excess)
        assert norm_rel <= GRAD_NORM_RTOL, (name, pname, norm_rel)


@pytest.mark.distributed
def test_tp2_matches_single_process(tmp_path):
    res = _launch(2, "tp2", tmp_path / "tp2.json")
    names = [r["name"] for r in res["runs"]]
    assert names == ["gqa", "gqa+loss_parallel+docs", "mha+loss_parallel", "pipeline_stages"]
    for r in res["runs"]:
        _check_run(r)
    assert res["local_shard_shape"] == [2, 16, 64]  # stage boundary: plain [b, S/tp, dim] shards
    assert "needs CUDA" in res["async_tp_cpu_error"]
    assert res["sharded_logits"] in ("S(2)", "Shard(dim=2)")  # vocabulary-sharded


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One 4-rank launch for both 4-rank tests (process start-up is most of their cost)."""
    return _launch(4, "four", tmp_path_factory.mktemp("tp4") / "four.json")


@pytest.mark.distributed
def test_tp4_matches_single_process(four_ranks):
    res = four_ranks["tp4"]
    assert [r["name"] for r in res["runs"]] == ["mha", "mha+loss_parallel+docs"]
    for r in res["runs"]:
        _check_run(r)  # vocab 258 is not a multiple of 4: uneven vocabulary shards work too


@pytest.mark.distributed
def test_fsdp_x_tp_training_matches_single_process(four_ranks):
    res = four_ranks["fsdp_tp"]
    assert len(res["losses"]) == len(res["ref_losses"]) == 3
    for step, (a, b) in enumerate(zip(res["losses"], res["ref_losses"])):
        assert abs(a - b) <= TRAIN_LOSS_RTOL * abs(b), (step, a, b)
    assert res["losses"][2] < res["losses"][0] - 0.01  # it trained (step 0's batch, again)
    assert res["param_rel"] <= PARAM_RTOL, res["param_rel"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="async TP needs 2 CUDA devices")
def test_async_tp_compiled_matches_single_process(tmp_path):
    res = _launch(2, "async_tp", tmp_path / "async.json", timeout=600)
    for r in res["runs"]:
        assert r["loss_rel"] <= 1e-4 and r["logits_rel"] <= 1e-4, r


# ---------------------------------------------------------------------------------------------
# Worker side (runs under torchrun)

BATCH, SEQ = 2, 32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _build(args: LlamaArgs, device="cpu") -> Transformer:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights()
    return model


def _batch(vocab: int, batch: int = BATCH, seed: int = 1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (batch, SEQ), generator=g)
    labels = torch.randint(vocab, (batch, SEQ), generator=g)
    starts = torch.rand(batch, SEQ, generator=g) < 0.15
    starts[:, 0] = True
    return tokens.to(device), labels.to(device), starts.long().cumsum(1).to(device)


def _compare(name, model_fn, ref, tp_params, batch, loss_parallel, use_docs) -> dict:
    """Forward + token_loss_sum / n_tokens + backward through `model_fn`, against `ref`."""
    tokens, labels, doc_ids = batch
    docs = doc_ids if use_docs else None
    ref_logits = ref(tokens, docs)
    ref_loss = token_loss_sum(ref_logits, labels) / labels.numel()
    ref_loss.backward()
    with loss_parallel_context(loss_parallel):
        logits = model_fn(tokens, docs)
        loss = token_loss_sum(logits, labels) / labels.numel()
        assert type(loss) is torch.Tensor, type(loss)  # plain, so the trainer can all-reduce it
        loss.backward()
    ref_grads = dict(ref.named_parameters())
    grads = {}
    for pname, p in tp_params:
        if p.grad is None:
            continue
        g, r = _full(p.grad), ref_grads[pname].grad
        excess = ((g - r).abs() - (GRAD_ATOL + GRAD_RTOL * r.abs())).max().item()
        grads[pname] = (excess, _rel(g, r))
    return {"name": name, "loss": loss.item(), "ref_loss": ref_loss.item(),
            "loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "logits_rel": _rel(_full(logits.detach()), ref_logits.detach()),
            "grads": grads, "n_grads": len(grads), "n_params": len(ref_grads)}


def _tp_model(args, tp_mesh, loss_parallel):
    model = _build(args)
    ref = copy.deepcopy(model)
    root, block = decoder_tp_plans(model, loss_parallel)
    apply_tp(model, tp_mesh, root, block, model.layers.values())
    return model, ref


def _split(model: Transformer, n_first: int):
    """Two pipeline-stage-like parts of one model (what pipeline.split_model produces)."""
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    for key in list(a.layers):
        del (a.layers if int(key) >= n_first else b.layers)[key]
    a.norm = a.output = None
    b.tok_embeddings = None
    return a, b


def _case_tp(tp_mesh, configs):
    runs = []
    for name, args, loss_parallel, use_docs in configs:
        model, ref = _tp_model(args, tp_mesh, loss_parallel)
        batch = _batch(args.vocab_size)
        runs.append(_compare(name, model, ref, list(model.named_parameters()), batch,
                             loss_parallel, use_docs))
    return runs


def worker_tp2(tp_mesh) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel

    out = {"runs": _case_tp(tp_mesh, [
        ("gqa", tiny_args(), False, False),
        ("gqa+loss_parallel+docs", tiny_args(), True, True),
        ("mha+loss_parallel", tiny_args(n_kv_heads=4), True, False),
    ])}
    # Pipeline stage boundaries: part a (embeddings + block 0) hands a plain local sequence shard
    # to part b (block 1 + norm + output), which takes hidden states as input.
    args = tiny_args()
    full = _build(args)
    ref = copy.deepcopy(full)
    a, b = _split(full, 1)
    for part in (a, b):
        root, block = decoder_tp_plans(part, loss_parallel=True)
        apply_tp(part, tp_mesh, root, block, part.layers.values())
    shapes = []

    def two_stages(tokens, docs):
        h = a(tokens, docs)
        shapes.append(list(h.shape))
        assert type(h) is torch.Tensor
        return b(h, docs)

    params = list(a.named_parameters()) + list(b.named_parameters())
    out["runs"].append(_compare("pipeline_stages", two_stages, ref, params, _batch(args.vocab_size),
                                True, True))
    out["local_shard_shape"] = shapes[0]
    # Loss parallel really sees vocabulary-sharded logits.
    model, _ = _tp_model(args, tp_mesh, loss_parallel=True)
    with loss_parallel():
        logits = model(_batch(args.vocab_size)[0])
    out["sharded_logits"] = str(logits.placements[0])
    try:
        apply_tp(_build(args), tp_mesh, *decoder_tp_plans(model, False), [], async_tp=True)
        out["async_tp_cpu_error"] = "no error"
    except ConfigError as e:
        out["async_tp_cpu_error"] = str(e)
    return out


def worker_tp4(tp_mesh) -> dict:
    mha = tiny_args(n_kv_heads=4)
    return {"runs": _case_tp(tp_mesh, [("mha", mha, False, False),
                                       ("mha+loss_parallel+docs", mha, True, True)])}


def worker_fsdp_tp(mesh) -> dict:
    """(dp_shard, tp) = (2, 2): TP first, then FSDP2 per block and at the root over dp_shard;
    2 AdamW steps, each dp rank on its own batch, against one process on both batches."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    args = tiny_args()
    model = _build(args)
    ref = copy.deepcopy(model)
    root, block = decoder_tp_plans(model, loss_parallel=True)
    apply_tp(model, mesh["tp"], root, block, model.layers.values())
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    dp_rank, dp = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()
    losses, ref_losses = [], []
    for step in range(3):  # 2 training steps, then the loss after them
        # Steps 0 and 1 on different global batches; then step 0's batch again, to see it learned.
        tokens, labels, doc_ids = _batch(args.vocab_size, BATCH * dp, seed=10 + step % 2)
        n_tokens = labels.numel()  # the global batch
        ref_loss = token_loss_sum(ref(tokens, doc_ids), labels) / n_tokens
        mine = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
        with loss_parallel_context(True):
            loss = token_loss_sum(model(tokens[mine], doc_ids[mine]), labels[mine]) / n_tokens
            if step < 2:
                loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=mesh["dp_shard"].get_group())
        losses.append(total.item())
        ref_losses.append(ref_loss.item())
        if step < 2:
            ref_loss.backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    ref_params = dict(ref.named_parameters())
    param_rel = max(_rel(_full(p.detach()), ref_params[n].detach())
                    for n, p in model.named_parameters())
    return {"losses": losses, "ref_losses": ref_losses, "param_rel": param_rel}


def worker_async_tp(tp_mesh) -> dict:
    args = tiny_args(n_kv_heads=4)
    model = _build(args, "cuda")
    ref = copy.deepcopy(model)
    root, block = decoder_tp_plans(model, loss_parallel=False)
    apply_tp(model, tp_mesh, root, block, model.layers.values(), async_tp=True)
    for blk in model.layers.values():
        blk.compile()
    tokens, labels, _ = _batch(args.vocab_size, device="cuda")
    with torch.no_grad():
        logits, ref_logits = model(tokens), ref(tokens)
    loss, ref_loss = token_loss_sum(logits, labels), token_loss_sum(ref_logits, labels)
    return {"runs": [{"loss_rel": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                      "logits_rel": _rel(logits, ref_logits)}]}


def main(case: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = case == "async_tp"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    try:
        if case == "four":
            tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "tp"))
            result = {"tp4": worker_tp4(tp_mesh), "fsdp_tp": worker_fsdp_tp(mesh)}
        else:
            tp_mesh = init_device_mesh("cuda" if cuda else "cpu", (world,), mesh_dim_names=("tp",))
            result = {"tp2": worker_tp2, "async_tp": worker_async_tp}[case](tp_mesh)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_process(0)  # results are written; gloo can abort interpreter teardown (it says why)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
