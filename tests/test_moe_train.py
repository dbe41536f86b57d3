"""The MoE app end to end: trains, logs routing metrics, and matches one process in parallel."""

import pytest

from apps.moe import train
from lingua import checkpoint
from lingua.errors import ConfigError
from tests.conftest import read_metrics, run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows

STEPS = 4
MOE = ["model.n_layers=4", "model.n_experts=4", "model.top_k=2", "model.n_shared_experts=1",
       "model.expert_hidden_dim=32", "model.n_dense_layers=1", "model.aux_loss_coef=0.01",
       "model.z_loss_coef=0.001", "model.bias_update_rate=0.001"]


def moe_args(corpus, dump, *extra, steps=STEPS):
    return ["config=debug", *tiny_args(corpus, dump, *MOE, *extra, steps=steps)]


# Routing metrics (moe/<layer>/...) cover the step's global batch and every pipeline stage, so
# each equals one process's: the same layers are logged, with the same values (1e-4: they are
# ratios and entropies of small counts, computed after the loss).
ROUTING = {"moe/": 1e-4}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("moe_reference") / "run"
    train.main(moe_args(corpus, dump, "data.batch_size=8"))
    return dump


def test_moe_trains_and_logs_routing_metrics(corpus, tmp_path):
    dump = tmp_path / "run"
    train.main(moe_args(corpus, dump, steps=20))
    rows = read_metrics(dump)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    for layer in ("1", "2", "3"):  # layer 0 is dense
        assert rows[0][f"moe/{layer}/imbalance"] >= 1.0
        assert 0 <= rows[0][f"moe/{layer}/router_entropy"] <= 1.3863  # ln 4
        assert (rows[0][f"moe/{layer}/aux_loss"] > 0
                and rows[0][f"moe/{layer}/dropped_fraction"] == 0)
    assert "moe/0/imbalance" not in rows[0]


def test_expert_bias_moves_and_resume_is_exact(corpus, tmp_path, capfd):
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    dump = tmp_path / "run"
    args = moe_args(corpus, dump, "checkpoint.every=2", "checkpoint.keep=0")
    train.main(args)
    state = {"model": {"layers.1.moe.router.expert_bias": torch.zeros(4)}}
    dcp.load(state, checkpoint_id=str(dump / "checkpoints" / str(STEPS)), no_dist=True)
    assert state["model"]["layers.1.moe.router.expert_bias"].abs().sum() > 0  # the bias was updated
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(dump, uninterrupted)
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    capfd.readouterr()
    train.main(args)
    assert_resumed(dump, "".join(capfd.readouterr()), 2, first)
    assert_equivalent(dump, uninterrupted, rtol=0, prefixes={"moe/": 0})  # bit-exact


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.dp_shard=2", "data.batch_size=4"]),
    (2, ["distributed.cp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
], ids=["fsdp2", "cp2"])
def test_moe_layouts_match_one_process(corpus, tmp_path, reference, nproc, layout):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.moe.train", moe_args(corpus, dump, *layout))
    assert_equivalent(dump, reference, prefixes=ROUTING)


@pytest.mark.distributed
def test_moe_pipeline_matches_one_process(corpus, tmp_path):
    """pp=2 with the aux and z losses on: balancing statistics are per micro-batch, so the one
    process accumulates the same two micro-batches (grad_accum=2). Each stage's balancing losses
    reach the loss through the stage outputs (apps/moe Transformer.stage_outputs), so their
    gradients and the routing metrics of both stages' layers equal one process's."""
    one = tmp_path / "one"
    train.main(moe_args(corpus, one, "data.batch_size=4", "data.grad_accum=2"))
    two = tmp_path / "two"
    run_torchrun(2, "apps.moe.train", moe_args(corpus, two, "distributed.pp=2",
                                               "distributed.dp_shard=1", "data.batch_size=8",
                                               "distributed.pp_microbatches=2"))
    assert_equivalent(two, one, prefixes=ROUTING)  # both stages' layers, on rank 0


@pytest.mark.slow
def test_compiled_moe_gives_the_same_losses_and_routing(corpus, tmp_path):
    """distributed.compile=true with fp32 grouped experts (torch.compile's rule for _grouped_mm
    takes bf16 only, so those calls go through an opaque op) trains and validates as the eager
    run does. Every layer is an MoE one: inductor's C++ compile of each distinct block graph is
    most of this test's time, and the dense block compiles in tests/test_parallel.py."""
    moe_only = ["data.batch_size=8", "model.n_dense_layers=0"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train.main(moe_args(corpus, eager, *moe_only))
    train.main(moe_args(corpus, compiled, *moe_only, "distributed.compile=true"))
    assert_equivalent(compiled, eager, prefixes=ROUTING)


@pytest.mark.parametrize("override,needle", [
    ("model.top_k=9", "top_k"), ("model.score_func=relu", "score_func"),
    ("distributed.tp=3", "tp=3"),
    ("distributed.ep=3", "ep=3"),
])
def test_bad_moe_config_is_refused(corpus, tmp_path, monkeypatch, override, needle):
    if override.startswith("distributed."):
        monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=needle):
        train.config.load("moe", train.TrainArgs, moe_args(corpus, tmp_path / "x", override),
                          train.validate)
    assert checkpoint.newest(tmp_path / "x") is None


def test_gpu_presets_compose(tmp_path):
    tok = tmp_path / "tok.model"
    tok.write_text("x")
    presets = {"moe_1b": (8, 2, 0), "deepseek_16b": (64, 6, 2), "qwen3_30b_a3b": (128, 8, 0)}
    for preset, (experts, top_k, shared) in presets.items():
        cfg = train.config.compose_config("moe", [f"config={preset}", f"data.root={tmp_path}",
                                                  f"data.tokenizer.path={tok}"])
        assert ((cfg.model.n_experts, cfg.model.top_k, cfg.model.n_shared_experts)
                == (experts, top_k, shared))


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.ep=2", "distributed.dp_shard=2", "data.batch_size=4"]),
    (4, ["distributed.ep=4", "distributed.dp_shard=4", "data.batch_size=2"]),
    (4, ["distributed.ep=2", "distributed.dp_shard=4", "data.batch_size=2"]),
], ids=["ep2", "ep4", "ep2_fsdp4"])
def test_expert_parallel_layouts_match_one_process(corpus, tmp_path, reference, nproc, layout):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.moe.train", moe_args(corpus, dump, *layout))
    assert_equivalent(dump, reference, prefixes=ROUTING)


@pytest.mark.distributed
def test_expert_parallel_with_pipeline_and_ac(corpus, tmp_path):
    aux_free = ["model.aux_loss_coef=0", "model.z_loss_coef=0"]
    one = tmp_path / "one"
    train.main(moe_args(corpus, one, "data.batch_size=8", *aux_free))
    four = tmp_path / "four"
    run_torchrun(4, "apps.moe.train", moe_args(corpus, four, "distributed.pp=2",
                                               "distributed.dp_shard=2",
                                               "distributed.ep=2", "data.batch_size=4",
                                               "distributed.pp_microbatches=2",
                                               "distributed.ac=full", *aux_free))
    # The default 1e-5 holds (differences are ~1e-7) because the expert-bias update leaves out
    # torch's shape-inference forward, which runs on uninitialised tensors past stage 0.
    assert_equivalent(four, one, prefixes=ROUTING)  # AC recomputes not counted twice


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
    (4, ["distributed.tp=2", "distributed.ep=2", "distributed.dp_shard=2", "data.batch_size=4"]),
], ids=["tp2", "ep2_tp2"])
def test_tensor_parallel_dense_parts_match_one_process(corpus, tmp_path, reference, nproc, layout):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.moe.train", moe_args(corpus, dump, *layout))
    assert_equivalent(dump, reference, prefixes=ROUTING)


@pytest.mark.slow
def test_bf16_trainer_pads_expert_groups_and_trains_as_the_expert_loop(corpus, tmp_path,
                                                                       monkeypatch):
    """The CPU bf16 expert padding (lingua/model/moe.py CPU_GROUP_ROWS) reached through the trainer,
    not only through the layer: distributed.model_dtype=bf16 on one process (autocast), with
    8 x 64 tokens x top-2 = 1024 expert rows on 4 experts, enough for the padding to apply (it
    is skipped where it would add over 10% of the rows). Every MoE layer pads at every step, and
    the run equals model.expert_impl=loop (one matmul per expert, no padding) to bf16 rounding:
    every step's loss and gradient norm, and the final parameters (bit for bit on an AVX2 CPU).
    The final parameters are what catch a wrong padding here: handing each token another
    token's expert output (y[:n] for y[rows]) moved this tiny model's losses by under 1e-4, its
    expert weights' checksums by 4-105%."""
    import lingua.model.moe as moe_module

    args = ["data.batch_size=8", "distributed.model_dtype=bf16"]
    padded_counts, pad = [], moe_module._pad_groups
    with monkeypatch.context() as patch:
        patch.setattr(moe_module, "_pad_groups",
                      lambda x, c, m: padded_counts.append(c.tolist()) or pad(x, c, m))
        train.main(moe_args(corpus, tmp_path / "grouped", *args, steps=3))
    # 3 MoE layers (layer 0 is dense) x (3 training steps + the validation at the end, one batch
    # of data.val_sequences=8): forwards only, backward does not pad again.
    assert len(padded_counts) == 3 * (3 + 1), padded_counts
    assert all(sum(counts) == 8 * 64 * 2 for counts in padded_counts), padded_counts
    train.main(moe_args(corpus, tmp_path / "loop", *args, "model.expert_impl=loop", steps=3))
    assert_equivalent(tmp_path / "grouped", tmp_path / "loop", rtol=2e-2, prefixes={"moe/": 2e-2})


def test_each_step_starts_its_routing_sums_and_bias_counts_from_zero():
    """The MoE apps' RoutingHook (lingua.parallel.expert_parallel): a step whose update was
    skipped (a spike, a non-finite gradient) or rolled back kept its tokens' counts, which only an
    applied update clears; the next step's
    bias update must count its own tokens only, as a run resumed there would."""
    from types import SimpleNamespace

    import torch

    from apps.moe.model import MoEArgs, Transformer
    from lingua.model.moe import moe_layers

    torch.manual_seed(0)
    model = Transformer(MoEArgs(dim=32, n_layers=2, n_heads=4, multiple_of=16, vocab_size=64,
                                max_seq_len=16, n_experts=4, top_k=2, n_dense_layers=0))
    model.init_weights(buffer_device="cpu")
    model.train()
    model(torch.randint(0, 64, (2, 16)))
    layers = moe_layers(model)
    assert layers and all(m.step_counts is not None and m.routing is not None for m in layers)
    train.RoutingHook(0.0, 4).before_step(SimpleNamespace(parts=[model]), 2)
    assert all(m.step_counts is None and m.routing is None for m in layers)


# Qwen3-MoE's shape (Qwen3MoeForCausalLM): QK-norm, heads wider than dim / n_heads, renormalised
# softmax top-3 of 6 experts, no shared expert, the first layer dense, no balancing loss (so a
# pipeline's micro-batches equal one process's whole batch). One reference for every layout.
QWEN3 = ["model.n_layers=4", "model.head_dim=32", "model.qk_norm=true", "model.n_experts=6",
         "model.top_k=3", "model.norm_topk=true", "model.n_shared_experts=0",
         "model.expert_hidden_dim=32", "model.n_dense_layers=1", "model.aux_loss_coef=0",
         "model.z_loss_coef=0"]
QWEN3_LAYOUTS = {
    "fsdp2": ["distributed.dp_shard=2", "data.batch_size=4"],
    "tp2": ["distributed.tp=2", "distributed.dp_shard=1"],
    "cp2": ["distributed.cp=2", "distributed.dp_shard=1"],
    "pp2": ["distributed.pp=2", "distributed.dp_shard=1", "distributed.pp_microbatches=2"],
    "ep2": ["distributed.ep=2", "distributed.dp_shard=2", "data.batch_size=4"],
}


def qwen3_args(corpus, dump, *extra):
    return ["config=debug", *tiny_args(corpus, dump, *QWEN3, "data.batch_size=8", *extra,
                                       steps=STEPS)]


@pytest.fixture(scope="module")
def qwen3_reference(corpus, tmp_path_factory):
    from omegaconf import OmegaConf

    from apps.moe.hf import layout_for
    from apps.moe.model import MoEArgs

    dump = tmp_path_factory.mktemp("qwen3_moe_reference") / "run"
    train.main(qwen3_args(corpus, dump))
    model = OmegaConf.load(dump / "config.yaml").model
    assert layout_for(MoEArgs(**OmegaConf.to_container(model))) == "qwen3_moe"
    return dump


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(QWEN3_LAYOUTS))
def test_qwen3_moe_layouts_match_one_process(corpus, tmp_path, qwen3_reference, layout):
    dump = tmp_path / "run"
    run_torchrun(2, "apps.moe.train", qwen3_args(corpus, dump, *QWEN3_LAYOUTS[layout]))
    assert_equivalent(dump, qwen3_reference, prefixes=ROUTING)
