"""apps/deepseek against transformers' DeepseekV3ForCausalLM (tiny random models built from
configs: nothing is downloaded), and trained: every parallel layout against one process through
tests/equivalence.py, generation with the latent cache, export and import.

The HF side is independent: its MLA, interleaved RoPE, group-limited sigmoid router and YaRN are
transformers' code; ours reach it only through the safetensors files and config.json."""

import json
import shutil

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from apps.deepseek import train
from apps.deepseek.hf import load_hf, main, save_hf
from apps.deepseek.model import DeepSeekArgs, Transformer
from lingua.errors import ConfigError
from lingua.eval.generation import generate
from lingua.model.layers import KVCache
from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows
from tests.test_moe_hf import _randomize

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, vocab_size=300,
             max_position_embeddings=64, rms_norm_eps=1e-6, intermediate_size=96,
             moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
             topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, rope_theta=10000.0)
# YaRN as DeepSeek-V3 configures it, stretching an original context shorter than the test's.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16}
CASES = {"q_latent_yarn": dict(q_lora_rank=24, rope_parameters=YARN),
         "no_q_latent": dict(q_lora_rank=None)}


def hf_model(case: str, seed: int = 0) -> DeepseekV3ForCausalLM:
    """Large random weights and a non-zero selection bias (test_moe_hf's): sharp attention and
    confident routing make a layout mistake visible."""
    cfg = DeepseekV3Config(**SHAPE, **CASES[case], attn_implementation="sdpa")
    return _randomize(DeepseekV3ForCausalLM(cfg), seed)


def tokens(n: int = 40):
    return torch.randint(0, 300, (2, n), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(HF model, our load of its save_pretrained directory, args, that directory)."""
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, args = load_hf(path)
    return hf, ours.eval(), args, path


def test_logits_equal_transformers_both_ways(pair, tmp_path):
    hf, ours, args, _ = pair
    x = tokens()
    with torch.no_grad():
        ref = hf(x).logits
        torch.testing.assert_close(ours(x), ref, atol=1e-5, rtol=1e-5)
    assert (args.n_groups, args.topk_groups) == (4, 2)
    assert args.yarn == (args.q_lora_rank is not None)
    save_hf(ours, args, tmp_path / "ours")
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x).logits, ref, atol=1e-5, rtol=1e-5)
    again, args_again = load_hf(tmp_path / "ours")
    assert args_again == args
    state = ours.state_dict()
    assert all(torch.equal(t, state[k]) for k, t in again.state_dict().items())
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["rope_interleave"] is True


def test_group_limited_routing_and_bias_matter(pair):
    """Parity is not vacuous: dropping the group limit or the selection bias changes the
    logits beyond the tolerance."""
    hf, ours, _, _ = pair
    x = tokens()
    with torch.no_grad():
        ref = hf(x).logits
        router = ours.layers["1"].moe.router
        router.topk_groups = router.n_groups
        assert (ours(x) - ref).abs().max() > 1e-3
        router.topk_groups = 2
        bias = router.expert_bias.clone()
        router.expert_bias.zero_()
        assert (ours(x) - ref).abs().max() > 1e-3
        router.expert_bias.copy_(bias)


def test_greedy_generation_equals_transformers_and_cache_free_decoding(pair):
    hf, ours, args, _ = pair
    prompt = tokens(6)[0].tolist()
    ids = generate(ours, prompt, max_new_tokens=10)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ids == want[0, len(prompt):].tolist()
    seq = list(prompt)   # no cache: the whole sequence again at every step
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
    assert seq[len(prompt):] == ids
    # MLA's cache: per layer the latent and the rope key, not per-head keys and values
    cache = KVCache(ours.layers.keys(), 1, 16)
    with torch.no_grad():
        ours(torch.tensor([prompt]), cache=cache)
    latent, rope_key = cache.kv["0"]
    assert latent.shape == (1, 16, 1, args.kv_lora_rank)
    assert rope_key.shape == (1, 16, 1, args.qk_rope_head_dim)


def test_import_command_prints_the_model_section(pair, capsys):
    _, _, args, path = pair
    main(["import", str(path)])
    out = capsys.readouterr().out
    assert f"checkpoint.init_from={path}" in out and "every tensor mapped" in out
    assert "sets this model section from the directory by itself" in out   # nothing to copy
    assert f"kv_lora_rank: {args.kv_lora_rank}" in out and "n_groups: 4" in out


def test_init_from_alone_trains_from_the_directorys_shape(corpus, tmp_path):
    """checkpoint.init_from=<dir> with no model.* typed (issue 58): the run takes the directory's
    shape (3 layers of 64, 8 experts, YaRN, eps 1e-6, none of them the debug preset's; no MTP
    module, as save_pretrained wrote none), and its first loss is transformers' on the same batch.
    A shape typed that disagrees with the directory is refused, naming the key."""
    from apps.deepseek.hf import args_from_hf_config
    from lingua import config, data
    from lingua.checkpoint.hf import RUNTIME_KEYS
    from lingua.model.loss import token_loss_sum

    hf = hf_model("q_latent_yarn", seed=1)
    hf.save_pretrained(tmp_path / "hf")
    dump = tmp_path / "run"
    common = [f"checkpoint.init_from={tmp_path / 'hf'}", f"data.root={corpus}",
              "data.prepare_embedded=false", "data.seq_len=32", "data.batch_size=2",
              "data.val_sequences=8", "steps=1", "checkpoint.every=0", "eval.every=0",
              "eval.at_end=false", "logging.every=1", "distributed.model_dtype=fp32"]
    argv = [f"dump_dir={dump}", *common]
    args = train.load_config(argv)
    theirs = config.to_dict(args_from_hf_config(tmp_path / "hf" / "config.json"))
    ours = config.to_dict(args.model)
    assert {k: v for k, v in ours.items() if k not in RUNTIME_KEYS | {"mtp_depth"}} == {
        k: v for k, v in theirs.items() if k not in RUNTIME_KEYS | {"mtp_depth"}}
    assert (ours["n_layers"], ours["dim"], ours["yarn"], ours["norm_eps"]) == (3, 64, True, 1e-6)
    assert (theirs["mtp_depth"], ours["mtp_depth"]) == (1, 0)
    assert train.main(argv) == 0
    (batch,) = data.build_train_loader(args.data, 0, 1, args.seed).next_step()
    with torch.no_grad():
        want = token_loss_sum(hf(batch.tokens).logits, batch.labels).item() / batch.labels.numel()
    assert [r["loss"] for r in read_rows(dump) if "loss" in r][0] == pytest.approx(want, rel=1e-5)
    with pytest.raises(ConfigError, match=r"'n_layers': \(2, 3\)"):
        train.main([f"dump_dir={tmp_path / 'typed'}", *common, "model.n_layers=2"])


def test_import_refuses_what_it_cannot_compute(tmp_path):
    hf = hf_model("no_q_latent")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for change, needle in [({"scoring_func": "softmax"}, "scoring_func=softmax"),
                           ({"n_group": 3}, "n_groups=3"),
                           ({"model_type": "llama"}, "is not 'deepseek_v3'")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=needle):
            load_hf(tmp_path)


def test_flops_count_the_mtp_module_and_its_second_use_of_the_output():
    from apps.deepseek.model import flops_per_token

    base = dict(dim=64, n_layers=2, n_heads=4, vocab_size=300, q_lora_rank=16)
    with torch.device("meta"):
        module = Transformer(DeepSeekArgs(**base, mtp_depth=1)).mtp["0"]
    routed = sum(p.numel() for p in module.block.moe.experts.parameters())   # not Linears
    per_token = (sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
                 + routed * 2 / 8)   # a token meets 2 of the 8 routed experts
    attention = 2 * 4 * (32 + 16 + 32) * 128 * 3
    added = flops_per_token(DeepSeekArgs(**base, mtp_depth=1), 128) - flops_per_token(
        DeepSeekArgs(**base), 128)
    assert added == pytest.approx(6 * (per_token + 300 * 64) + attention)


def test_bad_model_args_are_refused():
    for bad, needle in [(dict(n_kv_heads=2), "no grouped key/value"),
                        (dict(n_groups=3), "equal groups"),
                        (dict(top_k=4, n_groups=4, topk_groups=1), "kept groups hold"),
                        (dict(qk_rope_head_dim=7), "even"),
                        (dict(rope_scaling=True), "YaRN")]:
        with pytest.raises(ConfigError, match=needle):
            Transformer(DeepSeekArgs(**bad))


# ---------------------------------------------------------------------------------------------
# Training: one process, then every layout against it

STEPS = 4
MODEL = ["model.n_kv_heads=null", "model.n_layers=4", "model.q_lora_rank=32",
         "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
         "model.v_head_dim=16", "model.dense_hidden_dim=96", "model.n_dense_layers=1",
         "model.n_experts=4", "model.top_k=2", "model.n_groups=2", "model.topk_groups=1",
         "model.n_shared_experts=1", "model.expert_hidden_dim=32", "model.route_scale=2.5",
         "model.bias_update_rate=0.001", "model.mtp_depth=1", "model.attn_mask=block_causal"]
# Routing metrics and the MTP depth's cross-entropy, compared like the loss (see test_moe_train).
KEYS = {"moe/": 1e-4, "mtp/": 1e-5}


def ds_args(corpus, dump, *extra, steps: int = STEPS):
    return ["config=debug", *tiny_args(corpus, dump, *MODEL, "checkpoint.every=2",
                                       "checkpoint.keep=0", *extra, steps=steps)]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("deepseek_reference") / "run"
    train.main(ds_args(corpus, dump, "data.batch_size=8"))
    return dump


@pytest.mark.slow
def test_trains_with_mtp_and_moves_the_expert_bias(reference):
    rows = read_rows(reference)
    assert {"mtp/ce_1", "moe/1/imbalance", "loss"} <= set(rows[-1])
    assert rows[-1]["loss"] < rows[0]["loss"]
    from tests.equivalence import final_checkpoint, model_checksums

    sums = model_checksums(final_checkpoint(reference, STEPS))
    assert sums["layers.1.moe.router.expert_bias"][2] > 0   # the aux-loss-free update ran
    assert "mtp.0.block.attention.wkv_b.weight" in sums


@pytest.mark.slow
def test_resume_is_exact(corpus, tmp_path, reference, capfd):
    dump = tmp_path / "run"
    shutil.copytree(reference, dump)
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    capfd.readouterr()
    train.main(ds_args(corpus, dump, "data.batch_size=8"))
    assert_resumed(dump, "".join(capfd.readouterr()), 2, first)
    assert_equivalent(dump, reference, rtol=0, prefixes={"moe/": 0, "mtp/": 0})


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, layout", [
    (2, ["distributed.dp_shard=2", "data.batch_size=4"]),
    (2, ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
    (2, ["distributed.ep=2", "distributed.dp_shard=2", "data.batch_size=4"]),
    (4, ["distributed.ep=4", "distributed.dp_shard=4", "data.batch_size=2"]),
    # the last stage holds the MTP module and the output: one block, against the first's three
    (2, ["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=8",
         "distributed.pp_microbatches=2", "distributed.pp_split=[3]"]),
    (2, ["distributed.cp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
    (4, ["distributed.dp_shard=2", "distributed.tp=2", "distributed.ep=2",
         "data.batch_size=4"]),
], ids=["fsdp2", "tp2", "ep2", "ep4", "pp2", "cp2", "fsdp2_tp2_ep2"])
def test_layout_matches_one_process(corpus, tmp_path, reference, nproc, layout):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.deepseek.train", ds_args(corpus, dump, *layout))
    assert_equivalent(dump, reference, prefixes=KEYS)


@pytest.mark.slow
def test_float8_converts_the_layers_its_shapes_allow_and_tracks_fp32(corpus, tmp_path, reference,
                                                                     capfd):
    """tensorwise float8 (emulated on CPU): every MLA, dense and MoE matrix whose sizes are
    multiples of 16 converts, wkv_a (kv_lora_rank 32 + rope 8 = 40 rows) and the routers' gates
    do not, and the log names both kinds; the run tracks the fp32 reference (float8's rounding
    moves a step's loss by ~1e-4, see tests/test_float8_moe.py) and learns."""
    capfd.readouterr()
    train.main(ds_args(corpus, tmp_path / "run", "data.batch_size=8",
                       "distributed.float8=tensorwise"))
    said = "".join(capfd.readouterr())
    for name in ("layers.*.attention.wq_a", "layers.*.attention.wq_b", "layers.*.attention.wkv_b",
                 "layers.*.attention.wo", "layers.*.feed_forward.w1", "mtp.*.eh_proj",
                 "layers.*.moe.shared_experts.w2"):
        assert name in said, name
    assert "attention.wkv_a" not in said and "router.gate" not in said
    assert "the MoE experts (layers.*.moe.experts, mtp.*.block.moe.experts) use float8" in said
    rows, fp32 = read_rows(tmp_path / "run"), read_rows(reference)
    assert max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rows, fp32)) <= 2e-3
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.slow
def test_muon_takes_the_latent_projections_and_trains(corpus, tmp_path, reference):
    from lingua.optim.muon import split_params

    with torch.device("meta"):
        model = Transformer(DeepSeekArgs(dim=64, n_layers=2, n_heads=4, q_lora_rank=32,
                                         mtp_depth=1))
    muon = {n for n, _ in split_params(model)[0]}
    assert {f"layers.1.attention.{w}.weight" for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} \
        <= muon
    assert "layers.1.moe.experts.w1" in muon and "layers.1.attention.kv_norm.weight" not in muon
    train.main(ds_args(corpus, tmp_path / "run", "data.batch_size=8", "optim.name=muon"))
    rows = read_rows(tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["loss"] != read_rows(reference)[-1]["loss"]   # not AdamW's run


@pytest.mark.slow
def test_generate_command_decodes_a_run(reference, capsys):
    from apps.deepseek import generate

    generate.main([str(reference), "--prompt", "Once upon", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "prompt: Once upon\ncompletion: " in out


# ---------------------------------------------------------------------------------------------
# The planner's count of MLA's activations (the core's rule for the shape App.block_shape
# declares: apps/deepseek/train.py) against what real blocks keep on CPU, as tests/test_plan.py
# checks lingua's blocks


def plan_model(dtype, q_lora_rank, moe):
    from lingua.config import from_dict

    args = from_dict(DeepSeekArgs, dict(
        dim=128, n_layers=4, n_heads=8, vocab_size=512, max_seq_len=128, q_lora_rank=q_lora_rank,
        kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        dense_hidden_dim=192, n_dense_layers=0 if moe else 4, n_experts=8, top_k=2,
        n_shared_experts=1, expert_hidden_dim=64))
    torch.manual_seed(0)
    model = Transformer(args).to(dtype)
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model, args


@pytest.mark.parametrize("ac", ["none", "op", "full"])
@pytest.mark.parametrize("kind, q_lora_rank, moe", [("fp32", None, False), ("bf16", 32, True),
                                                    ("autocast", 32, False), ("fp32", 32, True)])
def test_plan_counts_what_mla_blocks_keep(kind, q_lora_rank, moe, ac):
    from apps.deepseek.train import APP
    from lingua.launch.plan_activations import block_activation_bytes
    from lingua.parallel.distributed import apply_ac
    from tests.test_plan import per_layer_bytes_per_token

    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    model, args = plan_model(dtype, q_lora_rank, moe)
    apply_ac(model.layers, ac)
    x = torch.randn(2, 64, args.dim, dtype=dtype, requires_grad=True)
    measured = per_layer_bytes_per_token(model, x, (2, 64), autocast=kind == "autocast")
    predicted = block_activation_bytes(APP.block_shape(args), moe, ac,
                                       4 if kind == "fp32" else 2,
                                       fp32_residual=kind == "autocast")
    assert measured == pytest.approx(predicted, rel=0.01, abs=1.0)


@pytest.mark.parametrize("ac", ["none", "op"])
def test_plan_counts_what_mla_keeps_under_tensor_parallel(ac):
    """tp=2 on the fake process group with real CPU tensors: the heads split, the latents whole."""
    from torch.distributed.tensor import DTensor, Shard

    from apps.deepseek.parallelize import parallelize_deepseek
    from apps.deepseek.train import APP
    from lingua.launch import plan_memory
    from lingua.launch.plan_activations import block_activation_bytes
    from lingua.parallel import distributed
    from lingua.parallel.distributed import DistEnv, DistributedArgs
    from tests.test_plan import per_layer_bytes_per_token

    model, args = plan_model(torch.bfloat16, 32, True)
    d = DistributedArgs(tp=2, dp_shard=1, ac=ac, loss_parallel=False)
    with plan_memory.fake_process_group(0, 2):
        dims = distributed.parallel_dims(d, 2)
        env = DistEnv(0, 0, 2, torch.device("cpu"), dims, distributed.build_mesh(dims, "cpu"))
        parallelize_deepseek(model, env, d)
        local = torch.randn(2, 32, args.dim, dtype=torch.bfloat16, requires_grad=True)
        x = DTensor.from_local(local, env.mesh["tp"], (Shard(1),), run_check=False)
        measured = per_layer_bytes_per_token(model, x, (2, 64))
    predicted = block_activation_bytes(APP.block_shape(args), True, ac, 2, tp=2)
    assert measured == pytest.approx(predicted, rel=0.01, abs=1.0)


# ---------------------------------------------------------------------------------------------
# The presets, planned at their scale on the fake process group


def mla_params(h, heads, q_lora, kv, nope, rope, v):
    q = h * heads * (nope + rope) if not q_lora else h * q_lora + q_lora + q_lora * heads * (
        nope + rope)
    return q + h * (kv + rope) + kv + kv * heads * (nope + v) + heads * v * h + 2 * h


def test_moonlight_16b_fits_one_node_of_8(data, tmp_path):
    from lingua.launch import plan as planner

    p = planner.plan("apps.deepseek.train", ["config=moonlight_16b", *data,
                                             f"dump_dir={tmp_path / 'run'}"], 8)
    assert (p.dims.dp_shard, p.args.distributed.ep) == (8, 8)
    attention = mla_params(2048, 16, None, 512, 128, 64, 128)
    dense = attention + 3 * 2048 * 11264
    moe = attention + 64 * 3 * 2048 * 1408 + 3 * 2048 * 2816 + 64 * 2048
    assert p.n_params == 2 * 163840 * 2048 + 2048 + dense + 26 * moe   # Moonlight's ~16B
    assert p.fits and p.busiest.total < 72 * 2 ** 30


@pytest.mark.slow
def test_deepseek_v3_671b_fits_256_gpus_with_ep64(data, tmp_path):
    from lingua.launch import plan as planner

    p = planner.plan("apps.deepseek.train", ["config=deepseek_v3_671b", *data,
                                             f"dump_dir={tmp_path / 'run'}"], 256)
    assert (p.dims.dp_shard, p.args.distributed.ep, p.args.distributed.ac) == (256, 64, "full")
    attention = mla_params(7168, 128, 1536, 512, 128, 64, 128)
    dense = attention + 3 * 7168 * 18432
    moe = attention + 256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 256 * 7168
    mtp = moe + 129280 * 7168 + 3 * 7168 + 2 * 7168 * 7168   # its embedding, norms, eh_proj
    main_model = 2 * 129280 * 7168 + 7168 + 3 * dense + 58 * moe
    assert round(main_model / 1e9) == 671 and p.n_params == main_model + mtp
    # every rank holds 1/256 of the fp32 weights (experts: 4 a layer by ep, then FSDP over 4)
    assert p.busiest.params == pytest.approx(4 * p.n_params / 256, rel=0.01)
    assert p.fits and p.busiest.total < 72 * 2 ** 30


@pytest.mark.slow
def test_export_of_a_training_run_computes_its_logits(reference, tmp_path, capsys):
    """The export command on the trained run (MTP module, moved expert bias, query latent):
    transformers' model of the directory gives the checkpoint's logits, and the MTP module is
    there under DeepSeek-V3's names."""
    from apps.deepseek.generate import load_model

    main(["export", str(reference), str(tmp_path / "hf")])
    out = capsys.readouterr().out
    assert "wrote DeepseekV3ForCausalLM" in out
    assert "model.layers.4.*: the MTP modules" in out and "UNEXPECTED" in out
    ours, _ = load_model(str(reference))
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    x = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=1e-5)
    again, args = load_hf(tmp_path / "hf")
    assert args.mtp_depth == 1 and torch.equal(again.mtp["0"].eh_proj.weight,
                                               ours.mtp["0"].eh_proj.weight)
