"""The MoE layer's dispatch and combine (lingua/model/moe.py: the token gather and the slot gather
with their own backwards) against a per-token reference written with plain autograd: outputs and the
gradients of the input, the router and the experts, dropless and with capacity drops, in fp32 and
under bf16 autocast."""

import pytest
import torch
import torch.nn.functional as F

from lingua.model.moe import MoE


def _moe(**kw):
    torch.manual_seed(0)
    m = MoE(**{**dict(dim=16, hidden=24, n_experts=4, top_k=2), **kw})
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def _reference(m: MoE, x):
    """Token by token: each (token, expert) slot kept unless its expert already took `cap` earlier
    tokens; output = sum of kept slots' weight * expert FFN of the token."""
    scores = F.linear(x, m.router.gate.weight).softmax(-1)
    weights, experts = torch.topk(scores, m.top_k, -1)
    cap = float("inf")
    if m.capacity_factor > 0:
        cap = -(-m.capacity_factor * x.shape[0] * m.top_k // m.n_experts)
    taken = [0] * m.n_experts
    rows = []
    ex = m.experts
    for t in range(x.shape[0]):
        out = x.new_zeros(x.shape[1])
        for j in range(m.top_k):
            e = int(experts[t, j])
            if taken[e] < cap:
                taken[e] += 1
                h = F.silu(x[t] @ ex.w1[e]) * (x[t] @ ex.w3[e])
                out = out + weights[t, j] * (h @ ex.w2[e])
        rows.append(out)
    return torch.stack(rows)


def _grads(m, x, fn, r):
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    (out.float() * r).sum().backward()
    return [out.float(), x.grad, m.router.gate.weight.grad, m.experts.w1.grad, m.experts.w2.grad]


@pytest.mark.parametrize("capacity_factor", [0.0, 0.6])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dispatch_and_combine_gradients_match_reference(capacity_factor, top_k):
    m = _moe(top_k=top_k, capacity_factor=capacity_factor)
    torch.manual_seed(1)
    x, r = torch.randn(13, 16), torch.randn(13, 16)
    ours = _grads(m, x, m, r)
    ref = _grads(m, x, lambda t: _reference(m, t), r)
    if capacity_factor:
        assert m.stats["dropped_fraction"] > 0  # some slots were dropped
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_dispatch_and_combine_under_bf16_autocast():
    m = _moe(top_k=2)
    torch.manual_seed(1)
    x, r = torch.randn(13, 16), torch.randn(13, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _grads(m, x, m, r)
    ref = _grads(m, x, lambda t: _reference(m, t), r)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=0.15, rtol=0.05)
