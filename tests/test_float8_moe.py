"""distributed.float8 for the MoE experts (lingua/float8/moe.py).

Unit: which experts apply_float8 converts and what it logs; the emulated float8 rowwise grouped
matmul (what CPU runs; torchao's CUDA kernel is compared with it in tests/test_gpu.py) against
the same matmuls done by hand per expert, with mutants (other scales) the comparison catches;
the planner's float8 FLOPs and cast bytes count the experts.
Runs (fp32 high precision, as tests/test_float8.py's layouts): float8 experts track the
unconverted run and train; FSDP2, EP, PP and TP runs and activation checkpointing equal the
one-process float8 run.
"""

import logging

import pytest
import torch

from lingua.float8 import apply_float8
from lingua.float8 import moe as float8_moe
from lingua.model.moe import GroupedExperts
from tests.conftest import run_torchrun
from tests.equivalence import assert_equivalent, read_rows
from tests.test_float8 import E4, quantized
from tests.test_moe_train import moe_args


def tiny_moe(**kw):
    from apps.moe.model import MoEArgs, Transformer

    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, vocab_size=258,
                max_seq_len=64, n_experts=16, top_k=2, n_shared_experts=1,
                expert_hidden_dim=32, n_dense_layers=1)
    with torch.device("meta"):
        return Transformer(MoEArgs(**{**args, **kw}))


def test_moe_experts_are_converted_and_the_log_says_which(caplog):
    from apps.moe.parallelize import float8_filter

    model = tiny_moe()
    with caplog.at_level(logging.INFO, logger="lingua.float8"):
        names = apply_float8(model, "rowwise", float8_filter, emulate=True)
    experts = model.get_submodule("layers.1.moe.experts")
    assert "layers.1.moe.experts" in names and "layers.1.moe.router.gate" not in names
    assert "layers.1.moe.shared_experts.w1" in names   # the shared experts are Linears
    assert experts.grouped_mm is float8_moe.emulated_float8_grouped_mm
    assert experts.group_multiple == 16
    assert "the MoE experts (layers.*.moe.experts) use float8 rowwise grouped GEMMs (emulated)" \
        in caplog.text
    assert list(model.state_dict()) == list(tiny_moe().state_dict())   # same checkpoint keys

    # The per-expert loop, or a hidden size the GEMM cannot take: unchanged, and the log gives
    # the one reason that applies.
    for model, why in ((tiny_moe(expert_impl="loop"),
                        "they loop over experts (model.expert_impl=loop)"),
                       (tiny_moe(expert_hidden_dim=40),
                        "expert hidden=40 not a multiple of 16")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lingua.float8"):
            names = apply_float8(model, "tensorwise", float8_filter)
        assert not any(n.endswith("experts") for n in names)
        assert model.get_submodule("layers.1.moe.experts").grouped_mm is None
        assert ("the MoE experts (layers.*.moe.experts) stay in high precision: " + why + "\n"
                in caplog.text + "\n"), caplog.text
        assert caplog.text.count("stay in high precision") == 1


def by_hand(x, w, grad_y, counts, pow2=True, per_group=True):
    """(y, grad x, grad w) of y[group e] = x[group e] @ w[e], each matmul's operands cast to
    e4m3 along its reduced dimension (power-of-2 scales): x and grad_y per row, w per column
    (forward) or per row (input gradient), and for the weight gradient x and grad_y per column
    within the expert's tokens (`per_group=False`: over all tokens, a mutant)."""
    ys, gxs, gws, start = [], [], [], 0
    xq_all, gq_all = quantized(x, E4, 0, pow2), quantized(grad_y, E4, 0, pow2)
    for e, n in enumerate(counts):
        xe, ge = x[start:start + n], grad_y[start:start + n]
        ys.append(quantized(xe, E4, -1, pow2) @ quantized(w[e], E4, 0, pow2))
        gxs.append(quantized(ge, E4, -1, pow2) @ quantized(w[e], E4, 1, pow2).T)
        if per_group:
            gws.append(quantized(xe, E4, 0, pow2).T @ quantized(ge, E4, 0, pow2) if n else
                       torch.zeros_like(w[e]))
        else:
            gws.append(xq_all[start:start + n].T @ gq_all[start:start + n])
        start += n
    return torch.cat(ys), torch.cat(gxs), torch.stack(gws)


def test_emulated_grouped_matmul_equals_hand_quantized_matmuls():
    gen = torch.Generator().manual_seed(0)
    counts = [16, 0, 32, 48]   # group-aligned, one expert without tokens
    x = torch.randn(96, 32, generator=gen).mul_(torch.linspace(0.1, 4, 32))   # uneven columns
    # The first expert's tokens 1e4 times larger: a scale over all tokens would push the other
    # experts' values into e4m3's subnormals (a power-of-2 scale is otherwise exact).
    x[:16] *= 1e4
    w = torch.randn(4, 32, 48, generator=gen).mul_(torch.linspace(0.1, 4, 48))
    grad_y = torch.randn(96, 48, generator=gen) * torch.linspace(4, 0.1, 96).unsqueeze(1)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x.requires_grad_(), w.requires_grad_()
    y = float8_moe.emulated_float8_grouped_mm(x, w, offs)
    y.backward(grad_y)
    got = (y.detach(), x.grad, w.grad)
    want = by_hand(x.detach(), w.detach(), grad_y, counts)
    def close(a, b, tol):   # per expert: their magnitudes differ by 1e4
        parts = zip(a.split(counts), b.split(counts)) if a.dim() == 2 else zip(a, b)
        return all(torch.allclose(p, q, rtol=tol, atol=tol * q.abs().max().item())
                   for p, q in parts if q.numel())

    for a, b in zip(got, want):   # the same float8 values: only fp32 summation order differs
        assert close(a, b, 1e-5)
    unquantized = x.detach()[16:48] @ w.detach()[2]
    assert not torch.allclose(got[0][16:48], unquantized, rtol=1e-3, atol=1e-3)
    for mutant in (dict(pow2=False), dict(per_group=False)):
        wrong = by_hand(x.detach(), w.detach(), grad_y, counts, **mutant)
        assert not all(close(a, b, 1e-4) for a, b in zip(got, wrong)), mutant


def test_converted_experts_pad_groups_to_16_and_stay_close_to_high_precision(monkeypatch):
    """Each expert's rows reach the float8 matmul in groups that start at multiples of 16 (what
    torch._scaled_grouped_mm needs), and the experts' output stays within float8's error of the
    unconverted experts'."""
    gen = torch.Generator().manual_seed(1)
    experts = GroupedExperts(4, 32, 48)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=gen)
    counts, x = torch.tensor([10, 0, 33, 7]), torch.randn(50, 32, generator=gen)
    plain = experts(x, counts)
    seen = []
    monkeypatch.setattr(float8_moe, "emulated_float8_grouped_mm",
                        lambda a, w, offs: seen.append(offs.tolist()) or
                        float8_moe.EmulatedFloat8GroupedMM.apply(a, w, offs))
    float8_moe.convert_experts(experts, emulate=True)
    got = experts(x, counts)
    assert seen and all(o % 16 == 0 for offs in seen for o in offs), seen
    assert seen[0] == [16, 16, 64, 112]
    error = ((got - plain).norm() / plain.norm()).item()
    assert 1e-3 < error < 0.1, error


def test_the_plan_counts_the_float8_experts():
    from lingua.launch.plan import float8_flops_per_token
    from lingua.launch.plan_memory import _float8_cast_bytes

    class Args:
        class distributed:
            float8 = "tensorwise"

    from apps.moe.train import APP

    model = tiny_moe()
    linears = sum(6 * m.weight.numel() for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n.split(".")[-1] not in ("output", "gate"))
    # a token meets top_k=2 experts of 3 * 64 * 32 weights in the one MoE layer
    assert float8_flops_per_token(Args, APP, model) == linears + 6 * 2 * 3 * 64 * 32
    apply_float8(model, "tensorwise", APP.float8_filter, emulate=True)
    experts_copy = 2 * 16 * 3 * 64 * 32   # bf16 column-major copy, kept for backward
    assert _float8_cast_bytes([model]) >= 2 * experts_copy


# --- runs --------------------------------------------------------------------------------------

STEPS = 8
# The load-balancing loss is off: it weighs each micro-batch's routing by the counts of the
# step's global micro-batch (both ranks' under dp_shard=2, its own in MB4's reference).
F8 = ["distributed.float8=tensorwise", "model.aux_loss_coef=0"]
MB4 = ["data.batch_size=4", "data.grad_accum=2"]   # what a rank of dp_shard=2 sees


@pytest.fixture(scope="module")
def moe_references(corpus, tmp_path_factory):
    from apps.moe import train

    root = tmp_path_factory.mktemp("moe_float8")
    said = logging.Handler()
    said.emit = lambda record: (root / "float8.log").open("a").write(record.getMessage() + "\n")
    logging.getLogger("lingua.float8").addHandler(said)
    try:
        for name, extra in (("fp32", [*F8[1:], *MB4]), ("float8", [*F8, *MB4])):
            train.main(moe_args(corpus, root / name, *extra, steps=STEPS))
    finally:
        logging.getLogger("lingua.float8").removeHandler(said)
    return root


# float8 rounds every operand element by up to 6% (e4m3) or 12% (e5m2, gradients); a step's
# loss averages thousands of such products, whose errors take both signs, so float8 moves it by
# about 1e-4 (the largest over 8 steps: 1.3e-4 on the Xeon, 9.0e-5 on the AVX512 EPYC; see
# benchmarks/summation_order.py's "without float8" row). 2e-3 leaves 15x, and the run must still
# learn (its loss falls by 0.5) and differ from fp32 by more than summation order would.
TRACK_RTOL = 2e-3
LAYOUT_RTOL = 2e-3   # the layouts' tolerance after step 1 (below)


@pytest.mark.slow
def test_float8_moe_tracks_high_precision_and_trains(moe_references):
    assert "the MoE experts (layers.*.moe.experts) use float8 rowwise grouped GEMMs (emulated)" \
        in (moe_references / "float8.log").read_text()
    fp32, float8 = read_rows(moe_references / "fp32"), read_rows(moe_references / "float8")
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(float8, fp32))
    assert worst <= TRACK_RTOL, worst
    assert float8[-1]["loss"] < float8[0]["loss"] - 0.5
    # The experts (and Linears) did run in float8, and float8's own error is larger than what
    # the layouts below may differ by after step 1.
    with pytest.raises(AssertionError):
        assert_equivalent(moe_references / "float8", moe_references / "fp32", rtol=LAYOUT_RTOL)


# What can differ between a layout and the one-process float8 run, and the bounds that follow
# (`python benchmarks/summation_order.py --case float8_moe` runs every layout here against its
# reference under this CPU's kernels, the AVX2 and the AVX512 code paths of ATen and MKL, and
# unvectorised kernels, and prints the table BENCHMARKS.md keeps):
# - Step 1, FSDP2, EP2 and PP2 (tight_steps=1): the weights are the same bits, and every forward
#   sees one of the reference's micro-batches of 4 with the same shapes, so the same kernels cast
#   the same float8 values (EP2's expert groups hold both ranks' tokens, but the power-of-2 column
#   scales of the weight gradient move no value unless one falls into the subnormals); only the
#   fp32 sum of the two micro-batches' gradients is ordered otherwise. Every key at RTOL (1e-5):
#   measured equal to 1e-7 under all five kernel settings. A wrong gradient scale or a missing
#   reduction shows here.
# - From step 2 the weights differ in their last bits (the global gradient norm, and so the
#   clipping factor and every update, is summed in another order), and a float8 cast moves each
#   value that sits within those bits of a rounding boundary by a whole float8 step (6-12% of
#   it). A few values a step, compounding over the steps: measured at most 6.7e-4 (final sums),
#   4.3e-4 (gradient norm), 3.1e-4 (validation loss) and 1.7e-3 (z-loss, which squares the
#   router's logits) over the five settings. The bound is float8's own error, the distance of the
#   same run without float8 (7.2e-3 gradient norm, 8.6e-3 final sums, 1.4e-2 z-loss): a run whose
#   float8 values differ from the reference's in a few places stays far nearer to it than one
#   whose values all differ. Tolerances 2e-3 and 5e-3 for the routing metrics: 3x the worst
#   measured, under float8's own error.
# - TP2: the row-sharded float8 Linears sum partial outputs across ranks, so activations differ
#   in their last bit from step 1 and no step is exact (gradient norm 5.6e-4 at step 1, final
#   sums 2.6e-3, z-loss 4.1e-3 at worst); one token routed to another expert moves a layer's
#   imbalance, a ratio of token counts, by one token's share (2.6e-3). Tolerances 5e-3 and 2e-2.
# A wrong gradient scale is off by far more (setup/mutants.sh plants some in these paths).
@pytest.mark.distributed
@pytest.mark.parametrize("layout, tight_steps, rtol, routing_rtol", [
    (["distributed.dp_shard=2", "data.batch_size=4"], 1, LAYOUT_RTOL, 5e-3),
    (["distributed.ep=2", "distributed.dp_shard=2", "data.batch_size=4"], 1, LAYOUT_RTOL, 5e-3),
    (["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=8",
      "distributed.pp_microbatches=2"], 1, LAYOUT_RTOL, 5e-3),
    (["distributed.tp=2", "distributed.dp_shard=1", *MB4], 0, 5e-3, 2e-2),
], ids=["fsdp2", "ep2", "pp2", "tp2"])
def test_float8_moe_layouts_equal_one_process(corpus, tmp_path, moe_references, layout,
                                              tight_steps, rtol, routing_rtol):
    dump = tmp_path / "run"
    run_torchrun(2, "apps.moe.train", moe_args(corpus, dump, *F8, *layout, steps=STEPS))
    assert_equivalent(dump, moe_references / "float8", rtol=rtol, prefixes={"moe/": routing_rtol},
                      tight_steps=tight_steps)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "op"])
def test_float8_moe_with_activation_checkpointing_equals_without(corpus, tmp_path, moe_references,
                                                                 ac):
    """The recomputed forward routes the same tokens into the same padded groups and casts them
    with the same scales: checkpointing whole blocks, or every op but the matmuls, changes
    nothing (measured equal to 1e-6)."""
    from apps.moe import train

    dump = tmp_path / "run"
    train.main(moe_args(corpus, dump, *F8, *MB4, f"distributed.ac={ac}", steps=STEPS))
    assert_equivalent(dump, moe_references / "float8", rtol=1e-6, prefixes={"moe/": 1e-6})
