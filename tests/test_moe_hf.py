"""apps/moe/hf.py against transformers' own MixtralForCausalLM, Qwen2MoeForCausalLM,
Qwen3MoeForCausalLM and Glm4MoeForCausalLM (tiny random models built from configs: nothing is
downloaded), and the MoE debug preset trained, exported and compared with its Hugging Face
model."""

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from torch.distributed import checkpoint as dcp
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from apps.moe.hf import args_from_hf_config, load_hf, save_hf
from apps.moe.model import MoEArgs, Transformer
from lingua.checkpoint import integrity
from lingua.errors import ConfigError
from lingua.eval.generation import generate
from tests import launcher
from tests.conftest import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
             max_position_embeddings=64, rms_norm_eps=1e-5, num_experts_per_tok=2)
# DeepSeek-V3-style routing in Glm4Moe: sigmoid + selection bias, routed scaling, shared expert,
# first layer dense; "plain" drops renormalisation, shared experts and dense layers.
GLM_CASES = {
    "deepseek": dict(n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True),
    "plain": dict(n_shared_experts=0, first_k_dense_replace=0, norm_topk_prob=False,
                  use_qk_norm=True, attention_bias=True),   # GLM-4.5's q/k/v biases
}


def _randomize(model, seed, norm_noise=0.1):
    """Large random weights: sharp attention and confident routing make layout mistakes visible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + norm_noise * noise if "norm" in name else 0.2 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
    return model.eval()


def mixtral(seed=0, **extra):
    cfg = MixtralConfig(**SHAPE, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                        rope_theta=1e6, attn_implementation="sdpa", **extra)
    return _randomize(MixtralForCausalLM(cfg), seed)


def glm(seed=0, **extra):
    fields = dict(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  n_routed_experts=4, routed_scaling_factor=2.5, n_group=1, topk_group=1,
                  partial_rotary_factor=1.0, attention_bias=False, use_qk_norm=False,
                  rope_theta=50000.0, num_nextn_predict_layers=0)
    cfg = Glm4MoeConfig(**{**SHAPE, **fields, **extra}, attn_implementation="sdpa")
    return _randomize(Glm4MoeForCausalLM(cfg), seed)


def qwen(seed=0, gate=0.0, **extra):
    """Qwen2-MoE as apps.moe exports it: no q/k/v biases, and a zero shared-expert gate (`gate`
    other than 0: a learned one, which our ungated shared experts cannot express)."""
    fields = dict(intermediate_size=96, moe_intermediate_size=32,
                  shared_expert_intermediate_size=64, num_hidden_layers=3, num_experts=4,
                  mlp_only_layers=[0], norm_topk_prob=False, qkv_bias=False, rope_theta=50000.0)
    model = _randomize(Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**SHAPE, **fields, **extra},
                                                          attn_implementation="sdpa")), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("shared_expert_gate.weight"):
                p.fill_(gate)
    return model


def qwen3(seed=0, **extra):
    """Qwen3-MoE of a shape no preset has: 6 experts top-3 renormalised, heads 16 wide in a
    48-wide model of 4 heads (not 12), the first layer dense (mlp_only_layers=[0], our
    n_dense_layers=1), the QK-norms and the other norms far from 1."""
    fields = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-5,
                  intermediate_size=80, moe_intermediate_size=24, num_experts=6,
                  num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0],
                  num_hidden_layers=3, rope_theta=50000.0)
    cfg = Qwen3MoeConfig(**{**fields, **extra}, attn_implementation="sdpa")
    return _randomize(Qwen3MoeForCausalLM(cfg), seed, norm_noise=0.4)


def x_tokens(vocab=300):
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(3))


def _round_trip(hf, cls, tmp_path, atol=1e-4):
    """HF -> save_pretrained -> load_hf -> save_hf -> from_pretrained; all logits equal HF's."""
    hf.save_pretrained(tmp_path / "hf")
    ours, args = load_hf(tmp_path / "hf")
    x = x_tokens()
    with torch.no_grad():
        ref = hf(x).logits
        torch.testing.assert_close(ours(x), ref, atol=atol, rtol=0)
    save_hf(ours, args, tmp_path / "ours")
    back = cls.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref, atol=atol, rtol=0)
    assert load_hf(tmp_path / "ours")[1] == args  # the export reads back as the same MoEArgs
    return ours, args, json.loads((tmp_path / "ours" / "config.json").read_text())


@pytest.mark.parametrize("window", [None, 5])
def test_mixtral_to_ours_and_back(window, tmp_path):
    """Mixtral's sliding window (5 positions of the 40 compared) is our model.window."""
    ours, args, cfg = _round_trip(mixtral(sliding_window=window), MixtralForCausalLM, tmp_path)
    assert args.window == window and cfg["sliding_window"] == window
    shape = (args.dim, args.n_heads, args.n_kv_heads, args.n_layers, args.rope_theta)
    assert shape == (64, 4, 2, 2, 1e6)
    assert (args.n_experts, args.top_k, args.score_func, args.norm_topk) == (4, 2, "softmax", True)
    assert (args.n_shared_experts, args.n_dense_layers, args.route_scale) == (0, 0, 1.0)
    assert ours.layers["0"].moe.experts.w1.shape == (4, 64, 96)
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["intermediate_size"] == 96
    assert cfg["num_local_experts"] == 4


# HF's zero-width shared MLP
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("case", sorted(GLM_CASES))
def test_glm4_moe_to_ours_and_back(case, tmp_path):
    ours, args, cfg = _round_trip(glm(**GLM_CASES[case]), Glm4MoeForCausalLM, tmp_path)
    deepseek = case == "deepseek"
    assert (args.score_func, args.route_scale, args.norm_topk) == ("sigmoid", 2.5, deepseek)
    assert (args.n_shared_experts, args.n_dense_layers) == (int(deepseek), int(deepseek))
    assert args.expert_hidden_dim == 32 and args.n_experts == 4
    assert hasattr(ours.layers["0"], "feed_forward") == deepseek
    assert hasattr(ours.layers["2"], "moe")
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["partial_rotary_factor"] == 1.0
    assert args.qk_norm == args.qkv_bias == (not deepseek)
    assert (cfg["use_qk_norm"], cfg["attention_bias"]) == (not deepseek, not deepseek)
    widths = (cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["routed_scaling_factor"])
    assert widths == (96, 32, 2.5)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_qwen2_moe_to_ours_and_back(qkv_bias, tmp_path):
    """Softmax routing with shared experts and a dense first layer (the debug preset's shape);
    Qwen's q/k/v biases are model.qkv_bias."""
    ours, args, cfg = _round_trip(qwen(qkv_bias=qkv_bias), Qwen2MoeForCausalLM, tmp_path)
    assert args.qkv_bias == cfg["qkv_bias"] == qkv_bias
    assert (args.score_func, args.norm_topk, args.route_scale) == ("softmax", False, 1.0)
    assert (args.n_experts, args.top_k, args.n_shared_experts, args.n_dense_layers) == (4, 2, 2, 1)
    assert args.expert_hidden_dim == 32
    assert ours.layers["1"].moe.shared_experts.w2.weight.shape == (64, 64)
    assert cfg["architectures"] == ["Qwen2MoeForCausalLM"]
    assert cfg["mlp_only_layers"] == [0] and cfg["shared_expert_intermediate_size"] == 64
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        assert not f.get_tensor("model.layers.1.mlp.shared_expert_gate.weight").any()


def test_qwen2_moe_refuses_what_ours_cannot_compute(tmp_path):
    """A learned shared-expert gate, sliding windows and MoE every other layer are named, not
    loaded into a model that would compute something else."""
    qwen(gate=0.3).save_pretrained(tmp_path / "gated")
    with pytest.raises(ConfigError, match=r"shared_expert_gate.weight is non-zero .*ungated"):
        load_hf(tmp_path / "gated")
    qwen().save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for change, message in [({"use_sliding_window": True}, "sliding-window attention"),
                            ({"decoder_sparse_step": 2}, r"dense layers \[0, 2\] .*step=2"),
                            ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
                            ({"shared_expert_intermediate_size": 48},
                             "not a multiple of moe_intermediate_size")]:
        cfg_path.write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=message):
            load_hf(tmp_path)


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE: QK-norm attention with its own head width, renormalised softmax top-k, no shared
# expert. One directory, saved once by transformers, serves the tests below.

@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    hf = qwen3()
    path = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    hf.save_pretrained(path)
    return hf, path


def test_qwen3_moe_to_ours_and_back(qwen3_dir, tmp_path):
    hf, path = qwen3_dir
    ours, args = load_hf(path)
    assert (args.dim, args.n_heads, args.n_kv_heads, args.head_dim) == (48, 4, 2, 16)
    assert (args.qk_norm, args.qkv_bias, args.window) == (True, False, None)
    assert (args.n_experts, args.top_k, args.score_func, args.norm_topk) == (6, 3, "softmax", True)
    assert (args.n_shared_experts, args.n_dense_layers, args.expert_hidden_dim) == (0, 1, 24)
    assert hasattr(ours.layers["0"], "feed_forward") and hasattr(ours.layers["1"], "moe")
    x = x_tokens()
    with torch.no_grad():
        ref = hf(x).logits
        torch.testing.assert_close(ours(x), ref, atol=1e-5, rtol=0)
    save_hf(ours, args, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 6
    assert (cfg["head_dim"], cfg["mlp_only_layers"], cfg["norm_topk_prob"]) == (16, [0], True)
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref, atol=1e-5, rtol=0)
        assert load_hf(tmp_path)[1] == args
        for i in (1, 2):   # not vacuous: without the renormalisation the logits move
            ours.layers[str(i)].moe.router.norm_topk = False
        assert (ours(x) - ref).abs().max() > 1e-2


def test_qwen3_moe_greedy_generation_equals_transformers(qwen3_dir):
    hf, path = qwen3_dir
    ours, _ = load_hf(path)
    prompt = x_tokens()[0, :6].tolist()
    ids = generate(ours, prompt, max_new_tokens=12)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ids == want[0, len(prompt):].tolist() and len(set(ids)) > 3


def test_qwen3_moe_refuses_what_ours_cannot_compute(qwen3_dir, tmp_path):
    """Each refusal names the setting; an unknown model_type names the four it reads."""
    import re

    _, path = qwen3_dir
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    read = ("MixtralForCausalLM ('mixtral'), Glm4MoeForCausalLM ('glm4_moe'), "
            "Qwen2MoeForCausalLM ('qwen2_moe'), Qwen3MoeForCausalLM ('qwen3_moe')")
    for change, message in [
        ({"model_type": "qwen3_next"}, re.escape(f"'qwen3_next' is not supported by apps.moe, "
                                                 f"which reads {read}")),
        ({"attention_bias": True}, r"attention_bias=true \(biases on q/k/v and o_proj"),
        ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window attention"),
        ({"mlp_only_layers": [], "decoder_sparse_step": 2},
         r"dense layers \[0, 2\] from mlp_only_layers=\[\] and decoder_sparse_step=2"),
        ({"mlp_only_layers": [2]}, r"dense layers \[2\]"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=message):
            load_hf(tmp_path)


# The reference loop's optimizer, as the run below is given it (optim.*): torch's AdamW with decay
# on matrices only (the router's and the experts' too), clipping at norm 1, and the lr factor of
# each step under warmup=1 and cosine to 0.1: (step + 1) / 2, then 0.1 + 0.9 * (1 + cos(pi *
# (step - 1) / 2)) / 2. eps 1e-6: at 1e-8 a weight with a ~0 gradient moves by float noise / eps
# (the experts' weights then end 6e-6 apart, not 1.4e-6).
LR, WD, EPS, FACTORS = 3e-3, 0.1, 1e-6, [0.5, 1.0, 0.55]


def test_continued_pretraining_from_a_qwen3_moe_directory(qwen3_dir, corpus, tmp_path):
    """checkpoint.init_from=<dir> with only the data, the run and its optimizer typed: model.* is
    the directory's (over the debug preset's, whose balancing losses it turns off). Three steps in
    fp32 equal transformers' Qwen3MoeForCausalLM (no router aux loss) trained by torch's AdamW on
    the same batches: each step's loss is its mean cross-entropy over the batch's tokens, and the
    run's export reads back in transformers as the reference's weights."""
    from apps.moe import hf as moe_hf
    from apps.moe import train
    from lingua import config, data
    from lingua.checkpoint.hf import RUNTIME_KEYS

    _, path = qwen3_dir
    dump = tmp_path / "run"
    argv = [f"checkpoint.init_from={path}", f"dump_dir={dump}", f"data.root={corpus}",
            "data.prepare_embedded=false", "data.seq_len=64", "data.batch_size=2",
            "data.val_sequences=8", f"steps={len(FACTORS)}", "checkpoint.every=0", "eval.every=0",
            "eval.at_end=false", "logging.every=1", "distributed.model_dtype=fp32",
            f"optim.lr={LR}", "optim.warmup=1",
            "optim.scheduler=cosine", "optim.lr_min_ratio=0.1", f"optim.weight_decay={WD}",
            f"optim.eps={EPS}", "optim.beta1=0.9", "optim.beta2=0.95", "optim.clip=1.0",
            # Routing is discontinuous: the preset's seed 42 draws batches where a token's 3rd
            # and 4th expert probabilities are 3e-6 apart; seed 54's closest are 3e-4 apart.
            "seed=54"]
    args = train.load_config(argv)
    expected = config.to_dict(args_from_hf_config(path / "config.json"))
    assert {k: v for k, v in config.to_dict(args.model).items() if k not in RUNTIME_KEYS} == {
        k: v for k, v in expected.items() if k not in RUNTIME_KEYS}
    assert (args.model.aux_loss_coef, args.model.z_loss_coef, args.model.bias_update_rate) == (
        0, 0, 0)
    assert train.main(argv) == 0

    reference = Qwen3MoeForCausalLM.from_pretrained(path).train()
    assert not reference.config.output_router_logits   # its loss is the cross-entropy alone
    params = list(reference.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    loader = data.build_train_loader(args.data, 0, 1, args.seed)
    losses = []
    for factor in FACTORS:
        (batch,) = loader.next_step()
        logits = reference(batch.tokens).logits   # labels are the tokens shifted: no HF shift
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = LR * factor
        opt.step()
        opt.zero_grad()
    assert [r["loss"] for r in read_metrics(dump) if "loss" in r] == pytest.approx(
        losses, rel=0, abs=1e-5)

    moe_hf.main(["export", str(dump), str(tmp_path / "out")])
    exported = dict(Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    base = dict(Qwen3MoeForCausalLM.from_pretrained(path).named_parameters())
    assert exported.keys() == base.keys()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(exported[name], p, atol=1e-5, rtol=0, msg=name)
    moved = max((p - base[n]).abs().max().item() for n, p in reference.named_parameters())
    assert moved > 1e-3   # the steps changed the weights: equal is not equal to the base


def test_glm4_parity_is_not_vacuous(tmp_path):
    """The selection bias changes which experts are chosen, and the routed scale counts: dropping
    either moves the logits far beyond the 1e-4 of the parity tests."""
    hf = glm(**GLM_CASES["deepseek"])
    hf.save_pretrained(tmp_path)
    ours, args = load_hf(tmp_path)
    x = x_tokens()
    with torch.no_grad():
        ref = hf(x).logits
        h = ours.layers["2"].moe.router(torch.randn(200, 64))
        unbiased = torch.topk(h[2], 2, dim=-1).indices.sort(-1).values
        assert (h[1].sort(-1).values != unbiased).any(-1).float().mean() > 0.2
        unscaled = Transformer(replace(args, route_scale=1.0))
        unscaled.load_state_dict(ours.state_dict())
        assert (unscaled(x) - ref).abs().max() > 1e-2
        for blk in ours.layers.values():
            if hasattr(blk, "moe"):
                blk.moe.router.expert_bias.zero_()
        assert (ours(x) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("make", [mixtral, glm, qwen, qwen3])
def test_fused_and_sharded_layouts(make, tmp_path):
    """transformers 5's fused experts (save_original_format=False) and bf16 shards load too."""
    hf = make()
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in f.keys())
    ours, _ = load_hf(tmp_path / "fused")
    x = x_tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-4, rtol=0)

    hf.to(torch.bfloat16).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    bf16, _ = load_hf(tmp_path / "sharded", dtype=None)
    moe = bf16.layers[str(bf16.args.n_layers - 1)].moe
    assert moe.experts.w1.dtype == torch.bfloat16 and moe.router.expert_bias.dtype == torch.float32


def test_export_refuses_what_hf_cannot_express(tmp_path):
    base = MoEArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, n_experts=4,
                   multiple_of=32, score_func="softmax", norm_topk=True, max_seq_len=64)
    # Softmax routing beyond Mixtral's exports as Qwen2-MoE, and reads back as the same args.
    for change in [{"norm_topk": False}, {"n_shared_experts": 1}, {"n_dense_layers": 1}]:
        args = replace(base, **change)
        save_hf(Transformer(args), args, tmp_path / "qwen")
        cfg = json.loads((tmp_path / "qwen" / "config.json").read_text())
        assert cfg["model_type"] == "qwen2_moe"
        assert load_hf(tmp_path / "qwen")[1] == args
    # QK-norm under softmax routing is Qwen3-MoE, dense first layers and all
    for change in [{"qk_norm": True}, {"qk_norm": True, "norm_topk": False, "n_dense_layers": 1}]:
        args = replace(base, **change)
        save_hf(Transformer(args), args, tmp_path / "qwen3")
        cfg = json.loads((tmp_path / "qwen3" / "config.json").read_text())
        assert cfg["model_type"] == "qwen3_moe"
        assert load_hf(tmp_path / "qwen3")[1] == args
    for change, message in [
        ({"route_scale": 2.0}, "route_scale=2.0 with softmax routing"),
        ({"qk_norm": True, "n_shared_experts": 1},
         "n_shared_experts=1 with model.qk_norm=true and softmax routing"),
        ({"qk_norm": True, "qkv_bias": True},
         "model.qkv_bias=True: Qwen3MoeForCausalLM .* has no q/k/v projection biases alone"),
        ({"window": 8, "n_dense_layers": 1}, "model.window=8: Qwen2MoeForCausalLM"),
        ({"window": 8, "score_func": "sigmoid"}, "model.window=8: Glm4MoeForCausalLM"),
    ]:
        args = replace(base, **change)
        with pytest.raises(ConfigError, match=message):
            save_hf(Transformer(args), args, tmp_path)
    for args, arch in [(base, "MixtralForCausalLM"),
                       (replace(base, n_shared_experts=1), "Qwen2MoeForCausalLM")]:
        model = Transformer(args)
        # what bias_update_rate > 0 leaves behind
        model.layers["1"].moe.router.expert_bias[0] = 0.1
        with pytest.raises(ConfigError,
                           match=f"layer 1's expert_bias is non-zero .*{arch} chooses"):
            save_hf(model, args, tmp_path)
    assert not (tmp_path / "config.json").exists()
    # Capacity dropping is a routing policy, not weights: exported, and read back as HF runs it.
    dropping = replace(base, capacity_factor=1.25)
    with pytest.warns(UserWarning, match="capacity_factor=1.25"):
        save_hf(Transformer(dropping), dropping, tmp_path)
    assert load_hf(tmp_path)[1] == base


def test_load_errors_name_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_hf(tmp_path)
    glm(**GLM_CASES["deepseek"]).save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg["rope_parameters"]
    for change, message in [
        ({"n_group": 2, "topk_group": 1}, "n_group=2, topk_group=1"),
        ({"rope_parameters": {**rope, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
        # use_qk_norm is read; this model has no QK-norm weights
        ({"use_qk_norm": True}, r"model.layers.0.self_attn.q_norm.weight is missing"),
        ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not supported"),
        ({"moe_intermediate_size": 40},
         (r"model.layers.1.mlp.experts.0.gate_proj.weight gives layers.1.moe.experts.w1 of shape "
          r"\(4, 64, 32\) but config.json implies \(4, 64, 40\)")),
        ({"n_routed_experts": 3},
         (r"6 tensor\(s\) in model.safetensors .* would silently drop them: "
          r"model.layers.1.mlp.experts.3.down_proj.weight, ")),
        ({"num_hidden_layers": 4}, "model.layers.3.self_attn.q_proj.weight is missing"),
    ]:
        cfg_path.write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=message):
            load_hf(tmp_path)
    cfg_path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "n_routed_experts"}))
    with pytest.raises(ConfigError, match="lacks 'n_routed_experts'"):
        args_from_hf_config(cfg_path)
    cfg_path.write_text(json.dumps(cfg))
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="No weights in"):
        load_hf(tmp_path)


@pytest.mark.slow
def test_export_cli_from_training_checkpoint(tmp_path):
    """Our own model (DeepSeek-style: sigmoid, biased selection, shared expert, a dense first layer)
    -> DCP checkpoint -> CLI -> Glm4MoeForCausalLM with the same logits."""
    args = MoEArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=32,
                   max_seq_len=64, init_std=0.2, n_experts=4, top_k=2, n_shared_experts=1,
                   expert_hidden_dim=16, n_dense_layers=1, score_func="sigmoid", norm_topk=True,
                   route_scale=1.5, bias_update_rate=1e-3, aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = Transformer(args).eval()
    with torch.no_grad():
        for i in (1, 2):
            model.layers[str(i)].moe.router.expert_bias.copy_(0.5 * torch.randn(4))
    ckpt = tmp_path / "checkpoints" / "10"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt))
    OmegaConf.save(OmegaConf.create({"model": asdict(args)}), ckpt / "config.yaml")
    # what save() adds: export refuses a checkpoint without one
    integrity.write_manifest(ckpt)
    out = tmp_path / "hf"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = launcher.launch("apps.moe.hf", ["export", str(ckpt), str(out)], 0, env, tmp_path,
                           timeout=240)
    assert proc.returncode == 0 and "Glm4MoeForCausalLM" in proc.stdout, proc.stderr
    assert load_hf(out)[1] == args
    hf = Glm4MoeForCausalLM.from_pretrained(out).eval()
    x = x_tokens(258)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=0)

    # Softmax routing with a selection bias: refused from the config, before any weight is read.
    bad_args = replace(args, score_func="softmax", route_scale=1.0)
    OmegaConf.save(OmegaConf.create({"model": asdict(bad_args)}), ckpt / "config.yaml")
    bad = launcher.launch("apps.moe.hf", ["export", str(ckpt), str(tmp_path / "x")], 0, env,
                          tmp_path, timeout=240)
    assert bad.returncode == 2 and "bias_update_rate=0.001 with softmax" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# Nothing dropped silently: an unmapped model tensor or an unconsumed HF tensor is refused.

@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_export_refuses_unmapped_weights(score_func, tmp_path):
    """A weight added to a block (a fork's router bias) is named with the file to edit; Mixtral's
    zero expert_bias (NOT_EXPORTED) is not, and nothing is written."""
    args = MoEArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, n_experts=4,
                   multiple_of=32, max_seq_len=32, score_func=score_func, norm_topk=True)
    model = Transformer(args)
    model.layers["1"].moe.router.register_parameter("gate_bias", torch.nn.Parameter(torch.zeros(4)))
    with pytest.raises(ConfigError) as e:
        save_hf(model, args, tmp_path / "out")
    msg = str(e.value)
    assert "1 tensor(s)" in msg and ": layers.1.moe.router.gate_bias. Map" in msg
    assert "\n" not in msg
    assert "apps/moe/hf.py" in msg and "NOT_EXPORTED" in msg
    assert not (tmp_path / "out").exists()


def _add_tensors(file: Path, extra: dict) -> None:
    from safetensors.torch import load_file, save_file
    save_file({**load_file(str(file)), **extra}, str(file), metadata={"format": "pt"})


# HF's zero-width shared MLP
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_import_refuses_tensors_it_would_drop(tmp_path):
    # Sharded: the names come from each file's header, not from the index's weight_map.
    glm(**GLM_CASES["deepseek"]).save_pretrained(tmp_path / "glm", max_shard_size="40KB")
    shard = sorted((tmp_path / "glm").glob("*.safetensors"))[-1]
    _add_tensors(shard, {"model.layers.2.mlp.gate.bias": torch.zeros(4)})
    with pytest.raises(ConfigError,
                       match=rf"1 tensor\(s\) in {shard.name} .* drop them: "
                             r"model\.layers\.2\.mlp\.gate\.bias\. .*apps/moe/hf\.py"):
        load_hf(tmp_path / "glm")
    # NOT_IMPORTED: RoPE inverse frequencies are recomputed, so not named.
    _add_tensors(shard, {"model.rotary_emb.inv_freq": torch.ones(8)})
    with pytest.raises(ConfigError,
                       match=r"1 tensor\(s\) .* drop them: model\.layers\.2\.mlp\.gate\.bias\. "):
        load_hf(tmp_path / "glm")

    # Glm4Moe without shared experts stores zero-width ones: read (and checked empty), not dropped.
    glm(**GLM_CASES["plain"]).save_pretrained(tmp_path / "plain")
    load_hf(tmp_path / "plain")
    _add_tensors(tmp_path / "plain" / "model.safetensors",
                 {"model.layers.0.mlp.shared_experts.gate_proj.weight": torch.zeros(8, 64)})
    with pytest.raises(ConfigError, match=r"shared_experts.gate_proj.weight has shape \(8, 64\) "
                                          r"but .*n_shared_experts=0"):
        load_hf(tmp_path / "plain")

    # transformers 5's fused Mixtral ("mlp" where we say "block_sparse_moe"): named as in the file.
    hf = mixtral()
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    weights = tmp_path / "fused" / "model.safetensors"
    _add_tensors(weights, {"model.layers.1.mlp.experts.gate_up_bias": torch.zeros(4, 192),
                           "model.rotary_emb.inv_freq": torch.ones(8)})
    with pytest.raises(ConfigError, match=r": model\.layers\.1\.mlp\.experts\.gate_up_bias\. "):
        load_hf(tmp_path / "fused")
    from safetensors.torch import load_file, save_file
    kept = {k: t for k, t in load_file(str(weights)).items() if not k.endswith("gate_up_bias")}
    save_file(kept, str(weights), metadata={"format": "pt"})  # inv_freq stays: it loads
    ours, _ = load_hf(tmp_path / "fused")
    with torch.no_grad():
        torch.testing.assert_close(ours(x_tokens()), hf(x_tokens()).logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# The debug preset exports; options that cannot are said at the start of training.

def _preset_args(corpus, dump, *extra):
    """The MoE debug preset with its model as shipped (softmax top-2 of 8 experts, a shared
    expert, the first layer dense); only the data and the run are made tiny."""
    return [f"dump_dir={dump}", f"data.root={corpus}", "data.prepare_embedded=false",
            "data.seq_len=64", "data.batch_size=2", "data.val_sequences=8", "steps=2",
            "checkpoint.every=2", "eval.every=0", "logging.every=1", *extra]


@pytest.fixture(scope="module")
def debug_run(corpus, tmp_path_factory):
    from apps.moe import train

    dump = tmp_path_factory.mktemp("moe_debug") / "run"
    assert train.main(_preset_args(corpus, dump)) == 0
    return dump


def test_debug_preset_exports_with_the_same_logits(debug_run, tmp_path, capsys):
    from apps.moe.hf import export_problems, main
    from lingua.checkpoint import load_model_state, read_run_config

    ckpt = debug_run / "checkpoints" / "2"
    args = MoEArgs(**OmegaConf.to_container(read_run_config(ckpt).model, resolve=True))
    # the preset's routing, shared expert and dense first layer
    assert (args.score_func, args.n_shared_experts, args.n_dense_layers) == ("softmax", 1, 1)
    assert export_problems(args) == []
    out = tmp_path / "hf"
    main(["export", str(debug_run), str(out)])  # the run directory: its newest checkpoint
    assert f"wrote Qwen2MoeForCausalLM from {ckpt}" in capsys.readouterr().out
    ours = Transformer(args)
    load_model_state(ckpt, ours)
    hf = Qwen2MoeForCausalLM.from_pretrained(out).eval()
    x = x_tokens(258)
    with torch.no_grad():
        ref = hf(x).logits
        torch.testing.assert_close(ref, ours.eval()(x), atol=1e-4, rtol=0)
        for i in range(1, args.n_layers):  # not vacuous: without the gate's factor 2 they differ
            ours.layers[str(i)].moe.shared_experts.w2.weight.mul_(0.5)
        assert (ours(x) - ref).abs().max() > 1e-2
    assert load_hf(out)[1] == replace(args, attn_backend="sdpa")


def test_unexportable_options_warn_at_start_and_export_refuses(
    debug_run, corpus, tmp_path, caplog, capsys
):
    """One warning line from the config check, before any model is built; the export of such a
    run's checkpoint refuses with the same reasons, before reading its weights."""
    import logging
    import shutil

    from apps.moe import hf as moe_hf
    from apps.moe import train

    bad = ["model.route_scale=2.0", "model.bias_update_rate=0.01"]
    with caplog.at_level(logging.WARNING):
        train.load_config(_preset_args(corpus, tmp_path / "plain"))
        # the preset as shipped exports
        assert not [r for r in caplog.records if r.name == "lingua.checkpoint.hf"]
        args = train.load_config(_preset_args(corpus, tmp_path / "bad", *bad))
    warned = [r.getMessage() for r in caplog.records if r.name == "lingua.checkpoint.hf"]
    reasons = moe_hf.export_problems(args.model)
    assert len(reasons) == 2 and "route_scale=2.0" in reasons[0]
    assert "bias_update_rate=0.01" in reasons[1]
    assert len(warned) == 1 and "\n" not in warned[0]
    assert "apps.moe.hf export will refuse" in warned[0]
    assert all(r in warned[0] for r in reasons)

    run = tmp_path / "run"
    shutil.copytree(debug_run, run)
    ckpt = run / "checkpoints" / "2"
    cfg = OmegaConf.load(ckpt / "config.yaml")
    cfg.model.route_scale, cfg.model.bias_update_rate = 2.0, 0.01
    OmegaConf.save(cfg, ckpt / "config.yaml")
    integrity.write_manifest(ckpt)
    with pytest.raises(SystemExit) as e:
        moe_hf.main(["export", str(run), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and all(r in err for r in reasons)
    assert not (tmp_path / "hf").exists()
