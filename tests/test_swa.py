"""apps/swa: sliding-window attention with learned attention sinks (as gpt-oss), a fork of LLaMA
whose only core dependency is the mask seam (lingua/model/masks.py: the model's AttentionMask)
and CoreAttention's `sinks`.

Checked here: each CPU backend (sdpa with gradients, flex forward: it has no CPU backward)
against a dense reference written below (an explicit softmax with -inf outside the window and
across documents, the sink logit appended as a column and dropped); decoding with the KV cache
against the cache-free forward; the refusals of what xformers and torch's ring CP cannot do;
equivalence with one process under fsdp2, tp2 and cp2 (tests/equivalence.py), with the window
smaller than the rows and document masking on, and that the window changes the loss, so that a
layout which lost it (cp's mask before the seam) would fail.
"""

import pytest
import torch

from apps.swa import train
from apps.swa.model import SWAArgs, Transformer, validate_model_args
from lingua.errors import ConfigError
from lingua.model.layers import CoreAttention, KVCache, check_xformers_mask, make_attn_mask
from lingua.model.masks import AttentionMask
from lingua.parallel.context_parallel import apply_cp
from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import RTOL, assert_equivalent, read_rows

STEPS = 3
# Rows of 64 tokens, a 16-token window; documents kept apart.
MASKED = ["model.window=16", "model.sinks=true", "model.attn_mask=block_causal"]


def reference_attention(q, k, v, doc_ids, window, sink_tokens, sinks):
    """q [b, s, h, d], k/v [b, s, h_kv, d] -> [b, s, h, d], written out position by position."""
    b, s, h, d = q.shape
    k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
    seen = torch.zeros(b, s, s, dtype=torch.bool)
    for r in range(b):
        for i in range(s):
            for j in range(i + 1):
                near = i - j < window or j < sink_tokens
                seen[r, i, j] = near and bool(doc_ids[r, i] == doc_ids[r, j])
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / d ** 0.5
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    column = sinks.view(1, h, 1, 1).expand(b, h, s, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :s]
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def inputs(s=24, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, s, 4, 8, generator=gen)
    k, v = torch.randn(2, 2, s, 2, 8, generator=gen).unbind(0)     # grouped-query: 2 kv heads
    sinks = torch.randn(4, generator=gen)
    doc_ids = torch.zeros(2, s, dtype=torch.long)
    doc_ids[0, 9:], doc_ids[0, 20:] = 1, 2
    return [t.requires_grad_(requires_grad) for t in (q, k, v, sinks)], doc_ids


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("sink_tokens", [0, 2])
def test_backends_match_a_dense_reference(backend, sink_tokens):
    """Window 5 of 24 positions, three documents in a row, learned sinks, grouped-query heads."""
    train_too = backend == "sdpa"   # flex_attention has no CPU backward
    (q, k, v, sinks), doc_ids = inputs(requires_grad=train_too)
    spec = AttentionMask(window=5, sink_tokens=sink_tokens)
    with torch.set_grad_enabled(train_too):
        mask = make_attn_mask(backend, doc_ids, q.shape[1], q.device, spec)
        out = CoreAttention(backend)(q, k, v, mask, sinks=sinks)
        ref = reference_attention(q, k, v, doc_ids, 5, sink_tokens, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if train_too:
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v, sinks), grad)
        want = torch.autograd.grad(ref, (q, k, v, sinks), grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # Not vacuous: without the window or without the sinks the output differs.
    no_sinks = reference_attention(q, k, v, doc_ids, 5, sink_tokens, sinks - 1e4)
    no_window = reference_attention(q, k, v, doc_ids, 24, sink_tokens, sinks)
    assert (no_sinks - ref).abs().max() > 1e-2 and (no_window - ref).abs().max() > 1e-2


def test_decoding_with_the_cache_equals_the_forward():
    """A window of 4 over 14 tokens: the prompt (6 tokens) in one pass, then one token at a time,
    each step's logits equal the whole sequence's forward at those positions."""
    torch.manual_seed(0)
    args = SWAArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, multiple_of=16,
                   max_seq_len=32, window=4, sink_tokens=1)
    model = Transformer(args).double()
    with torch.no_grad():
        for layer in model.layers.values():   # sinks that matter (they start at zero)
            layer.attention.sinks.weight.normal_()
        tokens = torch.randint(0, 40, (2, 14))
        full = model(tokens)
        cache = KVCache(model.layers.keys(), 2, 14)
        steps = [model(tokens[:, :6], cache=cache)]
        steps += [model(tokens[:, i:i + 1], cache=cache) for i in range(6, 14)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=0)
        model.mask_spec = AttentionMask()
        assert (model(tokens) - full)[:, 5:].abs().max() > 1e-3   # the window matters


def test_what_a_backend_cannot_do_is_refused_by_name():
    check_xformers_mask(AttentionMask(window=8))        # causal, document-causal and local: fine
    for spec, sinks in ((AttentionMask(window=8, sink_tokens=2), False),
                        (AttentionMask(causal=False), False), (AttentionMask(window=8), True)):
        with pytest.raises(ConfigError, match="attn_backend=xformers.*Use model.attn_backend=flex"):
            check_xformers_mask(spec, sinks)
    with pytest.raises(ConfigError, match="xformers.*learned sinks"):
        validate_model_args(SWAArgs(attn_backend="xformers", window=8, sinks=True))
    with pytest.raises(ConfigError, match="model.window=0"):
        validate_model_args(SWAArgs(window=0))
    with torch.device("meta"):
        model = Transformer(SWAArgs(dim=32, n_layers=1, n_heads=4, window=8, sinks=False))
    with pytest.raises(ConfigError, match="cp_backend=ring cannot apply the model's mask"):
        apply_cp(model, None, "ring")     # refused before any mesh or kernel is touched
    with pytest.raises(ConfigError, match="cp_backend=ring with model.window=16"):
        train.validate_swa(train.load_config(
            ["model.window=16", "distributed.cp=2", "distributed.cp_backend=ring"], check=False))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("swa_reference") / "run"
    train.main(tiny_args(corpus, dump, "data.batch_size=8", *MASKED, steps=STEPS))
    return dump


def test_the_window_changes_the_loss(corpus, tmp_path, reference):
    """Full causal attention from the same weights and batch: the first step's loss and gradient
    norm far outside assert_equivalent's tolerance, so a layout that lost the window (as cp did
    before the mask seam) fails below."""
    full = tmp_path / "run"
    train.main(tiny_args(corpus, full, "data.batch_size=8", *MASKED, "model.window=null", steps=1))
    got, want = read_rows(full)[0], read_rows(reference)[0]
    for key, factor in (("loss", 10), ("grad_norm", 100)):
        assert abs(got[key] - want[key]) > factor * RTOL * want[key], (key, got[key], want[key])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [
    ["distributed.dp_shard=2", "data.batch_size=4"],
    ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=8"],
    ["distributed.cp=2", "distributed.dp_shard=1", "data.batch_size=8"],
], ids=["fsdp2", "tp2", "cp2"])
def test_layout_matches_one_process(corpus, tmp_path, reference, layout):
    dump = tmp_path / "run"
    run_torchrun(2, "apps.swa.train", tiny_args(corpus, dump, *MASKED, *layout, steps=STEPS))
    assert_equivalent(dump, reference)


def test_mfu_counts_attention_over_the_window():
    """FLOPs per token: the core's count with a row's attention cut to the window's keys."""
    from lingua.observe import metrics

    args = train.load_config(["model.window=16", "data.seq_len=64"], check=False)
    with torch.device("meta"):
        model = Transformer(args.model)
    m = args.model
    whole = metrics.flops_per_token(model, m.n_layers, m.dim, 64)
    assert train.flops_per_token(args) == whole - 12 * m.n_layers * m.dim * (64 - 16)
