"""apps/qwen3_next against transformers' Qwen3NextForCausalLM (a tiny random model built from a
config of shapes no other test uses: nothing is downloaded), the delta rule's two forms against
each other and transformers' token-by-token one, decoding through KVCache.states, and a short
training run with its export, generation and continued pretraining from the export.

The HF side is independent: its fused in_proj_qkvz / in_proj_ba / conv1d, gated attention,
zero-centred norms and shared-expert gate are transformers' code; ours reach it only through the
safetensors files and config.json."""

import json

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from apps.qwen3_next import train
from apps.qwen3_next.hf import load_hf, main, save_hf
from apps.qwen3_next.model import (
    Qwen3NextArgs,
    Transformer,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from lingua import config
from lingua.checkpoint import hf as lingua_hf
from lingua.errors import ConfigError
from lingua.eval.generation import generate
from lingua.model.layers import KVCache
from tests.conftest import read_metrics, tiny_args

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
             moe_intermediate_size=32, shared_expert_intermediate_size=48,
             max_position_embeddings=128, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                              "partial_rotary_factor": 0.25})


def hf_model(seed: int = 0) -> Qwen3NextForCausalLM:
    """Every weight away from its init: matrices by 0.05 normal noise, norms, gates and the decay
    parameters by 0.1 (zero-centred norms then scale by 1 + w, w != 0). Larger matrices make the
    fp32 delta rule itself ill-conditioned (its fp32 and fp64 results part by 1e-5)."""
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**SHAPE, attn_implementation="sdpa"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            small = "norm" in name or "A_log" in name or "dt_bias" in name
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if small else 0.05))
    return model.eval()


def tokens(n: int = 70):   # longer than one 64-token chunk, not a multiple of it
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF model, our load of its save_pretrained directory, args, that directory)."""
    hf = hf_model()
    path = tmp_path_factory.mktemp("qwen3_next_hf")
    hf.save_pretrained(path)
    ours, args = load_hf(path)
    return hf, ours.eval(), args, path


def test_logits_equal_transformers_both_ways(pair, tmp_path):
    hf, ours, args, _ = pair
    assert (args.full_attention_every, args.partial_rotary_factor) == (4, 0.25)
    assert [b.is_full for b in ours.layers.values()] == [False, False, False, True]
    x = tokens()
    with torch.no_grad():
        ref = hf(x).logits
        torch.testing.assert_close(ours(x), ref, atol=1e-5, rtol=1e-5)
    save_hf(ours, args, tmp_path / "ours")
    back = Qwen3NextForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x).logits, ref, atol=1e-5, rtol=1e-5)
    again, args_again = load_hf(tmp_path / "ours")
    assert args_again == args
    state = ours.state_dict()
    assert all(torch.equal(t, state[k]) for k, t in again.state_dict().items())
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("length,chunk", [(37, 16), (64, 16), (5, 64)])
def test_chunked_delta_rule_equals_the_recurrence(length, chunk):
    """The chunked WY form (training) against our token-by-token recurrence (decoding) and
    transformers' one, from a non-zero state, with grouped heads (2 key heads, 4 value heads)."""
    g = torch.Generator().manual_seed(length)
    b, hk, hv, dk, dv = 2, 2, 4, 8, 12
    q, k = (torch.randn(b, length, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, length, hv, dv, generator=g)
    decay = -torch.rand(b, length, hv, generator=g)     # log decay, <= 0
    beta = torch.rand(b, length, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g)
    out, final = chunk_gated_delta_rule(q, k, v, decay, beta, state, chunk=chunk)
    ref, ref_final = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
    theirs, their_final = torch_recurrent_gated_delta_rule(
        q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ref, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_final, their_final, atol=1e-5, rtol=1e-5)


def test_decoding_through_the_cache_equals_the_cache_free_forward(pair):
    """A prompt in one pass, then token by token through KVCache (keys and values for the full
    layer, the convolutions' inputs and the delta rule's state for the others): the logits of
    every position equal one forward over the whole sequence."""
    _, ours, args, _ = pair
    seq = tokens(12)[:1]
    cache = KVCache(ours.layers.keys(), 1, 12)
    with torch.no_grad():
        full = ours(seq)
        steps = [ours(seq[:, :5], cache=cache)]
        steps += [ours(seq[:, i:i + 1], cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    state = cache.states["0"]
    assert state["recurrent"].shape == (1, args.linear_value_heads, args.linear_key_head_dim,
                                        args.linear_value_head_dim)
    assert state["q_conv"].shape == (1, args.linear_key_heads * args.linear_key_head_dim,
                                     args.linear_conv_kernel - 1)
    assert cache.kv["0"] is None and cache.kv["3"][0].shape[1] == 12


def test_greedy_generation_equals_transformers(pair):
    hf, ours, _, _ = pair
    prompt = tokens(6)[0].tolist()
    ids = generate(ours, prompt, max_new_tokens=10)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ids == want[0, len(prompt):].tolist()


def test_import_command_and_refusals(pair, tmp_path, capsys):
    _, _, args, path = pair
    main(["import", str(path)])
    out = capsys.readouterr().out
    assert f"checkpoint.init_from={path}" in out and "linear_value_heads: 4" in out
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    for change, needle in [({"mlp_only_layers": [1]}, "mlp_only_layers"),
                           ({"layer_types": ["full_attention"] + ["linear_attention"] * 3},
                            "layer_types"),
                           ({"model_type": "qwen3_moe"}, "is not 'qwen3_next'")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=needle):
            load_hf(tmp_path)


def test_bad_model_args_and_layouts_are_refused(corpus, tmp_path):
    for bad, needle in [(dict(linear_value_heads=3), "multiple of"),
                        (dict(partial_rotary_factor=0.1), "even"),
                        (dict(attn_mask="block_causal"), "documents apart"),
                        (dict(rope_scaling=True), "rope_scaling")]:
        with pytest.raises(ConfigError, match=needle):
            Transformer(Qwen3NextArgs(**bad))
    for extra, needle in [("distributed.cp=2", "recurrent state"),
                          ("distributed.tp=4", "linear_key_heads"),
                          ("model.linear_kernel=fla", "CUDA")]:
        with pytest.raises(ConfigError, match=needle):
            train.load_config(tiny_args(corpus, tmp_path, *MODEL, extra))


# ---------------------------------------------------------------------------------------------
# Training, and what uses its checkpoint

MODEL = ["model.n_layers=4", "model.head_dim=24", "model.linear_key_head_dim=16",
         "model.linear_value_head_dim=16", "model.n_experts=4", "model.expert_hidden_dim=32",
         "model.shared_expert_hidden_dim=32", "model.aux_loss_coef=0.01"]


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("qwen3_next_run") / "run"
    train.main(["config=debug", *tiny_args(corpus, dump, *MODEL, "checkpoint.every=20",
                                           "data.batch_size=4", steps=20)])
    return dump


def test_trains_exports_generates_and_continues_from_the_export(run, tmp_path, capsys):
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5 and "moe/0/imbalance" in rows[-1]
    out = tmp_path / "hf"
    main(["export", str(run), str(out)])
    assert "wrote Qwen3NextForCausalLM" in capsys.readouterr().out
    from apps.qwen3_next.generate import load_model

    ours, _ = load_model(str(run))
    theirs = Qwen3NextForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    x = tokens(20) % 258
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, atol=1e-5, rtol=1e-5)
    from apps.qwen3_next.generate import main as generate_main

    generate_main([str(run), "--prompt", "Once upon", "--max-new-tokens", "4"])
    assert "completion:" in capsys.readouterr().out
    # continued pretraining: the export's config.json gives the shape, nothing typed
    args = train.load_config([f"checkpoint.init_from={out}", f"dump_dir={tmp_path / 'cont'}"],
                             check=False)
    shape = lambda a: {k: v for k, v in config.to_dict(a).items()   # noqa: E731
                       if k not in lingua_hf.RUNTIME_KEYS}
    assert shape(args.model) == shape(ours.args)
