"""LoRA fine-tuning (lingua/model/lora.py, lingua/parallel/lora_tp.py) through apps/sft, against
independent references: the plain LLaMA model and the tensors of the Hugging Face base it starts
from, and one process for every parallel layout.

One tiny HF base (transformers' own random init, TINY_MODEL's shapes) and one single-process
reference run (4 steps, adapters on all seven linears so both column- and row-sharded layers
are exercised) are shared by the module. The memmap corpus stands in for chat data: nothing in
LoRA depends on which tokens count in the loss.
"""

import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from apps.sft import train
from apps.sft.prepare import write_base_model
from lingua import checkpoint
from lingua.errors import ConfigError
from lingua.model import lora
from lingua.models.llama.hf import load_hf
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.models.llama.parallelize import tp_plans
from lingua.parallel.tensor_parallel import lora_tp_plans
from lingua.train import build
from tests.conftest import TINY_MODEL, run_torchrun, tiny_args
from tests.equivalence import (
    assert_equivalent,
    assert_resumed,
    assert_same_rows,
    final_checkpoint,
    read_rows,
)
from tests.test_init_weights import single_process_env

STEPS = 4
TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
LORA = ["lora.rank=4", "lora.alpha=8", f"lora.targets=[{','.join(TARGETS)}]"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A LlamaForCausalLM directory of TINY_MODEL's shapes, random weights from transformers."""
    shape = {k.split("=")[0][len("model."):]: int(k.split("=")[1]) for k in TINY_MODEL}
    return write_base_model(tmp_path_factory.mktemp("lora_base") / "base", LlamaArgs(**shape))


def sft_args(corpus, dump, base, *extra, steps=STEPS) -> list:
    return tiny_args(corpus, dump, "data.format=memmap", "model.attn_mask=causal",
                     f"checkpoint.init_from={base}", *LORA, *extra, steps=steps)


@pytest.fixture(scope="module")
def reference(corpus, base, tmp_path_factory):
    """One process, global batch 4; checkpoints at step 2 (for the resume test) and at the end."""
    dump = tmp_path_factory.mktemp("lora_reference") / "run"
    assert train.main(sft_args(corpus, dump, base, "data.batch_size=4", "checkpoint.every=2",
                               "checkpoint.keep=0")) == 0
    return dump


def checkpoint_tensors(ckpt, prefix: str = "model.") -> dict:
    """The full tensors under `prefix` of a DCP checkpoint, read without a process group."""
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(prefix) and hasattr(m, "size")}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}


def assert_base_untouched(ckpt, base) -> dict:
    """The checkpoint holds the adapters only (the frozen weights are never written again), and
    base.json names the HF base they go with, size and index checksum as on disk; returns the
    adapters."""
    saved = checkpoint_tensors(ckpt)
    adapters = {k: v for k, v in saved.items() if lora.is_adapter(k)}
    assert set(saved) == set(adapters), sorted(set(saved) - set(adapters))
    assert len(adapters) == 2 * len(TARGETS) * 2   # two layers
    assert checkpoint.read_base(ckpt) == checkpoint.base_fingerprint(base)
    return adapters


def test_step_zero_computes_the_base_model(corpus, base, tmp_path):
    """Built as the trainer builds it, before any update: the plain model's logits, exactly (B is
    zero), while A is not (so it is B that makes the update vanish)."""
    args = train.load_config(sft_args(corpus, tmp_path / "run", base, "data.batch_size=4"))
    parts, _ = build.build_model_parts(args, single_process_env(args, "cpu"), train.APP)
    model, plain = parts[0], load_hf(base)[0]
    layers = [m for m in model.modules() if isinstance(m, lora.LoRALinear)]
    assert len(layers) == 2 * len(TARGETS)
    assert all(m.lora_a.abs().sum() > 0 and not m.lora_b.any() for m in layers)
    tokens = torch.randint(0, args.model.vocab_size, (2, 48),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter(n) for n in trainable)


def test_only_the_adapters_train(reference, base):
    """The optimizer holds state for the adapters only; every base weight ends bit-identical to
    the HF base's tensor; the adapters' B moved off zero."""
    ckpt = final_checkpoint(reference, STEPS)
    adapters = assert_base_untouched(ckpt, base)
    assert all(v.abs().sum() > 0 for k, v in adapters.items() if k.endswith("lora_b"))
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state_params = {k[len("optim.state."):].rsplit(".", 1)[0] for k in keys
                    if k.startswith("optim.state.")}
    assert state_params == set(adapters)


def test_lora_styles_follow_the_base_linear(corpus, base, tmp_path):
    """Built for rank 0 of tp=2 on torch's fake process group: column-sharded layers' adapters
    are A Replicate, B Shard(0); row-sharded ones A Shard(1), B Replicate; every base weight
    stays frozen (torch's SequenceParallel used to make the norm weights trainable)."""
    from lingua.launch import plan as planner
    from lingua.launch import plan_memory
    from lingua.parallel.distributed import parallel_dims

    overrides = sft_args(corpus, tmp_path / "run", base, "distributed.tp=2",
                         "distributed.dp_shard=1", "data.batch_size=4")
    app, args, _ = planner.load_args("apps.sft.train", overrides, 2, "cpu")
    with plan_memory._quiet(), plan_memory.fake_process_group(0, 2):
        parts, _ = plan_memory._build_parts(args, app, parallel_dims(args.distributed, 2), 0, 2)
        params = dict(parts[0].named_parameters())
    col, row = ((Replicate(),), (Shard(0),)), ((Shard(1),), (Replicate(),))
    want = {"attention.wq": col, "feed_forward.w3": col, "attention.wo": row,
            "feed_forward.w2": row}
    for layer, (a, b) in want.items():
        assert params[f"layers.1.{layer}.lora_a"].placements == a, layer
        assert params[f"layers.1.{layer}.lora_b"].placements == b, layer
    assert params["layers.1.attention.wq.lora_b"].to_local().shape == (32, 4)   # 64 / 2 rows
    assert params["layers.1.attention.wo.lora_a"].to_local().shape == (4, 32)   # 64 / 2 cols
    trainable = [n for n, p in params.items() if p.requires_grad]
    assert trainable and all(lora.is_adapter(n) for n in trainable), trainable


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.dp_shard=2", "data.batch_size=2"]),
    (2, ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=4"]),
    (4, ["distributed.tp=2", "distributed.dp_shard=2", "data.batch_size=2"]),
    (2, ["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=4",
         "distributed.pp_microbatches=2"]),
], ids=["fsdp2", "tp2", "fsdp2_tp2", "pp2"])
def test_layouts_equal_one_process(corpus, base, reference, tmp_path, nproc, layout):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.sft.train", sft_args(corpus, dump, base, *layout))
    assert_equivalent(dump, reference)


@pytest.mark.distributed
def test_bf16_with_fsdp_keeps_fp32_frozen_base(corpus, base, reference, tmp_path):
    """FSDP2 casts every parameter, frozen ones too, to bf16 for compute: the run trains, close
    to the fp32 run, and the base weights it saves are still the HF base's fp32 tensors."""
    dump = tmp_path / "run"
    run_torchrun(2, "apps.sft.train", sft_args(corpus, dump, base, "distributed.dp_shard=2",
                                               "data.batch_size=2", "distributed.model_dtype=bf16"))
    assert_same_rows(read_rows(dump), read_rows(reference), rtol=1e-2, what="bf16 run")
    adapters = assert_base_untouched(final_checkpoint(dump, STEPS), base)
    assert all(v.dtype == torch.float32 for v in adapters.values())


def test_resume_is_exact(corpus, base, reference, tmp_path, capfd):
    """The reference stopped after its step-2 checkpoint and started again: the uninterrupted
    run's steps and final tensors, steps 1-2 not recomputed."""
    dump = tmp_path / "run"
    shutil.copytree(reference, dump)
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    first = read_rows(reference)
    assert train.main(sft_args(corpus, dump, base, "data.batch_size=4", "checkpoint.every=2",
                               "checkpoint.keep=0")) == 0
    out, err = capfd.readouterr()
    assert_resumed(dump, out + err, 2, first)
    assert_equivalent(dump, reference)
    # The checkpoints hold the adapters only: resume re-reads init_from and refuses another
    # base (here the same shapes, other weights) or a missing one, before any work.
    other = write_base_model(tmp_path / "other", load_hf(base)[1], seed=1)
    for init_from, message in ((other, "holds the trained weights only.*is another model now"),
                               (tmp_path / "gone", "does not exist")):
        with pytest.raises(ConfigError, match=message):
            train.main(sft_args(corpus, dump, init_from, "data.batch_size=4", steps=STEPS + 1))


# ---------------------------------------------------------------------------------------------
# Refused before any process group


@pytest.mark.parametrize("override,message", [
    ("lora.targets=[wq,gate_proj]", r"lora.targets names \['gate_proj'\], which the model has no "
                                    r"Linear layer called"),
    ("lora.rank=33", r"lora.rank=33 is larger than layer layers.0.attention.wk \(64 -> 32\)"),
])
def test_bad_targets_and_rank_are_refused_by_the_config(corpus, base, tmp_path, override,
                                                        message):
    with pytest.raises(ConfigError, match=message):
        train.load_config(sft_args(corpus, tmp_path / "run", base, override))
    assert not dist.is_initialized()


def lora_model():
    args = LlamaArgs(**{k.split("=")[0][len("model."):]: int(k.split("=")[1])
                        for k in TINY_MODEL})
    with torch.device("meta"):
        model = Transformer(args)
    lora.apply_lora(model, lora.LoRAArgs(rank=4, targets=TARGETS))
    return model


@pytest.mark.parametrize("edit,message", [
    ({"attention.wq": SequenceParallel()},
     r"LoRA layer 'layers.0.attention.wq' is planned with SequenceParallel"),
    ({"feed_forward.w2": None},
     r"LoRA layer\(s\) 'layers.0.feed_forward.w2', 'layers.1.feed_forward.w2' are in no "
     r"tensor-parallel plan"),
], ids=["other_style", "left_out"])
def test_tp_layout_the_plan_does_not_cover_is_refused(edit, message):
    """A fork's TP plan that shards a LoRA layer some other way, or not at all: refused from the
    plans on the meta model (what apply_tp runs first), with the fix named."""
    model = lora_model()
    root, block = tp_plans(model, loss_parallel=False)
    root_ok, blocks_ok = lora_tp_plans(model, root, block, model.layers.values())
    assert type(blocks_ok[0]["attention.wo"]).__name__ == "LoRARowwiseParallel"
    assert type(root_ok["output"]).__name__ == "ColwiseParallel"   # not a LoRA layer: as is
    for key, style in edit.items():
        if style is None:
            del block[key]
        else:
            block[key] = style
    with pytest.raises(ConfigError, match=message) as err:
        lora_tp_plans(model, root, block, model.layers.values())
    assert "ColwiseParallel(...) or RowwiseParallel(...)" in str(err.value)
    assert not dist.is_initialized()


def test_the_trainer_refuses_it_too(corpus, base, tmp_path):
    """The same refusal where the trainer builds (apply_tp, here at tp=2 on torch's fake process
    group), for a fork whose parallelize.py plans wo with another style."""
    import dataclasses

    from lingua.launch import plan as planner
    from lingua.launch import plan_memory
    from lingua.parallel.distributed import parallel_dims
    from lingua.parallel.parallelize import parallelize_decoder

    def fork_plans(model, loss_parallel):
        root, block = tp_plans(model, loss_parallel)
        return root, {**block, "attention.wo": SequenceParallel()}

    app_desc = dataclasses.replace(
        train.APP, parallelize=lambda m, env, a: parallelize_decoder(m, env, a, fork_plans))
    overrides = sft_args(corpus, tmp_path / "run", base, "distributed.tp=2",
                         "distributed.dp_shard=1", "data.batch_size=4")
    _, args, _ = planner.load_args("apps.sft.train", overrides, 2, "cpu")
    with pytest.raises(ConfigError, match=r"'layers.0.attention.wo' is planned with Sequence"):
        with plan_memory._quiet(), plan_memory.fake_process_group(0, 2):
            plan_memory._build_parts(args, app_desc, parallel_dims(args.distributed, 2), 0, 2)
