"""A model's first weights (lingua/model/weights.py, build.build_model_parts): where they live and
what they are.

- Every layout builds on the meta device, shards, then materialises on env.device: nothing is
  left on another device (a fake device, meta, shows buffers move too).
- A fresh init draws each tensor from its own (seed, name) stream: pipeline stages do not
  replay one stream (which would start layers 2, 4, 6 of pp=4 equal on GPUs), and every layout
  gets the weights one process gets.
- checkpoint.init_from starts from exactly the Hugging Face weights in one process, FSDP, TP and
  PP, with no full copy of the model on ranks other than rank 0's reader.
GPU tests at the end are the runbook for what a CPU cannot show (CUDA generators, NCCL).
"""

import dataclasses
import json

import pytest
import torch
from torch import nn

from apps.llama import train
from lingua import config
from lingua.errors import RunError
from lingua.model import weights
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.parallel import distributed, pipeline
from lingua.train import build
from tests.conftest import read_metrics, run_python, run_torchrun, tiny_args

ARGS = LlamaArgs(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=16)
SEED = 42
WORKER = "tests.workers.init_from_worker"


def on_meta(args=ARGS) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def stage_parts(n_stages: int) -> list:
    """The pipeline stages the trainer builds: split on the meta device, before any weight."""
    model = on_meta()
    layers = pipeline.stage_layer_ids(ARGS.n_layers, n_stages)
    return [pipeline.split_model(model, layers[s], s == 0, s == n_stages - 1)
            for s in range(n_stages)]


def tensors_of(module: nn.Module) -> list:
    return list(module.parameters()) + list(module.buffers())


# ---------------------------------------------------------------------------------------------
# Seeding: layout-independent, every tensor distinct


@pytest.mark.parametrize("device", [
    "cpu",
    # The runbook's one-GPU check: CUDA generators, stages built apart.
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
def test_pipeline_stages_start_distinct_and_as_one_process_does(device):
    full = weights.materialize(on_meta(), device, SEED)
    parts = [weights.materialize(p, device, SEED) for p in stage_parts(4)]
    got = {k: v for part in parts for k, v in part.state_dict().items()}
    want = full.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:  # each layer (and the embeddings, norm, output) as in the whole model
        assert torch.equal(got[key], want[key]), key
    # The first layer of stages 1, 2 and 3 (layers 2, 4, 6), and every other pair, differ.
    wq = [want[f"layers.{i}.attention.wq.weight"] for i in range(ARGS.n_layers)]
    assert all(not torch.equal(wq[i], wq[j]) for i in range(8) for j in range(i))


def test_the_old_seeding_made_stages_alike():
    """Why each tensor has its own stream (and what the test above would catch): stages that
    each seed the same and initialise themselves replay one stream where they have no
    embeddings."""
    parts = stage_parts(4)
    for part in parts:
        part.to_empty(device="cpu")
        torch.manual_seed(SEED)
        part.init_weights(buffer_device="cpu")
    first = [parts[s].layers[str(2 * s)].attention.wq.weight for s in (1, 2, 3)]
    assert torch.equal(first[0], first[1]) and torch.equal(first[1], first[2])


def test_every_random_init_entry_point_draws_from_the_tensor_stream():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.register_buffer("noise", torch.empty(5))

        def init_weights(self, buffer_device=None):
            nn.init.trunc_normal_(self.a.weight, std=0.02)   # nn.init, tensor as keyword
            self.b.weight.uniform_(-1, 1)                     # a Tensor method
            nn.init.kaiming_uniform_(self.a.bias.view(1, 8))  # a view: not one of ours
            self.b.bias.normal_()
            self.noise.normal_()

    def init(order_seed: int) -> dict:
        torch.manual_seed(order_seed)  # the global RNG must not matter
        toy = Toy()
        with torch.no_grad(), weights.PerTensorStreams(toy, SEED, torch.device("cpu")):
            toy.init_weights()
        return {k: v.clone() for k, v in toy.state_dict().items()}

    first, second = init(0), init(1)
    for key in ("a.weight", "b.weight", "b.bias", "noise"):
        assert torch.equal(first[key], second[key]), key
    gen = torch.Generator().manual_seed(weights.stream_seed(SEED, "b.weight"))
    assert torch.equal(first["b.weight"], torch.empty(8, 8).uniform_(-1, 1, generator=gen))
    assert not torch.equal(first["a.bias"], second["a.bias"])  # the view drew from the global RNG


def test_stream_names_ignore_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = weights.materialize(on_meta(), "cpu", SEED)
    wrapped = on_meta()
    wrapped.layers["3"] = checkpoint_wrapper(wrapped.layers["3"])
    weights.materialize(wrapped, "cpu", SEED)
    assert "layers.3.attention.wq.weight" in weights.named_tensors(wrapped)
    for key, value in plain.state_dict().items():
        assert torch.equal(wrapped.state_dict()[key], value), key


# ---------------------------------------------------------------------------------------------
# Placement


def test_materialize_moves_parameters_and_buffers_to_the_given_device():
    built_on_cpu = Transformer(ARGS)
    assert {t.device.type for t in tensors_of(built_on_cpu)} == {"cpu"}
    weights.materialize(built_on_cpu, torch.device("meta"), SEED)
    assert {t.device.type for t in tensors_of(built_on_cpu)} == {"meta"}  # RoPE tables too
    weights.check_placement([built_on_cpu], "meta")

    part = weights.materialize(stage_parts(2)[1], "cpu", SEED)
    assert {t.device.type for t in tensors_of(part)} == {"cpu"} and part.rope_cos.numel() > 0
    part.rope_sin = torch.empty(16, 8, device="meta")  # a buffer left behind
    with pytest.raises(RunError, match="buffer rope_sin on meta"):
        weights.check_placement([part], "cpu")


def single_process_env(args, device: str):
    env = distributed.init(args.distributed)
    return dataclasses.replace(env, device=torch.device(device))


@pytest.mark.parametrize("init_from", [False, True], ids=["fresh", "init_from"])
def test_build_puts_every_tensor_on_the_run_device(corpus, tmp_path, hf_dir, init_from):
    """Built for a device that is not the CPU (meta stands in for a GPU): no parameter or buffer
    stays on the CPU, where the old init_from path left them (built on the CPU, moved only when
    parameters were on meta)."""
    extra = [f"checkpoint.init_from={hf_dir}"] if init_from else []
    args = config.load("llama", train.TrainArgs, tiny_args(corpus, tmp_path / "run", *extra),
                       train.validate)
    parts, _ = build.build_model_parts(args, single_process_env(args, "meta"), train.APP)
    assert {t.device.type for part in parts for t in tensors_of(part)} == {"meta"}
    parts, _ = build.build_model_parts(args, single_process_env(args, "cpu"), train.APP)
    assert {t.device.type for part in parts for t in tensors_of(part)} == {"cpu"}


# ---------------------------------------------------------------------------------------------
# Through the trainer, on gloo


def run_worker(nproc: int, out, args: list, app: str = "llama") -> list:
    if nproc == 1:
        run_python(WORKER, [str(out), app, *args])
    else:
        run_torchrun(nproc, WORKER, [str(out), app, *args])
    return json.loads(out.read_text())


def merged_hashes(ranks: list) -> dict:
    out = {}
    for rank in ranks:
        for key, h in rank["hashes"].items():
            assert out.setdefault(key, h) == h, f"{key}: replicas disagree"
    return out


@pytest.mark.distributed
def test_fresh_init_of_pipeline_stages_equals_one_process(corpus, tmp_path):
    common = ["model.n_layers=8", "data.batch_size=8", "distributed.pp_microbatches=4"]
    one = merged_hashes(run_worker(1, tmp_path / "one.json",
                                   tiny_args(corpus, tmp_path / "a", *common)))
    pp4 = merged_hashes(run_worker(4, tmp_path / "pp4.json", tiny_args(
        corpus, tmp_path / "b", *common, "distributed.pp=4", "distributed.dp_shard=1")))
    assert pp4 == one
    firsts = {one[f"layers.{i}.attention.wq.weight"] for i in range(8)}
    assert len(firsts) == 8


@pytest.fixture(scope="module")
def hf_dir(corpus, tmp_path_factory):
    """A Hugging Face directory exported from a short training run."""
    from lingua.models.llama.hf import export

    root = tmp_path_factory.mktemp("init_from")
    train.main(tiny_args(corpus, root / "first", steps=3))
    export(str(root / "first" / "checkpoints" / "3"), str(root / "hf"))
    return root / "hf"


@pytest.fixture(scope="module")
def hf_loss(corpus, hf_dir, tmp_path_factory):
    """The exported model's loss on the first global batch (8 sequences), loaded independently."""
    from lingua import data
    from lingua.model.loss import token_loss_sum
    from lingua.models.llama.hf import load_hf

    cfg = config.load("llama", train.TrainArgs, tiny_args(corpus, tmp_path_factory.mktemp("ref")))
    model, _ = load_hf(str(hf_dir))
    (batch,) = data.build_train_loader(cfg.data, 0, 1, cfg.seed).next_step()
    with torch.no_grad():
        return (token_loss_sum(model(batch.tokens), batch.labels).item()
                / batch.labels.numel())


LAYOUTS = {
    "one": (1, []),
    "fsdp2": (2, ["distributed.dp_shard=2", "data.batch_size=4"]),
    "tp2": (2, ["distributed.tp=2", "distributed.dp_shard=1"]),
    "pp2": (2, ["distributed.pp=2", "distributed.dp_shard=1", "distributed.pp_microbatches=2"]),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_from_starts_from_the_hf_weights(corpus, tmp_path, hf_dir, hf_loss, layout):
    nproc, extra = LAYOUTS[layout]
    dump = tmp_path / "tuned"
    args = tiny_args(corpus, dump, f"checkpoint.init_from={hf_dir}", *extra, steps=1)
    if nproc == 1:
        assert train.main(args) == 0
    else:
        run_torchrun(nproc, "apps.llama.train", args)
    assert read_metrics(dump)[0]["loss"] == pytest.approx(hf_loss, rel=1e-5)


@pytest.mark.distributed
def test_init_from_fills_fsdp_x_tp_shards_exactly(corpus, tmp_path, hf_dir):
    """FSDP over TP shards a dimension twice (a strided shard): every full tensor must still be
    the file's, bit for bit, on every rank's device."""
    ranks = run_worker(4, tmp_path / "out.json", tiny_args(
        corpus, tmp_path / "run", f"checkpoint.init_from={hf_dir}", "distributed.dp_shard=2",
        "distributed.tp=2", "data.batch_size=4"))
    for rank in ranks:
        assert rank["devices"] == ["cpu"]
        assert rank["max_diff"] and max(rank["max_diff"].values()) == 0.0


@pytest.mark.distributed
def test_moe_init_from_fills_expert_parallel_shards_exactly(corpus, tmp_path):
    """apps.moe through the same path: experts sharded over ep and FSDP, attention over TP, and
    the routers' expert_bias (a persistent buffer) from a Glm4Moe directory."""
    from apps.moe import train as moe_train
    from apps.moe.hf import export

    moe = ["config=debug", "model.n_layers=2", "model.n_experts=4", "model.top_k=2",
           "model.n_shared_experts=1", "model.expert_hidden_dim=32", "model.n_dense_layers=1",
           "model.score_func=sigmoid", "model.bias_update_rate=0.001"]
    first = tmp_path / "first"
    moe_train.main([*moe, *tiny_args(corpus, first, "checkpoint.every=2", steps=2)])
    hf = tmp_path / "hf"
    export(str(first / "checkpoints" / "2"), str(hf))
    ranks = run_worker(4, tmp_path / "out.json", [*moe, *tiny_args(
        corpus, tmp_path / "run", f"checkpoint.init_from={hf}", "distributed.ep=2",
        "distributed.dp_shard=2", "distributed.tp=2", "data.batch_size=4")], app="moe")
    for rank in ranks:
        assert rank["devices"] == ["cpu"]
        assert any(k.endswith("expert_bias") for k in rank["max_diff"])
        assert max(rank["max_diff"].values()) == 0.0


MEDIUM = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8",
          "model.multiple_of=256", "model.max_seq_len=128"]


@pytest.mark.distributed
def test_init_from_holds_no_full_copy_per_rank(corpus, tmp_path):
    """A 27.5M-parameter model (110 MB in fp32, 55 MB as a bf16 file) under dp_shard=2. Each
    rank holds its shard (52.5 MB) and one full tensor at a time, and rank 0 maps the file; a
    full copy per rank (a full fp32 random model plus the file converted to fp32) would grow each
    rank by ~210 MB. Peak anonymous memory (copies, not mapped files) is measured."""
    from lingua.models.llama.hf import save_hf

    hf = tmp_path / "hf"
    model_args = config.load("llama", train.TrainArgs,
                             tiny_args(corpus, tmp_path / "x", *MEDIUM)).model
    save_hf(Transformer(model_args), model_args, hf, torch.bfloat16)
    ranks = run_worker(2, tmp_path / "out.json", tiny_args(
        corpus, tmp_path / "run", *MEDIUM, f"checkpoint.init_from={hf}", "distributed.dp_shard=2",
        "data.batch_size=4"))
    full_fp32 = 2 * ranks[0]["local_bytes"]
    for rank in ranks:
        assert max(rank["max_diff"].values()) == 0.0
        grown = rank["peak_anon"] - rank["before"]["RssAnon"]
        assert grown < 0.8 * full_fp32, (rank["rank"], grown / 2**20, full_fp32 / 2**20)


# ---------------------------------------------------------------------------------------------
# GPU runbook (bash setup/test.sh -m gpu): CUDA generators, NCCL broadcasts, DTensor on CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_init_from_starts_from_the_hf_weights(corpus, tmp_path, hf_dir, hf_loss, layout):
    """One GPU, and FSDP, TP and PP on 2 GPUs: every tensor the file's, on the rank's GPU (NCCL
    broadcasts from rank 0); step 1's loss the HF model's (TF32 is off by default for matmuls,
    but reductions run in another order than on the CPU)."""
    nproc, extra = LAYOUTS[layout]
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    ranks = run_worker(nproc, tmp_path / "out.json", tiny_args(
        corpus, tmp_path / "build", f"checkpoint.init_from={hf_dir}", *extra))
    for rank in ranks:
        assert rank["devices"] == [f"cuda:{rank['rank']}"], rank["devices"]
        assert max(rank["max_diff"].values()) == 0.0
    dump = tmp_path / "tuned"
    run_torchrun(nproc, "apps.llama.train", tiny_args(corpus, dump,
                                                      f"checkpoint.init_from={hf_dir}",
                                                      *extra, steps=1))
    assert read_metrics(dump)[0]["loss"] == pytest.approx(hf_loss, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("layout", [
    ["distributed.pp=4", "distributed.dp_shard=1", "data.batch_size=8",
     "distributed.pp_microbatches=4"],
    ["distributed.pp=2", "distributed.dp_shard=2", "data.batch_size=4",
     "distributed.pp_microbatches=2"],
    ["distributed.dp_shard=2", "distributed.tp=2", "data.batch_size=4"],
], ids=["pp4", "pp2_fsdp2", "fsdp2_tp2"])
def test_gpu_fresh_init_is_distinct_per_layer_and_the_same_in_every_layout(corpus, tmp_path,
                                                                           layout):
    """Each tensor is drawn whole on the GPU from its (seed, name) generator, then sliced: the
    hashes must equal one GPU's, bit for bit, and the 8 layers must all differ. Stages initialised
    after sharding from one replayed stream (or from rank 0's state broadcast by DTensor's RNG
    tracker) would start layers 2/4/6 of pp=4 equal."""
    common = ["model.n_layers=8"]
    one = merged_hashes(run_worker(1, tmp_path / "one.json",
                                   tiny_args(corpus, tmp_path / "a", *common)))
    got = merged_hashes(run_worker(4, tmp_path / "four.json",
                                   tiny_args(corpus, tmp_path / "b", *common, *layout)))
    assert got == one
    assert len({one[f"layers.{i}.attention.wq.weight"] for i in range(8)}) == 8
