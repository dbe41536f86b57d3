"""MoE layer (lingua/model/moe.py) and MoE model (apps/moe/model.py) against hand-written
references."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from apps.moe.model import MoEArgs, Transformer, flops_per_token, validate_moe_args
from lingua.errors import ConfigError
from lingua.model.moe import (
    GroupedExperts,
    MoE,
    Router,
    active_params_per_token,
    moe_layers,
    reset_routing,
    routing_metrics,
    update_expert_bias,
)
from tests.conftest import saved_tensor_bytes


def _experts(impl, n=4, dim=16, hidden=24, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    ex = GroupedExperts(n, dim, hidden, impl)
    with torch.no_grad():
        for w in ex.parameters():
            w.copy_(torch.randn_like(w) * 0.2)
    return ex.to(dtype)


def _ffn(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [10, 0, 0, 0], [0, 0, 0, 10], [0, 0, 0, 0]])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_matches_loop_including_empty_experts_and_stride0_grad(counts, dtype, tol):
    grads = {}
    for impl in ("grouped", "loop"):
        ex = _experts(impl, dtype=dtype)
        torch.manual_seed(1)
        x = torch.randn(sum(counts), 16, dtype=dtype, requires_grad=True)
        y = ex(x, torch.tensor(counts))
        # A stride-0 incoming gradient: grouped_mm's backward rejects it unless fixed.
        y.sum().backward()
        grads[impl] = ([y.detach().float(), x.grad.float()]
                       + [p.grad.float() for p in ex.parameters()])
    for grouped, loop in zip(grads["grouped"], grads["loop"]):
        assert torch.allclose(grouped, loop, atol=tol, rtol=tol), (grouped - loop).abs().max()
    ex = _experts("loop")  # the loop itself against per-expert matmuls written out
    x = torch.randn(sum(counts), 16)
    start = [0] + list(torch.tensor(counts).cumsum(0)[:-1])
    ref = torch.cat([_ffn(x[s:s + c], ex.w1[e], ex.w3[e], ex.w2[e])
                     for e, (s, c) in enumerate(zip(start, counts))])
    assert torch.allclose(ex(x, torch.tensor(counts)), ref, atol=1e-6)
    if counts[1] == 0:  # an expert without tokens gets a zero (not missing) weight gradient
        assert (grads["grouped"][2][1] == 0).all()


def test_pad_groups_puts_each_expert_at_a_multiple_with_zero_rows_between():
    from lingua.model.moe import _pad_groups

    counts = torch.tensor([5, 0, 16, 17, 1])
    x = torch.arange(1, 40, dtype=torch.float32).unsqueeze(1).repeat(1, 8)   # no zero rows
    padded, rows, offs = _pad_groups(x, counts, 16)
    # The last group runs to the buffer's end, a multiple too: no row is outside a group.
    assert padded.shape == (128, 8)   # 39 + 5 * 15 rounded up
    assert offs.dtype == torch.int32 and offs.tolist() == [16, 16, 32, 64, 128]
    assert torch.equal(padded[rows], x)                      # every row kept, in its order
    starts = [0, 16, 16, 32, 64]
    for e, (start, count) in enumerate(zip(starts, counts.tolist())):
        assert torch.equal(padded[start:start + count], x[sum(counts[:e]):sum(counts[:e + 1])])
    assert int((padded.abs().sum(1) == 0).sum()) == 128 - 39   # the rest: zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_experts_pad_their_groups_and_equal_the_loop(monkeypatch, dtype):
    """On CPU in bf16 and fp16 each expert's rows are padded to a multiple of CPU_GROUP_ROWS
    before torch._grouped_mm (oneDNN builds a kernel per shape it meets): the group sizes the
    GEMMs see are multiples, and the outputs and every gradient equal the per-expert loop's."""
    import lingua.model.moe as moe_module

    seen = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: (seen.append(offs.tolist())
                                                                  or grouped_mm(a, b, offs=offs)))
    counts = torch.tensor([500, 13, 0, 250, 261, 999, 1, 19])
    assert moe_module._cpu_group_rows(torch.empty(2043, 16, dtype=dtype), 8) == 16
    grads = {}
    for impl in ("grouped", "loop"):
        ex = _experts(impl, n=8, dtype=dtype)
        x = torch.randn(int(counts.sum()), 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        x.requires_grad_()
        # Anomaly mode: no NaN from rows outside a group (grouped_mm leaves those unwritten).
        with torch.autograd.detect_anomaly():
            y = ex(x, counts)
            (y.float() * torch.linspace(-1, 1, 16)).sum().backward()
        grads[impl] = ([y.detach().float(), x.grad.float()]
                       + [p.grad.float() for p in ex.parameters()])
    assert seen and all(o % moe_module.CPU_GROUP_ROWS == 0
                        for offs in seen for o in offs[:-1]), seen
    for grouped, loop in zip(grads["grouped"], grads["loop"]):
        torch.testing.assert_close(grouped, loop, atol=3e-2, rtol=3e-2)


def test_experts_are_not_padded_in_fp32_off_cpu_or_where_padding_would_add_over_10_percent():
    from lingua.model.moe import _cpu_group_rows

    assert _cpu_group_rows(torch.empty(4096, 8), 8) == 0                          # fp32: MKL
    assert _cpu_group_rows(torch.empty(4096, 8, dtype=torch.bfloat16), 8) == 16
    assert _cpu_group_rows(torch.empty(4096, 8, dtype=torch.float16), 8) == 16
    assert _cpu_group_rows(torch.empty(256, 8, dtype=torch.bfloat16), 8) == 0     # 120 rows on 256
    assert _cpu_group_rows(torch.empty(4096, 8, dtype=torch.bfloat16, device="meta"), 8) == 0


def test_padded_experts_keep_no_second_copy_of_their_rows_for_backward(monkeypatch):
    """What the padded path keeps for backward beyond the unpadded one: its padding rows and the
    row index, not another copy of the tokens' rows (torch's index_copy would keep its source)."""
    import lingua.model.moe as moe_module

    def saved_bytes(padded):
        ex = _experts("grouped", n=8, dim=64, hidden=64, dtype=torch.bfloat16)
        x = torch.randn(4000, 64, dtype=torch.bfloat16, requires_grad=True)
        counts = torch.tensor([500] * 8)
        with monkeypatch.context() as patch:
            if not padded:
                patch.setattr(moe_module, "_cpu_group_rows", lambda x, n_experts: 0)
            return saved_tensor_bytes(lambda: ex(x, counts).sum().backward())

    padded, unpadded = saved_bytes(True), saved_bytes(False)
    extra = padded - unpadded
    pad_rows = 4128 - 4000   # 8 * 15 more, rounded up to a multiple of 16
    # Per pad row, the bf16 rows of 64 that the GEMMs and SwiGLU keep (x, the w1 and w3
    # outputs, silu's, h: 5, measured), plus the int64 row index.
    assert 0 < extra <= pad_rows * 5 * 64 * 2 + 4000 * 8, (padded, unpadded)
    assert extra < 4000 * 64 * 2      # less than one more copy of the rows


def test_grouped_rejects_misaligned_shapes():
    with pytest.raises(ConfigError, match="multiples of 8"):
        GroupedExperts(4, 12, 24, "grouped")
    GroupedExperts(4, 12, 20, "loop")  # the reference has no alignment constraint


def _router(score_func="softmax", norm_topk=False, route_scale=1.0, top_k=2):
    r = Router(3, 4, top_k, score_func, norm_topk, route_scale)
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(4, 3))  # logits = (x0, x1, x2, 0)
    return r


def test_router_softmax_sigmoid_and_biased_selection():
    x = torch.tensor([[2.0, 1.0, 0.0]])
    w, e, s, _ = _router("softmax")(x)
    p = torch.tensor([2.0, 1.0, 0.0, 0.0]).exp() / torch.tensor([2.0, 1.0, 0.0, 0.0]).exp().sum()
    assert torch.allclose(s[0], p) and e.tolist() == [[0, 1]] and torch.allclose(w[0], p[:2])
    w, e, s, _ = _router("sigmoid")(x)
    assert (torch.allclose(s[0], torch.tensor([2.0, 1.0, 0.0, 0.0]).sigmoid())
            and e.tolist() == [[0, 1]])
    # p = (.61, .22, .08, .08); biased p + b = (-.39, .22, .08, .28) selects experts 3 and 1, yet
    # the weights stay the unbiased p[3], p[1].
    r = _router("softmax")
    r.expert_bias.copy_(torch.tensor([-1.0, 0.0, 0.0, 0.2]))
    w, e, _, _ = r(x)
    assert sorted(e[0].tolist()) == [1, 3]
    assert torch.allclose(w[0], p[e[0]])
    w, _, _, _ = _router("sigmoid", norm_topk=True, route_scale=2.5)(torch.randn(5, 3))
    assert torch.allclose(w.sum(-1), torch.full((5,), 2.5))


def test_router_gate_runs_in_fp32_under_autocast():
    r = _router()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w, _, s, logits = r(torch.randn(4, 3, dtype=torch.bfloat16))
    assert logits.dtype == s.dtype == w.dtype == torch.float32


def _moe(**kw):
    torch.manual_seed(0)
    args = dict(dim=16, hidden=24, n_experts=4, top_k=2)
    args.update(kw)
    m = MoE(**args)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def _dense_reference(m: MoE, x):
    """Every expert on every token, weighted by the (sparse) routing weights, written from
    scratch."""
    scores = (x @ m.router.gate.weight.T).softmax(-1)
    top = torch.topk(scores, m.top_k, -1).indices
    weights = torch.zeros_like(scores).scatter(-1, top, scores.gather(-1, top))
    ex = m.experts
    out = sum(weights[:, e:e + 1] * _ffn(x, ex.w1[e], ex.w3[e], ex.w2[e])
              for e in range(m.n_experts))
    if m.shared_experts is not None:
        sh = m.shared_experts
        out = out + _ffn(x, sh.w1.weight.T, sh.w3.weight.T, sh.w2.weight.T)
    return out


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("shared", [0, 1])
def test_moe_matches_dense_reference(impl, shared):
    m = _moe(expert_impl=impl, n_shared_experts=shared)
    x = torch.randn(2, 5, 16)
    assert torch.allclose(m(x), _dense_reference(m, x.reshape(-1, 16)).view(2, 5, 16), atol=1e-5)
    assert m.stats["tokens_per_expert"].sum() == 20 and m.stats["dropped_fraction"] == 0


def test_moe_under_bf16_autocast_grouped_matches_loop():
    x = torch.randn(12, 16)
    outs = []
    for impl in ("grouped", "loop"):
        m = _moe(expert_impl=impl, n_shared_experts=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().sum().backward()
        outs.append((out.float(), m.router.gate.weight.grad))
    assert (outs[0][0].dtype == torch.float32
            and torch.allclose(outs[0][0], outs[1][0], atol=5e-2, rtol=5e-2))
    assert torch.allclose(outs[0][1], outs[1][1], atol=5e-2, rtol=5e-2)
    assert torch.allclose(outs[0][0], _dense_reference(m, x), atol=0.1, rtol=0.1)


def test_moe_layer_pads_under_bf16_autocast_and_compiles_once_for_any_routing(monkeypatch):
    """The MoE layer as the trainer runs it on CPU in bf16 (autocast), with enough tokens for the
    expert padding to apply (4 experts x 15 pad rows against 640 slots): it pads, its output and
    every gradient equal the unpadded layer's, and torch.compile traces it once for two batches
    that route differently, since the padded buffer's shape does not follow the routing. aot_eager:
    dynamo and AOTAutograd as inductor gets them, without inductor's compile time."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import lingua.model.moe as moe_module

    batches = [torch.randn(2, 160, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    weight = torch.linspace(-1, 1, 16)

    def step(layer, x):
        layer.zero_grad()
        # As the trainer does each step (reset_routing, update_expert_bias): the sums carried
        # from the previous step would be another guard.
        module = getattr(layer, "_orig_mod", layer)   # torch.compile's wrapper holds the layer
        reset_routing([module])
        module.step_counts = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        (out.float() * weight).sum().backward()
        return [out.detach().float()] + [p.grad.clone() for p in layer.parameters()]

    def assert_steps_close(steps, reference_steps):   # output and every gradient, bf16 as above
        for ours, reference in zip(steps, reference_steps, strict=True):
            for a, b in zip(ours, reference, strict=True):
                torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)

    padded_counts, pad = [], moe_module._pad_groups
    with monkeypatch.context() as patch:
        patch.setattr(moe_module, "_pad_groups",
                      lambda x, c, m: padded_counts.append(c.tolist()) or pad(x, c, m))
        padded = [step(_moe(), x) for x in batches]
    assert len(padded_counts) == 2 and padded_counts[0] != padded_counts[1], padded_counts
    with monkeypatch.context() as patch:
        patch.setattr(moe_module, "_cpu_group_rows", lambda x, n_experts: 0)
        unpadded = [step(_moe(), x) for x in batches]
    assert_steps_close(padded, unpadded)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    layer = _moe()
    compiled = torch.compile(layer, backend=counter)
    results = [step(compiled, batches[0])]
    frames = counter.frame_count
    results.append(step(compiled, batches[1]))
    assert counter.frame_count == frames, "the second routing recompiled the layer"
    assert any("repeat_interleave" in g.code for g in counter.graphs), "the padding was not traced"
    assert_steps_close(results, padded)
    torch._dynamo.reset()


def test_capacity_drops_later_tokens():
    m = _moe(n_experts=2, top_k=1, capacity_factor=1.0)  # capacity ceil(1 * 4 * 1 / 2) = 2
    m.router.expert_bias.copy_(torch.tensor([100.0, 0.0]))  # every token picks expert 0
    x = torch.randn(4, 16)
    out = m(x)
    ex = m.experts
    p0 = (x @ m.router.gate.weight.T).softmax(-1)[:, :1]
    assert torch.allclose(out[:2], p0[:2] * _ffn(x[:2], ex.w1[0], ex.w3[0], ex.w2[0]), atol=1e-6)
    assert (out[2:] == 0).all()
    assert m.stats["dropped_fraction"].item() == 0.5


def _aux_by_hand(m: MoE, x, counts=None, gate=None):
    """coef * E * sum_e f_e sum_tokens p_e and coef * sum_tokens lse^2 (sums over x's tokens), with
    m's coefficients (and gate unless given)."""
    logits = x @ (m.router.gate.weight if gate is None else gate).T
    p = logits.softmax(-1)
    top = torch.topk(p, m.top_k, -1).indices
    if counts is None:
        counts = torch.zeros(m.n_experts).index_add_(0, top.flatten(), torch.ones(top.numel()))
    f = counts / counts.sum()  # the fraction of the token->expert assignments each expert got
    aux = m.aux_loss_coef * m.n_experts * (f * p.sum(0)).sum()
    z = m.z_loss_coef * (torch.logsumexp(logits, -1) ** 2).sum()
    return aux, z


def test_aux_and_z_loss_match_formulas():
    m = _moe(aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(6, 16)
    m(x)
    aux, z = _aux_by_hand(m, x)
    assert torch.allclose(m.stats["aux_loss"], aux) and torch.allclose(m.stats["z_loss"], z)
    torch.testing.assert_close(m.balance_loss, aux + z)
    m.eval()  # evaluation neither computes them nor calls the trainer's hooks
    m.count_reducer = None
    m(x)
    assert m.stats["aux_loss"] == 0 and m.stats["z_loss"] == 0 and m.balance_loss is None


def test_aux_gradients_survive_activation_checkpointing():
    """balance_loss is computed inside the checkpointed region and read after it: backward
    through it recomputes the region like the output's does."""
    m = _moe(aux_loss_coef=0.5, z_loss_coef=0.05)
    ref = copy.deepcopy(m)
    x, r = torch.randn(8, 16), torch.randn(8, 16)
    out = checkpoint(m, x, use_reentrant=False)
    ((out * r).sum() + m.balance_loss).backward()
    ((ref(x) * r).sum() + ref.balance_loss).backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_balance_loss_gradient_equals_autograd_of_lm_plus_aux_by_hand():
    m = _moe(aux_loss_coef=0.5, z_loss_coef=0.05, n_shared_experts=1)
    ref = copy.deepcopy(m)
    ref.aux_loss_coef = ref.z_loss_coef = 0.0
    x = torch.randn(8, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    r = torch.randn(8, 16)
    ((m(x) * r).sum() + m.balance_loss).backward()
    aux, z = _aux_by_hand(m, xr, gate=ref.router.gate.weight)
    ((ref(xr) * r).sum() + aux + z).backward()
    for a, b in [(x.grad, xr.grad)] + [(p.grad, q.grad)
                                       for p, q in zip(m.parameters(), ref.parameters())]:
        assert torch.allclose(a, b, atol=1e-6)


def test_split_batch_aux_losses_and_gradients_sum_to_full_batch():
    """Two halves as two simulated ranks: the reducer returns the summed counts of both halves."""
    full = _moe(aux_loss_coef=0.3, z_loss_coef=0.02)
    x, r = torch.randn(10, 16), torch.randn(10, 16)
    ((full(x) * r).sum() + full.balance_loss).backward()
    full.balance_loss = None   # a tensor with a graph: deepcopy refuses it
    full_counts, full_aux, full_z = (full.stats["tokens_per_expert"], full.stats["aux_loss"],
                                     full.stats["z_loss"])
    halves = [copy.deepcopy(full) for _ in range(2)]
    for h in halves:
        h.zero_grad()
        h.count_reducer = lambda c: full_counts.clone()
    outs = [h(x[i * 5:(i + 1) * 5]) for i, h in enumerate(halves)]
    assert torch.equal(halves[0].stats["tokens_per_expert"] + halves[1].stats["tokens_per_expert"],
                       full_counts)
    for i, (h, o) in enumerate(zip(halves, outs)):
        ((o * r[i * 5:(i + 1) * 5]).sum() + h.balance_loss).backward()
    assert torch.allclose(sum(h.stats["aux_loss"] for h in halves), full_aux, atol=1e-7)
    assert torch.allclose(sum(h.stats["z_loss"] for h in halves), full_z, atol=1e-7)
    for name, p in full.named_parameters():
        summed = sum(dict(h.named_parameters())[name].grad for h in halves)
        assert torch.allclose(summed, p.grad, atol=1e-5), name
    assert torch.allclose(halves[0].stats["aux_loss"], _aux_by_hand(full, x[:5], full_counts)[0])


def test_expert_bias_update_formula_and_count_accumulation():
    a, b = _moe(), _moe()
    a.step_counts = torch.tensor([10.0, 2.0, 6.0, 6.0])
    b.step_counts = torch.tensor([1.0, 1.0, 1.0, 5.0])
    a.count_reducer = lambda t: 2 * t  # a "world" of two identical ranks
    update_expert_bias([a, b], rate=0.01)
    assert torch.allclose(a.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert torch.allclose(b.router.expert_bias, torch.tensor([0.01, 0.01, 0.01, -0.01]))
    assert a.step_counts is None and b.step_counts is None
    x = torch.randn(6, 16, requires_grad=True)
    a(x)
    c1 = a.stats["tokens_per_expert"]
    # Two forwards accumulate; a recompute under activation checkpointing is not counted twice.
    checkpoint(a, x, use_reentrant=False).sum().backward()
    assert torch.equal(a.step_counts, 2 * c1)
    a.eval()
    a(x)
    assert torch.equal(a.step_counts, 2 * c1)


# ---------------------------------------------------------------------------------------------
# The model

TINY = dict(dim=32, n_layers=3, n_heads=4, multiple_of=16, vocab_size=64, max_seq_len=32,
            n_experts=4, top_k=2, n_dense_layers=1, n_shared_experts=1)


def test_meta_build_then_init_is_deterministic_and_complete():
    args = MoEArgs(**TINY)
    states = []
    for _ in range(2):
        with torch.device("meta"):
            m = Transformer(args)
        m.to_empty(device="cpu")
        torch.manual_seed(3)
        m.init_weights(buffer_device="cpu")
        states.append(m.state_dict())
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
    sd = states[0]
    assert ("layers.1.moe.router.expert_bias" in sd
            and (sd["layers.1.moe.router.expert_bias"] == 0).all())
    assert (sd["layers.1.moe.experts.w1"].shape == (4, 32, 96)
            and sd["layers.1.moe.experts.w2"].shape == (4, 96, 32))
    assert ("layers.0.feed_forward.w1.weight" in sd
            and not any(k.startswith("layers.0.moe") for k in sd))
    assert "layers.2.moe.shared_experts.w2.weight" in sd and "rope_cos" not in sd
    # The residual output w2 is scaled down with depth like the dense FFN's.
    assert sd["layers.2.moe.experts.w2"].std() < 0.7 * sd["layers.2.moe.experts.w1"].std()


def test_forward_shapes_and_document_masking():
    torch.manual_seed(0)
    m = Transformer(MoEArgs(**TINY))
    tokens = torch.randint(0, 64, (2, 12))
    assert m(tokens).shape == (2, 12, 64)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7] * 2)
    changed = tokens.clone()
    changed[:, :5] = (changed[:, :5] + 1) % 64  # edit document 0 only
    with torch.no_grad():
        a, b = m(tokens, doc_ids), m(changed, doc_ids)
        assert torch.allclose(a[:, 5:], b[:, 5:], atol=1e-5)  # document 1 never sees document 0
        assert not torch.allclose(m(tokens)[:, 5:], m(changed)[:, 5:], atol=1e-3)


@pytest.mark.parametrize("bad,match", [
    (dict(top_k=5), "top_k"), (dict(top_k=0), "top_k"), (dict(score_func="tanh"), "score_func"),
    (dict(n_dense_layers=4), "n_dense_layers"), (dict(n_dense_layers=-1), "n_dense_layers"),
    (dict(capacity_factor=-1.0), "capacity_factor"), (dict(expert_impl="triton"), "expert_impl"),
    (dict(dim=30), "n_heads"), (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(expert_hidden_dim=20), "multiples of 8"),
])
def test_validate_moe_args(bad, match):
    with pytest.raises(ConfigError, match=match):
        validate_moe_args(MoEArgs(**{**TINY, **bad}))


def test_active_params_count_top_k_experts_only():
    args = MoEArgs(**TINY)
    with torch.device("meta"):
        m = Transformer(args)
    attn = 4 * 32 * 32
    dense_ffn = 3 * 32 * 96
    moe_layer = 32 * 4 + 2 * 3 * 32 * 96 + 3 * 32 * 96  # router + top_k=2 of the 4 experts + shared
    expected = 3 * attn + dense_ffn + 2 * moe_layer + 32 * 64
    assert active_params_per_token(m) == expected
    assert flops_per_token(args, 16) == 6 * expected + 12 * 3 * 32 * 16


def test_loss_falls_on_copy_task_with_balancing():
    torch.manual_seed(0)
    args = MoEArgs(**{**TINY, "aux_loss_coef": 0.01, "z_loss_coef": 1e-3, "bias_update_rate": 1e-3})
    m = Transformer(args)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    half = torch.randint(0, 64, (8, 8))
    seq = torch.cat([half, half], 1)  # the second half repeats the first
    losses = []
    for _ in range(20):
        logits, balance_loss = m(seq[:, :-1])   # training with balancing: the losses beside
        n = seq[:, 1:].numel()
        loss = F.cross_entropy(logits.reshape(-1, 64), seq[:, 1:].reshape(-1))
        (loss + balance_loss.sum() / n).backward()
        opt.step()
        opt.zero_grad()
        update_expert_bias(moe_layers(m), args.bias_update_rate)
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert math.isfinite(losses[-1])
    assert any((layer.router.expert_bias != 0).any() for layer in moe_layers(m))


def test_routing_metrics_cover_every_training_forward_once_and_reset():
    """Two micro-batches, one of them under activation checkpointing (its recompute in backward
    is not counted again), then an eval forward (not counted): the metrics equal those computed
    by hand from both micro-batches' routing; a sum over two "ranks" doubles counts and losses
    but not the ratios; reset_routing starts over."""
    m = _moe(capacity_factor=1.0, aux_loss_coef=0.01, z_loss_coef=0.001)
    x1, x2 = torch.randn(6, 16, requires_grad=True), torch.randn(10, 16, requires_grad=True)
    m.train()
    m(x1).sum().backward()
    checkpoint(m, x2, use_reentrant=False).sum().backward()
    m.eval()
    m(torch.randn(50, 16))
    m.train()

    def by_hand(x):
        with torch.no_grad():
            scores = (x @ m.router.gate.weight.T).softmax(-1)
            top = torch.topk(scores, 2, -1).indices
            counts = torch.bincount(top.reshape(-1), minlength=4).float()
            cap = math.ceil(1.0 * x.shape[0] * 2 / 4)
            entropy = -(scores * scores.log()).sum(-1)
        return counts, float((counts - cap).clamp_min(0).sum()), entropy

    (c1, d1, e1), (c2, d2, e2) = by_hand(x1), by_hand(x2)
    counts = c1 + c2
    got = routing_metrics({1: m}, 2, 4, reduce=lambda t: t, device=torch.device("cpu"))
    assert set(got) == {f"1/{k}" for k in ("imbalance", "dropped_fraction", "router_entropy",
                                             "aux_loss", "z_loss")}  # layer 0: no MoE, no keys
    assert got["1/imbalance"] == pytest.approx((counts.max() / counts.mean()).item(), rel=1e-6)
    assert got["1/dropped_fraction"] == pytest.approx((d1 + d2) / (2 * 16), rel=1e-6)
    assert got["1/router_entropy"] == pytest.approx(torch.cat([e1, e2]).mean().item(), rel=1e-5)
    assert got["1/aux_loss"] > 0 and got["1/z_loss"] > 0
    two_ranks = routing_metrics({1: m}, 2, 4, reduce=lambda t: 2 * t, device=torch.device("cpu"))
    for key in ("imbalance", "dropped_fraction", "router_entropy"):
        assert two_ranks[f"1/{key}"] == pytest.approx(got[f"1/{key}"], rel=1e-6)
    for key in ("aux_loss", "z_loss"):   # per token: two identical ranks, the same value
        assert two_ranks[f"1/{key}"] == pytest.approx(got[f"1/{key}"], rel=1e-6)
    reset_routing([m])
    assert routing_metrics({1: m}, 2, 4, reduce=lambda t: t, device=torch.device("cpu")) == {}


def test_shape_inference_forward_is_left_out_of_routing_and_bias_counts():
    """A process's first pipeline step starts with torch's shape-inference forward (on
    uninitialised tensors past the first stage): it must not reach the metrics or the bias
    update."""
    m = _moe()
    m.train()
    x = torch.randn(8, 16)
    from lingua.model import layers

    reset_routing([m])
    layers.set_inferring_shapes(True)  # as lingua.parallel.pipeline.Pipeline marks it
    try:
        m(torch.full((8, 16), 1e3))  # stands for the inference forward's arbitrary values
    finally:
        layers.set_inferring_shapes(False)
    assert m.routing is None and m.step_counts is None
    m(x)
    once = m.routing.clone()
    reset_routing([m])
    m(x)
    assert (torch.equal(m.routing, once)
            and torch.equal(m.step_counts, 2 * m.stats["tokens_per_expert"]))
