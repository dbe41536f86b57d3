"""apps/qwen3_next on one CUDA GPU (skipped without one, and without flash-linear-attention:
`pip install fla-core==0.6.0`, which setup/gpu_wheels.py carries to the lent machine).

What each test would catch:
  -  fla's chunked gated delta rule (model.linear_kernel=fla) computing something else than the
     model's own chunked form in torch: its q/k l2-norm, scale, decay, beta, grouped heads, the
     final state, or any of the five gradients
  -  a compiled bf16 training step with fla's kernel that drifts from the torch path, or that
     waits for the GPU more than once a step (the step's tally)
"""

import functools
import importlib.util

import pytest
import torch

from tests.conftest import read_metrics, tiny_args
from tests.test_gpu import forbid_syncs_but_the_tally

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                       reason="needs flash-linear-attention (pip install fla-core==0.6.0)")]

# bf16 inputs against the fp32 reference, relative to the reference's norm
BF16_RTOL = 2e-2


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fla_rule_equals_the_torch_chunked_rule_forward_and_backward():
    """2 key heads serving 4 value heads, 200 tokens (not a multiple of the 64-token chunk), a
    given initial state: outputs, final state and the gradients of q, k, v, g, beta."""
    from apps.qwen3_next.model import _fla_rule, chunk_gated_delta_rule

    torch.manual_seed(0)
    b, s, hk, hv, d = 2, 200, 2, 4, 64
    q, k = torch.randn(b, s, hk, d, device="cuda"), torch.randn(b, s, hk, d, device="cuda")
    v = torch.randn(b, s, hv, d, device="cuda")
    g = -torch.nn.functional.softplus(torch.randn(b, s, hv, device="cuda"))   # log decay < 0
    beta = torch.rand(b, s, hv, device="cuda")
    state = torch.randn(b, hv, d, d, device="cuda") * 0.1
    do = torch.randn(b, s, hv, d, device="cuda")
    results = []
    fla = functools.partial(_fla_rule, keep_state=True)
    for rule, dtype in ((chunk_gated_delta_rule, torch.float32), (fla, torch.bfloat16)):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        gates = [g.clone().requires_grad_(), beta.to(dtype).requires_grad_()]
        o, final = rule(*inputs, *gates, state.clone())
        (o.float() * do).sum().backward()
        results.append([o, final] + [t.grad for t in inputs + gates])
    names = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta"]
    errors = {n: relative_error(f, t) for n, t, f in zip(names, *results, strict=True)}
    assert all(e < BF16_RTOL for e in errors.values()), errors


def test_a_compiled_bf16_step_with_fla_equals_the_torch_path_and_reads_the_gpu_once(
        corpus, tmp_path, monkeypatch):
    """The debug hybrid (3 Gated DeltaNet : 1 full attention, 2 chunks a sequence) trained 8
    steps in bf16: compiled with fla's kernel, every step after the 3 compiling ones forbidden
    to wait for the GPU but for its tally, against the torch chunked form uncompiled."""
    from apps.qwen3_next import train

    model = ["config=debug", "model.n_layers=4", "model.linear_key_head_dim=64",
             "model.linear_value_head_dim=64", "model.max_seq_len=128"]
    common = ["data.seq_len=128", "data.batch_size=4", "distributed.model_dtype=bf16",
              "logging.every=8", "spikes.policy=log", "checkpoint.every=0"]
    reference = tmp_path / "torch"
    train.main([*model[:1], *tiny_args(corpus, reference, *model[1:], *common,
                                       "model.linear_kernel=torch", steps=8)])
    forbid_syncs_but_the_tally(monkeypatch)
    fla = tmp_path / "fla"
    train.main([*model[:1], *tiny_args(corpus, fla, *model[1:], *common,
                                       "model.linear_kernel=fla", "distributed.compile=true",
                                       steps=8)])
    (want,), (got,) = read_metrics(reference), read_metrics(fla)
    assert got["step"] == want["step"] == 8
    assert got["loss"] == pytest.approx(want["loss"], rel=BF16_RTOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5 * BF16_RTOL)
