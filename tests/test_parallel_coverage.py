"""lingua.parallel.coverage: a parameter that the app's parallel plan leaves out of a gradient
reduction (tp, cp, dp, ep) is refused at start, on every rank, naming it and the plan line to add.

The bug it prevents: a model with QK-norm trained under tp=2 with its q_norm / k_norm weights
outside the TP plan (tests/workers/qk_norm_train.py: model.qk_norm=true under a plan that forgot
their lines); their gradients were per-rank partial sums never reduced over tp, and the ranks'
copies drifted apart without a word.

Unit tests build the real apps on meta on torch's fake process group through the planner's
helpers (lingua.launch.plan, plan_memory: they run the same check as the trainer); distributed
ones run real ranks with gloo.
"""

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from apps.moe.parallelize import parallelize_moe
from lingua.errors import ConfigError
from lingua.launch import plan as planner
from lingua.launch import plan_memory
from lingua.models.llama import model as llama_model
from lingua.models.llama import parallelize as llama_parallelize
from lingua.models.llama.model import Attention
from lingua.parallel.distributed import parallel_dims
from tests.conftest import TINY_MODEL, run_python, run_torchrun, tiny_args
from tests.equivalence import assert_equivalent
from tests.workers.qk_norm_train import without_qk_norm_lines

QK_PLAN_LINES = ['"attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True)',
                 '"attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)']
QK_PARAMS = [f"layers.{i}.attention.{n}_norm.weight" for i in (0, 1) for n in ("q", "k")]
QK_NORM = "model.qk_norm=true"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """What validation needs to compose a run's config: a jsonl corpus with held-out data."""
    root = tmp_path_factory.mktemp("coverage_data")
    (root / "val").mkdir()
    for path in (root / "0.jsonl", root / "val" / "0.jsonl"):
        path.write_text('{"text": "a document"}\n')
    return [f"data.root={root}", "data.format=jsonl", "data.prepare_embedded=false",
            "data.seq_len=64", *TINY_MODEL]


def build(data, tmp_path, app_module: str, world: int, *overrides, parallelize=None):
    """The app's parts for rank 0 of `world`, parallelized on the fake process group; raises
    what the coverage check raises."""
    app, args, _ = planner.load_args(app_module, [*data, f"dump_dir={tmp_path / 'run'}",
                                                  *overrides], world, "cpu")
    app_desc = app if parallelize is None else dataclasses.replace(app, parallelize=parallelize)
    dims = parallel_dims(args.distributed, world)
    with plan_memory._quiet(), plan_memory.fake_process_group(0, world):
        parts, _ = plan_memory._build_parts(args, app_desc, dims, 0, world)
    return parts


def param(parts, name):
    return dict(p for part in parts for p in part.named_parameters())[name]


# ---------------------------------------------------------------------------------------------
# The shipped apps pass in every layout


LAYOUTS = [
    ("apps.llama.train", 2, ["distributed.tp=2"]),
    ("apps.llama.train", 4, ["distributed.tp=2"]),                       # tp x fsdp
    ("apps.llama.train", 2, ["distributed.cp=2"]),
    ("apps.llama.train", 4, ["distributed.cp=2", "distributed.tp=2"]),
    ("apps.llama.train", 8, ["distributed.tp=2", "distributed.pp=2", "distributed.dp_replicate=2"]),
    ("apps.llama.train", 2, ["distributed.tp=2", "model.family=qwen3", "model.qk_norm=true",
                             "model.head_dim=24"]),                     # Qwen3's shape
    ("apps.moe.train", 2, ["distributed.tp=2"]),
    ("apps.moe.train", 4, ["distributed.tp=2"]),                         # tp x fsdp
    ("apps.moe.train", 2, ["distributed.ep=2"]),
    ("apps.moe.train", 4, ["distributed.ep=2", "distributed.tp=2"]),
    ("apps.moe.train", 4, ["distributed.ep=2", "distributed.cp=2"]),
    ("apps.moe.train", 2, ["distributed.cp=2"]),
    ("apps.qwen3_next.train", 2, ["distributed.tp=2"]),
    ("apps.qwen3_next.train", 4, ["distributed.ep=2", "distributed.tp=2"]),
]
# 4 layers: Qwen3-Next's fourth is its full-attention one
EXTRA = {"apps.moe.train": ["model.n_experts=4"],
         "apps.qwen3_next.train": ["model.n_experts=4", "model.n_layers=4"]}


@pytest.mark.parametrize("app_module,world,layout", LAYOUTS,
                         ids=[f"{a.split('.')[1]}-{w}-{'-'.join(o)}" for a, w, o in LAYOUTS])
def test_shipped_apps_pass(data, tmp_path, app_module, world, layout):
    parts = build(data, tmp_path, app_module, world, *layout, *EXTRA.get(app_module, []))
    assert any(isinstance(p, DTensor) for part in parts for p in part.parameters())


# ---------------------------------------------------------------------------------------------
# Refusals on the fake process group


@pytest.mark.parametrize("world", [2, 4])    # tp=2; tp=2 x fsdp=2
def test_qk_norm_outside_the_tp_plan_is_refused(data, tmp_path, monkeypatch, world):
    monkeypatch.setattr(llama_parallelize, "attention_plan",
                        without_qk_norm_lines(llama_parallelize.attention_plan))
    with pytest.raises(ConfigError) as err:
        build(data, tmp_path, "apps.llama.train", world, QK_NORM, "distributed.tp=2")
    message = str(err.value)
    for name in QK_PARAMS:
        assert f"{name} (not reduced over tp=2)" in message, message
    assert "layers.0.attention.wq.weight" not in message
    assert ("Add to the block plan: " + ", ".join(QK_PLAN_LINES)) in message, message


def test_qk_norm_with_the_suggested_plan_lines_passes(data, tmp_path):
    """The shipped plan (attention_plan) has the lines the refusal names."""
    parts = build(data, tmp_path, "apps.llama.train", 4, QK_NORM, "distributed.tp=2")
    weight = param(parts, "layers.0.attention.q_norm.weight")
    assert weight.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp")
    assert weight.placements[1] == Replicate()


class GatedAttention(Attention):
    """A parameter held by attention itself, next to its Linear submodules."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = nn.Parameter(torch.ones(self.head_dim))


def test_parameter_held_by_a_planned_module_is_refused(data, tmp_path, monkeypatch):
    monkeypatch.setattr(llama_model, "Attention", GatedAttention)
    with pytest.raises(ConfigError, match=r"layers\.0\.attention\.gate \(not reduced over tp=2\)"
                       r".*The block's 'attention' holds the parameter next to submodules: move "
                       r"it into a submodule of its own"):
        build(data, tmp_path, "apps.llama.train", 2, "distributed.tp=2")


def test_model_without_fsdp_under_cp_is_refused(data, tmp_path):
    from lingua.parallel.context_parallel import apply_cp

    def cp_only(part, env, args):   # a plan that forgot apply_fsdp
        return apply_cp(part, env.mesh["cp"], args.cp_backend)

    with pytest.raises(ConfigError, match=r"tok_embeddings\.weight \(not reduced over cp=2\).*"
                                          r"must end with "
                                          r"lingua\.parallel\.distributed\.apply_fsdp"):
        build(data, tmp_path, "apps.llama.train", 2, "distributed.cp=2", parallelize=cp_only)


def test_experts_outside_expert_parallel_are_refused(data, tmp_path):
    def without_ep(part, env, args):   # a plan that never calls apply_ep
        return parallelize_moe(part, env, dataclasses.replace(args, ep=1))

    with pytest.raises(ConfigError, match=r"layers\.1\.moe\.experts\.w1 \(not reduced over ep=2\)"
                                          r".*lingua\.parallel\.expert_parallel\.apply_ep"):
        build(data, tmp_path, "apps.moe.train", 2, "distributed.ep=2", "model.n_experts=4",
              parallelize=without_ep)


def test_ep_with_no_expert_parallel_parameter_at_all_is_refused(data, tmp_path, monkeypatch):
    """Experts that are not GroupedExperts-like escape the per-module rule; then no parameter is
    on the ep mesh, which is refused too."""
    from lingua.parallel import coverage

    def without_ep(part, env, args):
        return parallelize_moe(part, env, dataclasses.replace(args, ep=1))

    monkeypatch.setattr(coverage, "is_grouped_experts", lambda module: False)
    with pytest.raises(ConfigError, match=r"splits no parameter over the ep ranks "
                                          r"\(distributed\.ep=2\).*apply_ep"):
        build(data, tmp_path, "apps.moe.train", 2, "distributed.ep=2", "model.n_experts=4",
              parallelize=without_ep)


# ---------------------------------------------------------------------------------------------
# Real ranks


@pytest.mark.distributed
def test_every_rank_refuses_when_one_rank_finds_a_plain_parameter(tmp_path):
    run_torchrun(2, "tests.workers.coverage_worker", [str(tmp_path)])
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "1.weight (not reduced over tp=2)" in text, f"rank {rank}: {text}"
        assert 'Add to the root plan: "1": SequenceParallel()' in text, f"rank {rank}: {text}"


@pytest.mark.distributed
def test_qk_norm_under_tp_refused_without_the_plan_lines_then_equivalent_with_them(corpus,
                                                                                   tmp_path):
    refused = tmp_path / "refused"
    proc = run_torchrun(2, "tests.workers.qk_norm_train",
                        tiny_args(corpus, refused, QK_NORM, "distributed.tp=2"), check=False)
    assert proc.returncode != 0
    assert "error: The parallel plan leaves 4 parameter(s)" in proc.stderr, proc.stderr[-3000:]
    for text in (*QK_PARAMS, *QK_PLAN_LINES):
        assert text in proc.stderr, proc.stderr[-3000:]
    assert not (refused / "metrics.jsonl").exists()       # refused before the first step

    # The shipped plan: tp2 trains the QK-norm as one process does.
    one = tmp_path / "one"
    run_python("apps.llama.train", tiny_args(corpus, one, QK_NORM))
    tp = tmp_path / "tp"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, tp, QK_NORM, "distributed.tp=2"))
    assert_equivalent(tp, one)
