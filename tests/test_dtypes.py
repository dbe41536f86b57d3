"""distributed.model_dtype=bf16 computes in bf16 in every layout family, with fp32 master weights,
gradients, gradient reduction and optimizer state; fp32 computes in fp32.

Measured, not inferred from losses: tests/workers/dtype_worker.py runs the real trainer (the app's
main) with a TorchDispatchMode and global module hooks, and records the input dtypes of every
matmul-family op with the module running it, the collectives, and the parameters, gradients and
optimizer state. Each layout is launched once (module-scoped) and shared by the assertions.

How bf16 comes about: FSDP2's MixedPrecisionPolicy casts the parameters where FSDP is applied
(data- or context-parallel ranks: fsdp, cp, ep here), autocast does it everywhere else (one
process, tp, pp, tp x pp; lingua.train.build.mixed_precision). Before autocast covered those
multi-process layouts (and the pipeline schedule), tp, pp and tp x pp computed in fp32.
"""

import json
import re

import pytest

from tests.conftest import run_python, run_torchrun, tiny_args
from tests.test_moe_train import MOE

BF16, FP32 = "torch.bfloat16", "torch.float32"

# name: (processes, app, overrides). data.batch_size is per data-parallel rank.
LAYOUTS = {
    "one": (1, "llama", ["data.batch_size=4"]),
    "fsdp": (2, "llama", ["distributed.dp_shard=2", "data.batch_size=2"]),
    "tp": (2, "llama", ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=4"]),
    "pp": (2, "llama", ["distributed.pp=2", "distributed.dp_shard=1",
                        "distributed.pp_microbatches=2", "model.n_layers=4", "data.batch_size=4"]),
    "tp_pp": (4, "llama", ["distributed.tp=2", "distributed.pp=2", "distributed.dp_shard=1",
                           "distributed.pp_microbatches=2", "data.batch_size=4"]),
    "ep": (2, "moe", [*MOE, "distributed.ep=2", "distributed.dp_shard=2", "data.batch_size=2"]),
    "cp": (2, "llama", ["distributed.cp=2", "distributed.dp_shard=1", "data.batch_size=4"]),
}
FSDP_LAYOUTS = {"fsdp", "ep", "cp"}  # dp_shard x cp > 1: FSDP2 shards, casts and reduces
TP_LAYOUTS = {"tp", "tp_pp"}

# The MoE router's gate is computed in fp32 on purpose, autocast or not (lingua/model/moe.py Router:
# routing decisions flip on small logit differences; tests/test_moe.py
# test_router_gate_runs_in_fp32_under_autocast). It calls F.linear itself, so its matmul is
# attributed to the router module. The only matmul in the blocks allowed, and required, in fp32.
FP32_BY_DESIGN = re.compile(r"^layers\.\d+\.moe\.router$")
IN_MODEL = re.compile(r"^(layers\.\d+(\..+)?|output)$")  # the blocks and the output projection


def params(name, *marks):
    if LAYOUTS[name][0] > 1:
        marks = (pytest.mark.distributed, *marks)
    return pytest.param(name, marks=marks, id=name)


ALL = [params(name) for name in LAYOUTS]


@pytest.fixture(scope="module")
def launch(corpus, tmp_path_factory):
    """launch(layout, dtype) -> [rank0 record, rank1 record, ...], each layout run only once."""
    done = {}

    def get(name: str, dtype: str = "bf16") -> list:
        if (name, dtype) not in done:
            nproc, app, layout = LAYOUTS[name]
            root = tmp_path_factory.mktemp(f"dtypes_{name}_{dtype}")
            out = root / "records"
            # MoE's preset first: tiny_args' overrides then apply to it (as tests/test_moe_train).
            preset = ["config=debug"] if app == "moe" else []
            args = [str(out), app, *preset,
                    *tiny_args(corpus, root / "run", *layout, f"distributed.model_dtype={dtype}",
                               steps=2)]
            if nproc == 1:
                run_python("tests.workers.dtype_worker", args)
            else:
                run_torchrun(nproc, "tests.workers.dtype_worker", args)
            records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
            assert all(r["code"] == 0 for r in records), [r["code"] for r in records]
            done[name, dtype] = records
        return done[name, dtype]

    return get


def forward_ops(record: dict, key: str = "ops") -> list:
    """(phase, module, op, dtypes) of the forward ops the trainer ran for training or validation."""
    return [(phase, module, op, dtypes) for phase, backward, module, op, dtypes, _ in record[key]
            if phase in ("train_step", "validation") and not backward]


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_bf16_matmul_inputs_in_every_block(launch, name):
    """Every matmul of the blocks and the output projection gets bf16 inputs, in training and in
    validation, on every rank (pipeline ranks: their own stages), attention included."""
    records = launch(name)
    for record in records:
        ops = forward_ops(record)
        assert ops, f"rank {record['rank']} recorded no forward matmul: the recorder is broken"
        for phase in ("train_step", "validation"):
            attention = [dtypes for p, _, op, dtypes in ops
                         if p == phase and op.startswith("aten._scaled_dot_product")]
            # CPU SDPA gets bf16 q/k/v: they come out of bf16 projections (autocast, or FSDP's
            # bf16 weights) and RoPE returns its input's dtype.
            assert attention and all(set(d) == {BF16} for d in attention), (phase, attention)
        for phase, module, op, dtypes in ops:
            assert IN_MODEL.match(module), f"a {op} outside the blocks/output ran in {module}"
            want = FP32 if FP32_BY_DESIGN.match(module) else BF16
            assert set(dtypes) == {want}, (name, record["rank"], phase, module, op, dtypes)
    seen = {module for record in records for _, module, _, _ in forward_ops(record)}
    assert "output" in seen, seen
    if name == "ep":
        assert any(FP32_BY_DESIGN.match(m) for m in seen), "no MoE router matmul was recorded"


@pytest.mark.parametrize("name", [params(n) for n in LAYOUTS])
def test_rope_rotates_in_fp32(launch, name):
    """apply_rope computes in fp32 from the model's fp32 cos/sin tables so that bf16 runs keep
    exact positions (q and k come back in bf16 for attention)."""
    for record in launch(name):
        rope = forward_ops(record, "rope")
        assert rope, f"rank {record['rank']}: no RoPE multiply recorded"
        assert all(set(dtypes) == {FP32} for _, _, _, dtypes in rope), rope


@pytest.mark.parametrize("name", ALL)
def test_master_weights_gradients_and_optimizer_state_are_fp32(launch, name):
    for record in launch(name):
        n_params = len(record["params"])
        assert n_params and set(record["params"].values()) == {FP32}, record["params"]
        # As the optimizer step began: after FSDP's reduce-scatter, TP's shards and Partials.
        grads = record["grads"]
        assert len(grads) == n_params and {d for d, _ in grads.values()} == {FP32}, grads
        state = {(key, dtype): n for key, dtype, n in record["optim_state"]}
        assert state.get(("exp_avg", FP32)) == n_params, state
        assert state.get(("exp_avg_sq", FP32)) == n_params, state
        assert {dtype for key, dtype in state if key.startswith("exp_avg")} == {FP32}, state


def backward_reductions(record: dict) -> list:
    """(op, dtypes) of the reducing c10d collectives in backward: FSDP2's gradient
    reduce-scatter (and all-reduce with replicas). Functional collectives are left out: those
    are activation gradients of TP's and CP's redistributions."""
    return [(op, dtypes) for phase, backward, _, op, dtypes, _ in record["collectives"]
            if phase == "train_step" and backward and op.startswith("c10d.")
            and ("reduce_scatter" in op or "allreduce" in op)]


@pytest.mark.parametrize("name", [params(n) for n in sorted(FSDP_LAYOUTS)])
def test_fsdp_gathers_bf16_and_reduces_gradients_in_fp32(launch, name):
    for record in launch(name):
        reductions = backward_reductions(record)
        assert reductions, f"rank {record['rank']}: no gradient reduce-scatter recorded"
        assert all(set(dtypes) == {FP32} for _, dtypes in reductions), reductions
        gathers = [dtypes for phase, backward, _, op, dtypes, _ in record["collectives"]
                   if phase == "train_step" and not backward and op == "c10d._allgather_base_"]
        assert gathers and all(set(d) == {BF16} for d in gathers), gathers  # param_dtype=bf16


@pytest.mark.parametrize("name", [params(n) for n in sorted(TP_LAYOUTS)])
def test_tp_partial_gradients_are_fp32_when_summed(launch, name):
    """Without FSDP no collective reduces parameter gradients in backward. The replicated norm
    weights' gradients reach the optimizer as Partial DTensors (summed over tp inside its update,
    where the recorder cannot see the collective) and are fp32 there."""
    for record in launch(name):
        assert not backward_reductions(record), backward_reductions(record)
        partial = {n: d for n, (d, placements) in record["grads"].items()
                   if any(p.startswith("P") for p in placements)}
        assert partial and set(partial.values()) == {FP32}, record["grads"]


@pytest.mark.distributed
def test_pipeline_alone_reduces_no_gradients(launch):
    for record in launch("pp"):
        assert not backward_reductions(record), backward_reductions(record)


@pytest.mark.slow
def test_fp32_run_computes_in_fp32(launch):
    """The counter-check: the same recorder sees fp32 inputs when fp32 is asked for."""
    (record,) = launch("one", "fp32")
    ops = forward_ops(record)
    assert ops and any(op.startswith("aten._scaled_dot_product") for _, _, op, _ in ops)
    assert all(set(dtypes) == {FP32} for _, _, _, dtypes in ops), ops
