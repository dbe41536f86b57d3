"""The loss as training calls it (lingua.model.loss.for_training): compiled under
distributed.compile=true, with the same values and gradients as the eager loss for every app, and
the memory the compiled cross-entropy is for (it keeps the logits in their own dtype, not fp32
log-probabilities)."""

import pytest
import torch

from lingua.model import loss as loss_module
from tests.conftest import saved_tensor_bytes

VOCAB = 1000


def _apps():
    from apps.deepseek.model import DeepSeekArgs
    from apps.deepseek.train import batch_inputs as deepseek_inputs
    from apps.deepseek.train import make_app as make_deepseek_app
    from apps.llama.train import APP as llama
    from apps.moe.train import APP as moe
    from apps.mtp.model import MTPArgs
    from apps.mtp.train import batch_inputs as mtp_inputs
    from apps.mtp.train import make_app

    b, s = 2, 16
    labels = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))
    _, mtp_target = mtp_inputs(labels, labels, 2)
    _, deepseek_target = deepseek_inputs(labels, labels, 1)
    return {
        "llama": (llama.loss, lambda: torch.randn(b, s, VOCAB), labels),
        "moe": (moe.loss, lambda: (torch.randn(b, s, VOCAB), torch.rand(3)), labels),
        "mtp": (make_app(MTPArgs(mtp_depth=2)).loss, lambda: torch.randn(3, b, s, VOCAB),
                mtp_target),
        # one MTP depth, and the MoE balancing losses beside the logits
        "deepseek": (make_deepseek_app(DeepSeekArgs(mtp_depth=1)).loss,
                     lambda: (torch.randn(2, b, s, VOCAB), torch.rand(1)), deepseek_target),
    }


def _leaf_copies(output):
    """A copy of the model output (a tensor or a tuple of them) made of fresh leaves that take
    gradients, and the list of those leaves."""
    tensors = output if isinstance(output, tuple) else (output,)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    return (tuple(leaves) if isinstance(output, tuple) else leaves[0]), leaves


@pytest.mark.slow
@pytest.mark.parametrize("app", ["llama", "moe", "mtp", "deepseek"])
def test_compiled_loss_matches_the_eager_one_in_one_graph(app):
    import torch._dynamo

    loss, make_output, target = _apps()[app]
    torch.manual_seed(1)
    output = make_output()
    eager_in, eager_leaves = _leaf_copies(output)
    compiled_in, compiled_leaves = _leaf_copies(output)

    compiled = loss_module.for_training(loss, compile=True, backend="inductor", loss_parallel=False)
    assert compiled is not loss
    explained = torch._dynamo.explain(loss)(compiled_in, target)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    want, got = loss(eager_in, target), compiled(compiled_in, target)
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-5, atol=1e-3)
    assert int(got.tokens) == int(want.tokens)
    if want.logged_sum is not None:
        torch.testing.assert_close(got.logged_sum, want.logged_sum, rtol=1e-5, atol=1e-3)
    assert set(got.metrics) == set(want.metrics)
    for name, (value, count) in want.metrics.items():
        torch.testing.assert_close(got.metrics[name][0], value, rtol=1e-5, atol=1e-3)
        assert int(got.metrics[name][1]) == int(count)
    want.loss_sum.backward()
    got.loss_sum.backward()
    for e, c in zip(eager_leaves, compiled_leaves):
        torch.testing.assert_close(c.grad, e.grad, rtol=1e-5, atol=1e-6)


def test_the_loss_stays_eager_without_compile_or_under_loss_parallelism():
    from apps.llama.train import APP

    assert loss_module.for_training(APP.loss, compile=False, backend="inductor",
                                    loss_parallel=False) is APP.loss
    assert loss_module.for_training(APP.loss, compile=True, backend="inductor",
                                    loss_parallel=True) is APP.loss


def _saved_bytes(fn, logits, labels) -> int:
    """Bytes of the tensors autograd keeps for backward while fn runs (tests.conftest)."""
    return saved_tensor_bytes(lambda: fn(logits, labels).loss_sum.backward())


@pytest.mark.slow
def test_compiled_cross_entropy_keeps_bf16_logits_not_fp32_log_probabilities():
    """What for_training's compile is for: eager cross-entropy of bf16 logits keeps the fp32
    log-probabilities (4 bytes per logit) for backward; compiled it keeps at most the bf16 logits
    (2 bytes) and a few values per row."""
    from apps.llama.train import APP

    tokens = 64
    logits = torch.randn(1, tokens, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, tokens))
    eager = _saved_bytes(APP.loss, logits, labels)
    compiled = _saved_bytes(loss_module.for_training(APP.loss, True, "inductor", False), logits,
                            labels)
    assert eager >= 4 * tokens * VOCAB, eager
    assert compiled <= 2 * tokens * VOCAB + 64 * tokens, compiled


@pytest.mark.parametrize("device", [
    "cpu",
    # The GPU runbook's check that inductor's Triton code for it agrees too.
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_token_loss_sum_is_cross_entropy_with_its_gradient(dtype, device):
    """Under torch.compile token_loss_sum takes its written-out cross-entropy (one pass over the
    logits in backward, the target's entry written over it): the sum and the gradient are
    F.cross_entropy's, with ignored targets (-100, as MTP's) counting for nothing even where
    their row holds -inf or NaN logits."""
    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx



    torch._dynamo.reset()
    try:
        gen = torch.Generator().manual_seed(3)
        logits = (4 * torch.randn(2, 24, VOCAB, generator=gen)).to(dtype)
        logits[0, 0, 7] = 60.0                     # a row whose softmax is ~1 at its target
        labels = torch.randint(0, VOCAB, (2, 24), generator=gen)
        labels[0, 0] = 7
        labels[1, 5:9] = loss_module.IGNORE_INDEX
        logits[1, 5, 0] = float("-inf")            # ignored rows: a masked column, a NaN
        logits[1, 6, 3] = float("nan")
        logits, labels = logits.to(device), labels.to(device)
        eager_in, compiled_in = (logits.clone().requires_grad_() for _ in range(2))
        want = torch.nn.functional.cross_entropy(eager_in.flatten(0, 1).float(), labels.flatten(),
                                                 reduction="sum")
        graphs = []

        def inductor_recording(gm, example_inputs):
            graphs.append(gm)
            return compile_fx(gm, example_inputs)

        got = torch.compile(loss_module.token_loss_sum,
                            backend=inductor_recording)(compiled_in, labels)
        calls = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        assert "autograd_function_apply" in calls, calls  # ours, not F.cross_entropy traced
        assert torch.isfinite(want) and torch.isfinite(got)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        (0.5 * want).backward()
        (0.5 * got).backward()
        assert compiled_in.grad.dtype == dtype
        assert (compiled_in.grad[1, 5:9] == 0).all()
        # Eager's gradient is NaN on the ignored NaN row (log_softmax's backward multiplies
        # its NaN probabilities by the zero gradient); ours is zero there. The rest must agree.
        assert eager_in.grad[1, 6].isnan().any()
        eager_in.grad[1, 6] = 0
        # bf16: the same fp32 arithmetic rounded once, as eager's; only the logsumexp's order of
        # summation differs, so at most one bf16 step apart.
        tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
        torch.testing.assert_close(compiled_in.grad, eager_in.grad, **tol)
    finally:
        torch._dynamo.reset()
