import math

import pytest
import torch

from lingua import optim
from lingua.errors import ConfigError
from lingua.optim import OptimArgs, adamw, lr_factor


def test_warmup_is_linear_then_each_schedule_reaches_its_end():
    total = 100
    for name in ("constant", "linear", "cosine", "wsd"):
        args = OptimArgs(scheduler=name, warmup=10, lr_min_ratio=0.1, decay_fraction=0.2)
        factors = [lr_factor(s, args, total) for s in range(total)]
        assert factors[:10] == pytest.approx([(s + 1) / 11 for s in range(10)])
        assert factors[10] == pytest.approx(1.0)
        expected_end = 1.0 if name == "constant" else 0.1
        assert lr_factor(total, args, total) == pytest.approx(expected_end)


def test_cosine_midpoint_and_wsd_plateau():
    args = OptimArgs(scheduler="cosine", warmup=0, lr_min_ratio=0.0)
    assert lr_factor(50, args, 100) == pytest.approx(0.5)
    assert lr_factor(25, args, 100) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    wsd = OptimArgs(scheduler="wsd", warmup=5, lr_min_ratio=0.0, decay_fraction=0.2)
    assert all(lr_factor(s, wsd, 100) == 1.0 for s in range(5, 80))
    assert lr_factor(90, wsd, 100) == pytest.approx(0.5)


def test_weight_decay_groups_split_matrices_from_vectors():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 3))
    decay, no_decay = adamw.param_groups(model, 0.1)
    assert {p.shape for p in decay["params"]} == {torch.Size([10, 4]), torch.Size([3, 4])}
    assert {p.ndim for p in no_decay["params"]} == {1}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


def test_clip_scales_to_max_norm_and_reports_the_norm_before_clipping():
    model = torch.nn.Linear(3, 2, bias=False)
    model.weight.grad = torch.full((2, 3), 2.0)
    norm = optim.clip_grad_norm([model], max_norm=1.0)
    assert norm.item() == pytest.approx(math.sqrt(6 * 4))
    assert model.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(2, 2)
    args = OptimArgs(lr=1e-2, warmup=4, scheduler="linear", lr_min_ratio=0.0)
    optimizers = optim.Optimizers([model], args, total_steps=10, device=torch.device("cpu"))
    seen = []
    for _ in range(10):
        seen.append(optimizers.optimizers[0].param_groups[0]["lr"])
        assert optimizers.lr == seen[-1]
        optimizers.step()
    assert seen == pytest.approx([1e-2 * lr_factor(s, args, 10) for s in range(10)])


@pytest.mark.parametrize("change,key", [({"lr": -1.0}, "optim.lr"),
                                        ({"scheduler": "step"}, "optim.scheduler"),
                                        ({"warmup": -1}, "optim.warmup"),
                                        ({"beta2": 1.0}, "optim.beta2")])
def test_bad_optimizer_values_are_refused_by_name(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        optim.validate_args(OptimArgs(**change), steps=10)


def test_scheduler_position_restores_into_a_different_number_of_groups():
    args = OptimArgs(lr=1e-2, warmup=4, scheduler="cosine")
    one = optim.Optimizers([torch.nn.Linear(2, 2, bias=False)], args, total_steps=10,
                           device=torch.device("cpu"))
    assert len(one.optimizers[0].param_groups) == 1
    for _ in range(6):
        one.step()
    other = optim.Optimizers([torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))],
                             args, total_steps=10, device=torch.device("cpu"))
    assert len(other.optimizers[0].param_groups) == 2
    other.load_scheduler_state(one.scheduler_state())
    assert other.lr == pytest.approx(one.lr)
    assert all(g["lr"] == pytest.approx(one.lr) for g in other.optimizers[0].param_groups)
    other.step()
    one.step()
    assert other.lr == pytest.approx(one.lr)


def test_a_registered_optimizer_trains_and_the_planner_counts_it_by_its_rule(corpus, tmp_path,
                                                                             monkeypatch):
    """The optimizer seam: SGD with momentum, registered in OPTIMIZERS from here as a new file's
    line would register it, trains the debug llama for 2 steps through the real trainer, and
    `lingua.plan` counts its state by its own rule (one fp32 buffer a parameter, not AdamW's two)
    under its own label."""
    from apps.llama import train
    from lingua.launch import plan as planner
    from lingua.models.llama.model import Transformer
    from lingua.optim.spec import OptimizerSpec
    from tests.conftest import read_metrics, tiny_args

    built = []

    def build(part, args, fused):
        built.append(torch.optim.SGD(adamw.param_groups(part, args.weight_decay), lr=args.lr,
                                     momentum=args.beta1))
        return built[-1]

    def state_bytes(parts, args):
        return adamw.local_bytes(p for part in parts for p in part.parameters()), 0

    monkeypatch.setitem(optim.OPTIMIZERS, "sgd_momentum", OptimizerSpec(
        build=build, state_bytes=state_bytes, label="SGD momentum (1 x fp32{only})"))
    train.main(tiny_args(corpus, tmp_path / "run", "optim.name=sgd_momentum", steps=2))
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    [sgd] = built   # the trainer stepped the optimizer the spec built: every buffer is there
    assert all("momentum_buffer" in sgd.state[p] for g in sgd.param_groups for p in g["params"])

    p = planner.plan("apps.llama.train", [f"data.root={corpus}", "data.prepare_embedded=false",
                                          f"dump_dir={tmp_path / 'plan'}",
                                          "optim.name=sgd_momentum"], 1, device_type="cpu")
    with torch.device("meta"):
        model = Transformer(p.args.model)
    assert p.busiest.optim == sum(4 * t.numel() for t in model.parameters())
    assert p.busiest.optim_workspace == 0
    assert "SGD momentum (1 x fp32)" in planner.format_plan(p)
