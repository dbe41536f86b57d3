"""The probe: statistics against direct computation, the hooks' life cycle, output, plots,
alerts, wandb, and the same numbers under FSDP x TP and PP as in one process."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from apps.llama import train
from lingua.observe import probe, probe_report, probe_stats
from tests import launcher
from tests.conftest import REPO, read_metrics, run_python, run_torchrun, tiny_args
from tests.equivalence import assert_equivalent

QUANTILES = [0.001, 0.01, 0.5, 0.99, 0.999]


def direct_stats(x: torch.Tensor) -> dict:
    x = x.double().reshape(-1)
    finite = x[torch.isfinite(x)]
    mean = finite.mean().item()
    std = finite.std(unbiased=False).item()
    out = {"count": float(finite.numel()), "nonfinite": float(x.numel() - finite.numel()),
           "mean": mean, "std": std, "rms": finite.pow(2).mean().sqrt().item(),
           "min": finite.min().item(), "max": finite.max().item(),
           "abs_max": finite.abs().max().item(), "zero_frac": (finite == 0).double().mean().item(),
           "kurtosis": ((finite - mean) ** 4).mean().item() / std ** 4,
           "outlier_frac": ((finite - mean).abs() > 6 * std).double().mean().item()}
    for q in QUANTILES:
        out[f"q{q:g}"] = torch.quantile(finite, q).item()
    return out


@pytest.mark.parametrize("name", ["normal", "shifted", "heavy_tailed", "sparse", "with_nan"])
def test_statistics_match_direct_computation(name):
    torch.manual_seed(0)
    x = {"normal": lambda: torch.randn(200_000),
         "shifted": lambda: 3 * torch.randn(100_000) + 1,
         "heavy_tailed": lambda: torch.distributions.StudentT(2.5).sample((200_000,)),
         "sparse": lambda: torch.randn(50_000) * (torch.rand(50_000) > 0.7),
         "with_nan": lambda: torch.cat([torch.randn(10_000), torch.tensor([math.nan, math.inf])]),
         }[name]()
    got = probe_stats.finish(*probe_stats.summarize(x), set(probe.ALL_STATS), QUANTILES)
    want = direct_stats(x)
    for key in ("count", "nonfinite", "min", "max", "abs_max"):
        assert got[key] == want[key], key
    for key in ("mean", "std", "rms", "zero_frac", "kurtosis"):
        # float32 elementwise powers, float64 sums
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    # From the histogram: within a bin (3.7%) of the exact value.
    for q in QUANTILES:
        assert got[f"q{q:g}"] == pytest.approx(want[f"q{q:g}"], rel=0.04, abs=1e-8), q
    assert got["outlier_frac"] == pytest.approx(want["outlier_frac"], rel=0.05, abs=2e-5)


def test_sums_of_shards_give_the_statistics_of_the_whole():
    torch.manual_seed(1)
    x = torch.randn(30_000) * torch.linspace(0.1, 5, 30_000)
    parts = [probe_stats.summarize(chunk) for chunk in x.split([7_000, 13_000, 10_000])]
    sums = sum(p[0] for p in parts)
    maxes = torch.stack([p[1] for p in parts]).amax(0)
    whole = probe_stats.finish(*probe_stats.summarize(x), set(probe.ALL_STATS), QUANTILES)
    assert (probe_stats.finish(sums, maxes, set(probe.ALL_STATS), QUANTILES)
            == pytest.approx(whole, rel=1e-12))


def test_attention_statistics_match_a_direct_softmax():
    torch.manual_seed(2)
    b, s, h, d = 2, 10, 3, 8
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    doc = torch.tensor([[0] * 4 + [1] * 6, [0] * 10])
    mask = (torch.ones(s, s, dtype=torch.bool).tril()
            & (doc[:, :, None] == doc[:, None, :]))[:, None]
    for m in (None, mask):
        sums, maxes = probe_stats.attention_summary(q, k, m, n_queries=s)
        got = probe_stats.finish_attention(sums, maxes)
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        allowed = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
        if m is not None:
            allowed = allowed & m
        logits = logits.masked_fill(~allowed, -math.inf)
        p = logits.softmax(-1)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
        assert got["max_logit"] == pytest.approx(logits.max().item(), rel=1e-6)
        assert got["entropy"] == pytest.approx(entropy.mean().item(), rel=1e-6)
        seen = allowed.expand(b, h, s, s).sum(-1).double()
        assert got["entropy_frac"] == pytest.approx(entropy.sum().item() / seen.log().sum().item(),
                                                    rel=1e-6)


def test_attention_statistics_read_grouped_kv_heads_like_repeated_ones():
    # On CPU sdpa gets k with its own (fewer) heads; the probe must see what repeat_kv would give.
    from lingua.model.layers import repeat_kv

    torch.manual_seed(3)
    q, k = torch.randn(2, 12, 6, 8), torch.randn(2, 12, 2, 8)
    grouped = probe_stats.finish_attention(*probe_stats.attention_summary(q, k, None,
                                                                          n_queries=12))
    repeated = probe_stats.finish_attention(*probe_stats.attention_summary(
        q, repeat_kv(k, k, 6)[0], None, n_queries=12))
    assert grouped == repeated


def test_a_hook_on_attention_changes_nothing_the_step_computes():
    """The probe hooks CoreAttention; the step it watches must compute bit for bit like an
    unwatched one (the spike tests compare runs exactly), including sdpa's grouped k/v path."""
    from lingua.model.layers import CoreAttention
    from lingua.models.llama.model import LlamaArgs, Transformer

    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, 64, (2, 16))

    def step():
        model.zero_grad()
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain = step()
    kv_heads = []
    handles = [m.register_forward_hook(lambda mod, inp, out: kv_heads.append(inp[1].shape[2]))
               for m in model.modules() if isinstance(m, CoreAttention)]
    watched = step()
    for h in handles:
        h.remove()
    assert kv_heads == [2, 2]   # grouped: sdpa groups the heads, hooked or not
    assert torch.equal(plain[0], watched[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1]))


def test_router_load_and_entropy():
    scores = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    experts = torch.tensor([[0, 1], [1, 2], [0, 1]])
    got = probe_stats.finish_router(*probe_stats.router_summary(scores, experts))
    counts = torch.tensor([2.0, 3.0, 1.0, 0.0])
    assert got["load_max"] == pytest.approx(3 / 6 * 4) and got["load_min"] == 0.0
    assert got["load_cv"] == pytest.approx((counts.std(unbiased=False) / counts.mean()).item())
    p = scores / scores.sum(-1, keepdim=True)
    assert got["entropy"] == pytest.approx(-(p * p.clamp_min(1e-30).log()).sum(-1).mean().item())


def test_hooks_exist_only_during_a_probe_step(corpus, tmp_path):
    from lingua.models.llama.model import Transformer
    from lingua.parallel.distributed import DistributedArgs, init

    cfg = train.load_config(tiny_args(corpus, tmp_path / "hooks"))
    model = Transformer(cfg.model)
    model.init_weights()
    env = init(DistributedArgs())
    p = probe.Probe(probe.ProbeArgs(every=2), [model], env, tmp_path / "hooks")

    def n_hooks():
        return sum(len(m._forward_hooks) for m in model.modules())

    assert n_hooks() == 0
    p.start()
    assert n_hooks() > 20
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    model(tokens).sum().backward()
    p.stop()
    assert n_hooks() == 0
    model(tokens)  # not recorded
    p.finish_step(2)
    [line] = [json.loads(x) for x in (tmp_path / "hooks" / "probe" / "probe.jsonl").open()]
    assert line["stats"]["layers.0/output"]["count"] == 2 * 16 * cfg.model.dim


def test_a_training_run_records_the_tensors_it_names(corpus, tmp_path, monkeypatch):
    """The probe's numbers against the tensors themselves, captured by the test's own hooks in
    the same step: a block's input and output in the forward of each micro-batch (the probe adds
    the micro-batches of a step up), and a parameter and its gradient as clipping receives them
    (the probe records them after backward, before clipping). A hook on the wrong module or
    tensor, or at the wrong step, gives other numbers."""
    from lingua import optim
    from lingua.launch import run

    block, param = "layers.1", "layers.0.feed_forward.w1.weight"
    probed_step = 2
    acts = {"input": {}, "output": {}}  # step -> [tensor per micro-batch]
    params = {}                         # step -> (weight, grad before, grad after clipping)

    def capture_block(module, inputs, output):
        if torch.is_grad_enabled():     # training forwards only (validation runs no_grad)
            step = len(params) + 1      # clip_grad_norm ends each step's forwards/backwards
            acts["input"].setdefault(step, []).append(inputs[0].detach().clone())
            acts["output"].setdefault(step, []).append(output.detach().clone())

    build_model_parts = run.build_model_parts

    def build_and_hook(*a, **k):
        parts, stage_ids = build_model_parts(*a, **k)
        dict(parts[0].named_modules())[block].register_forward_hook(capture_block)
        return parts, stage_ids

    clip_grad_norm = optim.clip_grad_norm

    def copy_then_clip(parts, *a, **k):
        p = dict(parts[0].named_parameters())[param]
        weight, grad = p.detach().clone(), p.grad.detach().clone()
        norm = clip_grad_norm(parts, *a, **k)
        params[len(params) + 1] = (weight, grad, p.grad.detach().clone())
        return norm

    monkeypatch.setattr(run, "build_model_parts", build_and_hook)
    monkeypatch.setattr(optim, "clip_grad_norm", copy_then_clip)
    dump = tmp_path / "direct"
    # Two micro-batches a step, and clipping on, so that the aggregation over micro-batches and
    # the moment of recording (before clipping) both matter.
    assert train.main(tiny_args(corpus, dump, f"probe.every={probed_step}", "data.batch_size=4",
                                "data.grad_accum=2", "optim.clip=0.1",
                                steps=probed_step)) == 0
    [line] = [json.loads(x) for x in (dump / "probe" / "probe.jsonl").read_text().splitlines()]
    assert line["step"] == probed_step
    assert [len(acts["output"][s]) for s in (1, 2)] == [2, 2]  # 2 micro-batches, each step
    weight, grad, clipped = params[probed_step]
    assert not torch.allclose(grad, clipped, rtol=1e-3)  # clipping changed it after the probe
    module, _, name = param.rpartition(".")
    tensors = {f"{block}/input": torch.cat([t.reshape(-1) for t in acts["input"][probed_step]]),
               f"{block}/output": torch.cat([t.reshape(-1) for t in acts["output"][probed_step]]),
               f"{module}/{name}": weight, f"{module}/{name}.grad": grad}
    for key, tensor in tensors.items():
        assert tensor.dtype == torch.float32, key
        got, want = line["stats"][key], direct_stats(tensor)
        for stat in ("count", "nonfinite", "min", "max", "abs_max"):
            assert got[stat] == want[stat], (key, stat)
        for stat in ("mean", "std", "rms", "zero_frac", "kurtosis"):
            assert got[stat] == pytest.approx(want[stat], rel=1e-5, abs=1e-12), (key, stat)
        # Quantiles come from the histogram: within a bin (3.7%) of the values ranked about
        # q * count (near zero, neighbouring values can be far apart, so not of torch.quantile).
        ranked = tensor.double().reshape(-1).sort().values
        for q in (0.01, 0.5, 0.99):
            k = q * (ranked.numel() - 1)
            lo, hi = ranked[math.floor(k) - 1].item(), ranked[math.ceil(k) + 1].item()
            assert lo - 0.04 * abs(lo) <= got[f"q{q:g}"] <= hi + 0.04 * abs(hi), (key, q, lo, hi)


def run_probe(corpus, dump, *extra, steps=4):
    run_python("apps.llama.train", tiny_args(corpus, dump, "probe.every=2", *extra, steps=steps))
    return [json.loads(x) for x in (dump / "probe" / "probe.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_records_every_kind_and_the_reader_and_plots_work(corpus, tmp_path):
    dump = tmp_path / "run"
    lines = run_probe(corpus, dump)
    assert [line["step"] for line in lines] == [2, 4]
    stats = lines[0]["stats"]
    for key in ("layers.0/input", "layers.0/output", "layers.0.attention/output",
                "layers.0.feed_forward/output", "layers.0.attention_norm/output",
                "layers.1.feed_forward.w2/input", "layers.0.attention.wq/weight",
                "layers.0.attention.wq/weight.grad", "tok_embeddings/weight",
                "layers.1.attention.core/attention"):
        assert key in stats, key
    block = stats["layers.0/output"]
    assert set(block) >= {"mean", "std", "rms", "min", "max", "abs_max", "kurtosis", "zero_frac",
                          "outlier_frac", "q0.5", "q0.99"}
    assert 0 < stats["layers.1.attention.core/attention"]["entropy_frac"] <= 1

    df = probe_report.read(dump)
    assert list(df.columns) == ["step", "module", "tensor", "stat", "value"]
    value = df[(df.step == 2) & (df.module == "layers.0") & (df.tensor == "output") &
               (df.stat == "rms")].value.item()
    assert value == block["rms"]

    proc = launcher.launch("lingua.probe", ["plot", str(dump)], 0,
                           dict(os.environ, PYTHONPATH=str(REPO)), REPO, timeout=180)
    assert proc.returncode == 0, proc.stderr
    paths = [line for line in proc.stdout.splitlines() if line.strip()]
    names = {os.path.basename(p) for p in paths}
    assert {"heatmap_abs_max.png", "lines_rms.png", "attention.png", "loss.png"} <= names
    import matplotlib.image

    for path in paths:
        image = matplotlib.image.imread(path)
        assert image.shape[0] >= 300 and image.shape[1] >= 600, path
        assert image[..., :3].std() > 0.05, f"{path} looks blank"


# -- plots of a recorded probe.jsonl (written here: no training needed) ------------------------
def fork_probe_run(dump):
    """A fork's run: 2 layers with a new attention.q_norm, probed at steps 3 and 6, metrics.jsonl
    logged every 2 steps (so step 3 has no loss row)."""
    (dump / "probe").mkdir(parents=True)
    lines = []
    for step in (3, 6):
        stats = {}
        for layer in (0, 1):
            value = {"rms": 1.0 + layer + step / 10, "abs_max": 4.0 + step, "kurtosis": 3.0}
            stats[f"layers.{layer}/output"] = value
            stats[f"layers.{layer}.attention.q_norm/output"] = {**value, "rms": 0.5 + layer}
            stats[f"layers.{layer}.attention.q_norm/weight"] = {**value, "rms": 1.0}
            stats[f"layers.{layer}.attention.wo/weight"] = value
            stats[f"layers.{layer}.attention.core/attention"] = {
                "max_logit": 2.0 + layer, "entropy": 1.5, "entropy_frac": 0.6}
        stats["output/weight"] = {"rms": 0.02, "abs_max": 0.1, "kurtosis": 3.0}
        lines.append(json.dumps({"step": step, "alerts": [], "stats": stats}))
    (dump / "probe" / "probe.jsonl").write_text("\n".join(lines) + "\n")
    rows = [{"step": s, "loss": 5.0 - s / 2, **({"val_loss": 4.9 - s / 2} if s == 6 else {})}
            for s in (2, 4, 6)]
    (dump / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dump


@pytest.fixture
def figures(monkeypatch):
    """{file name: the matplotlib figure} of what probe.plot draws, instead of PNGs."""
    import lingua.observe.plot

    drawn = {}

    def keep(fig, path):
        drawn[Path(path).name] = fig
        return Path(path)

    monkeypatch.setattr(lingua.observe.plot, "save_figure", keep)
    yield drawn
    import matplotlib.pyplot as plt

    plt.close("all")


def test_probe_plots_label_every_axis_and_mark_the_probe_steps(tmp_path, figures):
    probe_report.plot(fork_probe_run(tmp_path / "run"), stats=("rms",))
    assert set(figures) == {"heatmap_rms.png", "lines_rms.png", "attention.png", "loss.png"}
    heatmap = figures["heatmap_rms.png"]
    panels = [ax for ax in heatmap.axes if ax.get_title()]
    colorbars = [ax for ax in heatmap.axes if not ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["rms of block output (layer x step)",
                                                 "rms of attention.wo weight (layer x step)"]
    assert len(colorbars) == len(panels)
    assert {ax.get_ylabel().splitlines()[0] for ax in colorbars} == {"rms"}
    assert {(ax.get_xlabel(), ax.get_ylabel()) for ax in panels} == {("step", "layer")}
    (lines_ax,) = figures["lines_rms.png"].axes
    assert [line.get_label() for line in lines_ax.get_lines()] == ["layer 0", "layer 1"]
    assert (lines_ax.get_xlabel(), lines_ax.get_ylabel()) == ("step", "rms")
    assert all(ax.get_ylabel() for ax in figures["attention.png"].axes)
    (loss_ax,) = figures["loss.png"].axes
    marks = {line.get_label(): line for line in loss_ax.get_lines()}["probe step (2)"]
    # Step 3 logged no loss: its mark sits on the curve between steps 2 and 4.
    assert marks.get_xydata().tolist() == [[3.0, 3.5], [6.0, 2.0]]
    assert marks.get_markersize() >= 6 and loss_ax.get_ylabel() == "cross-entropy (nats/token)"
    val = {line.get_label(): line for line in loss_ax.get_lines()}["val_loss"]
    assert val.get_linestyle() == "-" and val.get_marker() == "o"


def outlier_probe_run(dump):
    """4 layers x 6 probe steps of smoothly growing block-output rms, one cell (layer 2, step
    30) a thousand times larger; attention.wo weights without an outlier."""
    (dump / "probe").mkdir(parents=True)
    lines = []
    for step in range(10, 70, 10):
        stats = {}
        for layer in range(4):
            rms = 1000.0 if (layer, step) == (2, 30) else 1.0 + layer / 10 + step / 100
            stats[f"layers.{layer}/output"] = {"rms": rms}
            stats[f"layers.{layer}.attention.wo/weight"] = {"rms": 0.02 + layer / 1000}
        lines.append(json.dumps({"step": step, "alerts": [], "stats": stats}))
    (dump / "probe" / "probe.jsonl").write_text("\n".join(lines) + "\n")
    (dump / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 3.0}) + "\n")
    return dump


def test_probe_figures_name_the_run_and_heatmaps_clip_an_outlier(tmp_path, figures):
    probe_report.plot(outlier_probe_run(tmp_path / "qk_norm_seed3"), stats=("rms",))
    assert set(figures) == {"heatmap_rms.png", "lines_rms.png", "loss.png"}
    for name, fig in figures.items():   # pasted into a report, each still names its run
        assert fig.get_suptitle().startswith("qk_norm_seed3: "), name
    block, wo = [ax.get_images()[0] for ax in figures["heatmap_rms.png"].axes if ax.get_images()]
    # The outlier takes the top colour; the colours span the other cells (1.1 to 1.9), so their
    # growth stays visible, and the colour bar says so.
    assert 1.9 <= block.norm.vmax < 10 and block.norm.vmin == pytest.approx(1.1)
    assert block.colorbar.extend == "max"
    label = block.colorbar.ax.get_ylabel()
    assert "clipped at quartiles ± 3 IQR" in label and "1 cell(s) beyond" in label
    assert (wo.norm.vmin, wo.norm.vmax) == pytest.approx((0.02, 0.023))   # nothing to clip
    assert wo.colorbar.extend == "neither" and "full range" in wo.colorbar.ax.get_ylabel()


def test_modules_option_draws_the_chosen_modules(tmp_path, figures):
    dump = fork_probe_run(tmp_path / "run")
    probe_report.plot(dump, stats=("rms", "abs_max"),
                      modules=["layers.*.attention.q_norm", "output"])
    output_ax, weight_ax = figures["lines_rms.png"].axes
    assert output_ax.get_title() == "rms of output, one line per module"
    assert [line.get_label() for line in output_ax.get_lines()] == \
        ["layers.0.attention.q_norm", "layers.1.attention.q_norm"]
    assert [line.get_xydata().tolist() for line in output_ax.get_lines()] == \
        [[[3, 0.5], [6, 0.5]], [[3, 1.5], [6, 1.5]]]
    assert [line.get_label() for line in weight_ax.get_lines()] == \
        ["output", "layers.0.attention.q_norm", "layers.1.attention.q_norm"]
    titles = [ax.get_title() for ax in figures["heatmap_abs_max.png"].axes if ax.get_title()]
    assert titles == ["abs_max of attention.q_norm output (layer x step)",
                      "abs_max of attention.q_norm weight (layer x step)"]


def test_default_stats_are_those_the_run_recorded(tmp_path, figures):
    # probe.stats=[rms] records no abs_max or kurtosis: the default plot (as at the end of a run,
    # for wandb) draws rms alone rather than refusing; naming abs_max is refused.
    dump = fork_probe_run(tmp_path / "run")
    path = dump / "probe" / "probe.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for line in lines:
        line["stats"] = {k: ({"rms": v["rms"]} if "rms" in v else v)
                         for k, v in line["stats"].items()}
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    probe_report.plot(dump)
    assert {"heatmap_rms.png", "lines_rms.png"} <= set(figures)
    assert not any("abs_max" in name or "kurtosis" in name for name in figures)
    with pytest.raises(ValueError, match="abs_max not recorded"):
        probe_report.plot(dump, stats=("abs_max",))


def test_cli_refuses_unknown_stats_and_modules_naming_the_known_ones(tmp_path, capsys):

    dump = fork_probe_run(tmp_path / "run")
    out = tmp_path / "plots"
    proc = run_python("lingua.probe",
                      ["plot", str(dump), "--stats", "rms,bogus", "--out", str(out)],
                      check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "bogus" in proc.stderr and "known: abs_max,kurtosis,rms" in proc.stderr
    assert probe_report.main(["plot", str(dump), "--modules", "layers.*.attention.k_norm",
                              "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "'layers.*.attention.k_norm' matches no module" in err
    assert "layers.*.attention.q_norm" in err and "output" in err
    assert not out.exists()   # refused before anything is drawn
    assert probe_report.main(["plot", str(dump), "--modules", "layers.1.attention.q_norm",
                              "--stats", "rms", "--out", str(out)]) == 0
    assert {Path(p).name for p in capsys.readouterr().out.split()} == \
        {"heatmap_rms.png", "lines_rms.png", "attention.png", "loss.png"}


def test_selection_of_modules_and_tensors(corpus, tmp_path):
    lines = run_probe(corpus, tmp_path / "sel", "probe.modules=[layers.1.feed_forward*]",
                      "probe.tensors=[output,grad]", "probe.stats=[rms,abs_max]", steps=2)
    keys = set(lines[0]["stats"])
    assert keys and all(k.startswith("layers.1.feed_forward") for k in keys), keys
    assert {k.rpartition("/")[2] for k in keys} == {"output", "weight.grad"}
    assert all(set(v) == {"rms", "abs_max"} for v in lines[0]["stats"].values())


@pytest.mark.slow
def test_activation_checkpointing_does_not_count_twice(corpus, tmp_path):
    plain = run_probe(corpus, tmp_path / "plain", steps=2)[0]["stats"]
    ac = run_probe(corpus, tmp_path / "ac", "distributed.ac=full", steps=2)[0]["stats"]
    assert ac.keys() == plain.keys()
    for key in plain:
        assert ac[key].get("count") == plain[key].get("count"), key
        for stat in ("rms", "abs_max", "entropy"):
            if stat in plain[key]:
                assert ac[key][stat] == pytest.approx(plain[key][stat], rel=1e-6), (key, stat)


@pytest.mark.slow
def test_alerts_are_logged_counted_and_written(corpus, tmp_path):
    dump = tmp_path / "alerts"
    proc = run_python("apps.llama.train", tiny_args(corpus, dump, "probe.every=2",
                                                    "probe.alert_abs_max=0.5", steps=4))
    lines = [json.loads(x) for x in (dump / "probe" / "probe.jsonl").read_text().splitlines()]
    assert lines[0]["alerts"] and "abs_max" in lines[0]["alerts"][0]
    assert "probe alert: step 2:" in proc.stdout + proc.stderr
    rows = {row["step"]: row for row in read_metrics(dump)}
    assert rows[2]["probe_alerts"] == len(lines[0]["alerts"]) and rows[1]["probe_alerts"] == 0


def test_jump_alert_against_the_running_median():
    from lingua.parallel.distributed import DistributedArgs, init

    p = probe.Probe(probe.ProbeArgs(alert_jump=3.0), [], init(DistributedArgs()), "/nonexistent")
    for step, value in enumerate([1.0, 1.1, 0.9, 1.0, 5.0], 1):
        alerts = p._alerts(step, {"layers.0/output": {"rms": value}})
    assert len(alerts) == 1 and "layers.0/output rms=5" in alerts[0] and "step 5" in alerts[0]


@pytest.mark.slow
def test_probe_summaries_and_plots_reach_wandb_offline(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    dump = tmp_path / "wb"
    train.main(tiny_args(corpus, dump, "logging.wandb=true", "probe.every=2", steps=4))
    [run] = list((dump / "wandb").glob("offline-run-*"))
    history = b"".join(p.read_bytes() for p in run.glob("*.wandb"))
    assert b"probe/layers.0/output/abs_max" in history
    images = list(run.rglob("media/images/**/*.png"))
    assert any("heatmap_abs_max" in p.name for p in images), images


def test_probe_off_records_nothing(corpus, tmp_path):
    dump = tmp_path / "off"
    run_python("apps.llama.train", tiny_args(corpus, dump, steps=2))
    assert not (dump / "probe").exists()
    assert "probe_alerts" not in read_metrics(dump)[0]


def _compare(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for key in want:
        for stat, value in want[key].items():
            other = got[key][stat]
            if isinstance(value, float) and math.isnan(value):  # e.g. kurtosis of constant norms
                assert math.isnan(other), (key, stat)
            elif stat in ("count", "nonfinite"):
                assert other == value, (key, stat)
            elif stat == "kurtosis" and key.endswith("norm/weight"):
                # norm weights are 1 +- one Adam step, whose sign flips where a gradient is ~0 and
                # rounding differs between layouts: the kurtosis of that near-constant vector
                # magnifies it. The weights' other stats are compared tightly.
                assert other == pytest.approx(value, rel=0.05), (key, stat)
            elif stat.startswith("q") or stat == "outlier_frac":
                # a value on a bin edge may land in the neighbouring bin
                assert other == pytest.approx(value, rel=0.05, abs=1e-6), (key, stat)
            else:
                assert other == pytest.approx(value, rel=1e-4, abs=1e-6), (key, stat)


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, layout, batch", [
    (4, ["distributed.dp_shard=2", "distributed.tp=2"], 4),
    (2, ["distributed.pp=2", "distributed.dp_shard=1", "distributed.pp_microbatches=4"], 8),
])
def test_parallel_layouts_record_the_numbers_of_one_process(corpus, tmp_path, nproc, layout, batch):
    # Both steps: a pipeline's first step too, whose extra shape-inference forwards (torch's)
    # the probe leaves out (lingua.model.layers.inferring_shapes).
    single = tmp_path / "single"
    run_python("apps.llama.train", tiny_args(corpus, single, "probe.every=1", "data.batch_size=8",
                                             steps=2))
    refs = [json.loads(x) for x in (single / "probe" / "probe.jsonl").open()]
    dump = tmp_path / "parallel"
    run_torchrun(nproc, "apps.llama.train", tiny_args(corpus, dump, "probe.every=1",
                                                      f"data.batch_size={batch}", *layout,
                                                      steps=2))
    lines = [json.loads(x) for x in (dump / "probe" / "probe.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [ref["step"] for ref in refs] == [1, 2]
    for line, ref in zip(lines, refs):
        _compare(line["stats"], ref["stats"])
    assert_equivalent(dump, single)  # and the run itself computed what one process does


@pytest.mark.slow
def test_moe_router_load_and_entropy_are_recorded(corpus, tmp_path):
    from tests.test_moe_train import moe_args

    dump = tmp_path / "moe"
    run_python("apps.moe.train", moe_args(corpus, dump, "probe.every=2", steps=2))
    [line] = [json.loads(x) for x in (dump / "probe" / "probe.jsonl").read_text().splitlines()]
    routers = {k: v for k, v in line["stats"].items() if k.endswith("/router")}
    assert routers, sorted(line["stats"])[:20]
    for values in routers.values():
        assert 0 <= values["load_min"] <= 1 <= values["load_max"] <= 4  # 4 experts
        assert 0 < values["entropy"] <= math.log(4) + 1e-6
    assert any(k.endswith("experts/w1") for k in line["stats"])  # grouped expert weights too


@pytest.mark.distributed
def test_context_parallel_records_the_numbers_of_one_process(corpus, tmp_path):
    """cp=2: each rank holds half of every sequence; the activations' statistics are those of
    the whole sequences (attention entropy is not recorded under cp: each rank sees part of the
    keys, and the probe says so)."""
    single = tmp_path / "single"
    run_python("apps.llama.train", tiny_args(corpus, single, "probe.every=1", steps=1))
    [ref] = [json.loads(x)["stats"] for x in (single / "probe" / "probe.jsonl").open()]
    dump = tmp_path / "cp"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, dump, "probe.every=1",
                                                  "distributed.cp=2", "distributed.dp_shard=1",
                                                  steps=1))
    [got] = [json.loads(x)["stats"] for x in (dump / "probe" / "probe.jsonl").open()]
    ref = {k: v for k, v in ref.items() if not k.endswith("/attention")}
    _compare({k: v for k, v in got.items() if not k.endswith(".core/input")
              and not k.endswith(".core/output")}, ref)
    assert_equivalent(dump, single)
