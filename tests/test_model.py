import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lingua.errors import ConfigError
from lingua.model.layers import (
    attention,
    check_attn_backend,
    ffn_hidden_dim,
    make_attn_mask,
    rope_cos_sin,
    rope_inv_freq,
)
from lingua.models.llama.model import LlamaArgs, Transformer, validate_model_args

# init_std 0.3 makes attention sharp, so masking or position mistakes show up in the logits.
TINY = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=32,
                 max_seq_len=256, init_std=0.3)


def build(seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(replace(TINY, **kw))


def tokens(b, s, seed=1):
    return torch.randint(0, TINY.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_backward():
    model = build()
    x = tokens(3, 17)
    doc_ids = torch.zeros_like(x)
    doc_ids[:, 9:] = 1
    logits = model(x, doc_ids)
    assert logits.shape == (3, 17, TINY.vocab_size)
    F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert set(model.layers.keys()) == {"0", "1"}
    # Derived buffers stay out of checkpoints.
    assert not any("rope" in k for k in model.state_dict())


def test_meta_build_to_empty_init_is_deterministic():
    def materialize(seed):
        with torch.device("meta"):
            model = Transformer(replace(TINY, n_layers=4))
        assert model.tok_embeddings.weight.is_meta
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        model.init_weights()
        return model

    a, b, c = materialize(0), materialize(0), materialize(1)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)
    plain = Transformer(replace(TINY, n_layers=4))
    assert torch.equal(a.rope_cos, plain.rope_cos) and torch.equal(a.rope_sin, plain.rope_sin)
    x = tokens(2, 8)
    assert torch.equal(a(x), b(x))
    # Output projections shrink with depth: std / sqrt(2 * (layer_id + 1)).
    for i in range(4):
        expected = TINY.init_std / math.sqrt(2 * (i + 1))
        for w in (a.layers[str(i)].attention.wo.weight, a.layers[str(i)].feed_forward.w2.weight):
            assert w.std().item() == pytest.approx(expected, rel=0.06)
        wq_std = a.layers[str(i)].attention.wq.weight.std().item()
        assert wq_std == pytest.approx(TINY.init_std, rel=0.06)
        assert torch.equal(a.layers[str(i)].ffn_norm.weight, torch.ones(TINY.dim))


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build(n_kv_heads=2)
    mha = build(n_kv_heads=4)
    sd = gqa.state_dict()
    hd = TINY.dim // TINY.n_heads
    for i in range(TINY.n_layers):
        for name in ("wk", "wv"):
            key = f"layers.{i}.attention.{name}.weight"
            # kv head j serves query heads 2j and 2j+1: duplicate each head's rows
            sd[key] = (sd[key].view(2, hd, TINY.dim).repeat_interleave(2, dim=0)
                       .reshape(4 * hd, TINY.dim))
    mha.load_state_dict(sd)
    assert gqa.layers["0"].attention.wk.weight.shape == (2 * hd, TINY.dim)
    x = tokens(2, 20)
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=0)


def _doc_ids(s):
    # rows with several documents, one with a single document; boundaries off the 128 grid
    d = torch.zeros(2, s, dtype=torch.long)
    d[0, 5:] = 1
    d[0, 70:] = 2
    d[0, s - 3:] = 3
    d[1, 129 % s:] = 1
    return d


@pytest.mark.parametrize("seq_len", [37, 130])
def test_sdpa_and_flex_agree(seq_len):
    # The attention function in fp32 on unit-scale inputs ...
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, seq_len, 4, 16, generator=gen).unbind(0)
    for doc_ids in (None, _doc_ids(seq_len)):
        ref = attention(q, k, v, "sdpa", make_attn_mask("sdpa", doc_ids, seq_len, q.device))
        out = attention(q, k, v, "flex", make_attn_mask("flex", doc_ids, seq_len, q.device))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # ... and whole models in fp64 (large weights amplify fp32 rounding past 1e-5 in the logits).
    sdpa = build().double()
    flex = build(attn_backend="flex").double()
    flex.load_state_dict(sdpa.state_dict())
    x = tokens(2, seq_len)
    with torch.no_grad():  # flex_attention has no CPU backward
        for doc_ids in (None, _doc_ids(seq_len)):
            torch.testing.assert_close(flex(x, doc_ids), sdpa(x, doc_ids), atol=1e-10, rtol=0)
        assert (sdpa(x, _doc_ids(seq_len)) - sdpa(x)).abs().max() > 1e-2  # the mask matters


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_doc_masking_hides_earlier_documents(backend):
    model = build(attn_backend=backend)
    x = tokens(2, 40)
    doc_ids = torch.zeros_like(x)
    doc_ids[:, 15:] = 1
    changed = x.clone()
    changed[:, :15] = tokens(2, 15, seed=7)
    with torch.no_grad():
        a, b = model(x, doc_ids), model(changed, doc_ids)
        torch.testing.assert_close(a[:, 15:], b[:, 15:], atol=1e-5, rtol=0)
        assert (a[:, :15] - b[:, :15]).abs().max() > 1e-2
        # without document masking the later tokens do see the change
        assert (model(x)[:, 15:] - model(changed)[:, 15:]).abs().max() > 1e-2


def test_sdpa_doc_masking_equals_separate_documents():
    # fp64 with fp64 RoPE tables: positions shift between packed and alone, so fp32 rounding
    # differs.
    model = build().double()
    model.rope_cos, model.rope_sin = rope_cos_sin(rope_inv_freq(16, TINY.rope_theta), 64,
                                                  dtype=torch.float64)
    x = tokens(2, 50)
    doc_ids = _doc_ids(50)
    with torch.no_grad():
        packed = model(x, doc_ids)
        for row in range(2):
            for d in doc_ids[row].unique():
                idx = (doc_ids[row] == d).nonzero().flatten()
                alone = model(x[row:row + 1, idx])  # starts at position 0: RoPE is relative
                torch.testing.assert_close(packed[row:row + 1, idx], alone, atol=1e-9, rtol=0)


def test_rope_llama31_scaling_by_hand():
    # head_dim 8, theta 1e4: inverse frequencies 1, 0.1, 0.01, 0.001 (wavelengths 2*pi*1, 10,
    # 100, 1000).
    plain = rope_inv_freq(8, 10000.0)
    torch.testing.assert_close(plain, torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64))
    # original context 1000, low/high freq factors 1/4: wavelengths < 250 kept, > 1000 divided
    # by 8, between: (1-s)*f/8 + s*f with s = (1000/wavelen - 1) / 3.
    scaled = rope_inv_freq(8, 10000.0, scaling=True, scale_factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_seq_len=1000)
    s = (10 / (2 * math.pi) - 1) / 3  # 0.1971831
    expected = torch.tensor([1.0, 0.1, 0.01 * ((1 - s) / 8 + s), 0.001 / 8], dtype=torch.float64)
    torch.testing.assert_close(scaled, expected, rtol=1e-12, atol=0)
    assert expected[2].item() == pytest.approx(0.002975352, rel=1e-6)
    # and the model's tables use them (rotate_half layout: frequencies repeated twice)
    args = dict(dim=32, n_heads=4, n_kv_heads=4, rope_theta=10000.0, rope_scaling=True,
                rope_original_max_seq_len=1000)
    model = build(**args)
    pos = 7
    freqs = torch.cat([expected, expected])
    torch.testing.assert_close(model.rope_cos[pos], torch.cos(pos * freqs).float(),
                               atol=1e-7, rtol=0)
    torch.testing.assert_close(model.rope_sin[pos], torch.sin(pos * freqs).float(),
                               atol=1e-7, rtol=0)


def test_tied_embeddings_share_the_embedding_matrix():
    tied = build(tie_embeddings=True)
    untied = build(tie_embeddings=False)
    assert tied.output is None and "output.weight" not in tied.state_dict()
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(untied) - n(tied) == TINY.vocab_size * TINY.dim
    sd = tied.state_dict()
    sd["output.weight"] = sd["tok_embeddings.weight"].clone()
    untied.load_state_dict(sd)
    x = tokens(2, 12)
    torch.testing.assert_close(tied(x), untied(x))
    # the one matrix gets gradient from both the input lookup and the output projection
    tied(x).logsumexp(-1).sum().backward()
    # Every vocab row, not just the inputs'.
    assert (tied.tok_embeddings.weight.grad.abs().sum(1) > 0).all()


def test_pipeline_stages_compose_to_the_full_model():
    full = build()
    first, last = build(), build()
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    del first.layers["1"], last.layers["0"]
    first.norm = first.output = None
    last.tok_embeddings = None
    x = tokens(2, 10)
    hidden = first(x)
    assert hidden.shape == (2, 10, TINY.dim)
    torch.testing.assert_close(last(hidden), full(x))


def test_attention_backend_checks():
    with pytest.raises(ConfigError, match="xformers needs a CUDA device"):
        check_attn_backend("xformers", "cpu")
    with pytest.raises(ConfigError, match="no CPU backward"):
        check_attn_backend("flex", "cpu")
    check_attn_backend("flex", "cpu", training=False)
    check_attn_backend("sdpa", "cpu")
    with pytest.raises(ConfigError, match="'flash'"):
        check_attn_backend("flash", "cuda")
    if not torch.cuda.is_available():  # construction itself refuses xformers on a CPU-only machine
        with pytest.raises(ConfigError, match="xformers"):
            build(attn_backend="xformers")
    flex = build(attn_backend="flex")
    with pytest.raises(ConfigError, match="no CPU backward"):
        flex(tokens(1, 8))


@pytest.mark.parametrize("kw, match", [
    (dict(dim=60, n_heads=8), r"model.dim=60 is not divisible by model.n_heads=8"),
    (dict(n_heads=4, n_kv_heads=3),
     r"model.n_heads=4 is not divisible by model.n_kv_heads=3.*divisor of 4"),
    (dict(dim=60, n_heads=4, n_kv_heads=None), r"head width \(15: .* must be positive and even"),
    (dict(dim=64, n_heads=4, head_dim=9), r"head width \(9: .* must be positive and even"),
    (dict(attn_backend="flash"), r"attn_backend='flash'"),
    (dict(n_layers=0), r"model.n_layers=0 must be a positive"),
    (dict(vocab_size=-1), r"model.vocab_size=-1"),
    (dict(n_kv_heads=0), r"model.n_kv_heads=0"),
])
def test_validate_model_args(kw, match):
    with pytest.raises(ConfigError, match=match):
        validate_model_args(replace(TINY, **kw))
    with pytest.raises(ConfigError):
        Transformer(replace(TINY, **kw))


def test_ffn_hidden_dim_matches_meta_llama_sizes():
    assert ffn_hidden_dim(4096, 256) == 11008                # Llama 2 7B
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336          # Llama 3 8B
    assert ffn_hidden_dim(8192, 4096, 1.3) == 28672          # Llama 3 70B
    assert build().layers["0"].feed_forward.w1.weight.shape == (ffn_hidden_dim(64, 32), 64)


def test_model_contract_names_what_a_fork_broke():
    """lingua.model.decoder.check_model_contract, run by the trainer on the meta model at start."""
    from lingua.model.decoder import check_model_contract
    from lingua.models.llama.model import LlamaArgs, Transformer

    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, vocab_size=40, multiple_of=16, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    check_model_contract(model, "lingua/models/llama/model.py", context_parallel=True)

    class NoPositions(Transformer):
        def forward(self, tokens, doc_ids=None, cache=None):
            return super().forward(tokens, doc_ids, cache)

    with torch.device("meta"):
        broken = NoPositions(args)
    with pytest.raises(ConfigError, match=r"apps/fork/model.py.*forward\(\) takes no `positions`"):
        check_model_contract(broken, "apps/fork/model.py")
    with torch.device("meta"):
        renamed = Transformer(args)
    # Its own kernel call: CP cannot reach it.
    renamed.layers["1"].attention.core = torch.nn.Identity()
    check_model_contract(renamed, "apps/fork/model.py")       # fine without CP
    with pytest.raises(ConfigError, match=r"layer 1 .*does not attend through "
                                          r"lingua.model.layers.CoreAttention"):
        check_model_contract(renamed, "apps/fork/model.py", context_parallel=True)
