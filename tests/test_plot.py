import json
import math
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from lingua.errors import ConfigError
from lingua.observe import plot

from .conftest import run_python, tiny_args

EXPECTED_SHAPE = (round(plot.FIGSIZE[1] * plot.DPI), round(plot.FIGSIZE[0] * plot.DPI))


def write_run(dump_dir: Path, offset: float = 0.0, steps: int = 20, val_every: int = 0,
              drop=(), inline=None, appended=()) -> Path:
    """inline: {step: keys merged into that training row}; appended: rows written after the
    training rows, as an evaluation job running beside training appends them."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": 5 * math.exp(-s / 8) + offset, "lr": 1e-3 * min(1.0, s / 5),
               "grad_norm": 1 / s + offset, "tokens_per_s": 1000.0 + 50 * s + 100 * offset,
               "mfu": 0.1 + offset / 10, "data_s": 0.001, "step_s": 0.05}
        if val_every and s % val_every == 0:
            row["val_loss"] = row["loss"] + 0.1
            row["val_ppl"] = math.exp(row["val_loss"])
        for key in drop:
            row.pop(key)
        row.update((inline or {}).get(s, {}))
        lines.append(json.dumps(row))
    lines += [json.dumps(row) for row in appended]
    (dump_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n\n")  # a trailing blank line
    return dump_dir


def check_png(path: Path) -> None:
    assert path.is_file(), path
    img = mpimg.imread(path)
    assert img.shape[:2] == EXPECTED_SHAPE
    assert img[..., :3].std() > 0.05, "image is (nearly) blank"
    colours = np.unique((img[..., :3] * 255).round().reshape(-1, 3), axis=0)
    assert len(colours) > 2


@pytest.mark.slow
def test_cli_compares_two_runs(tmp_path):
    a = write_run(tmp_path / "a" / "run", val_every=5)
    b = write_run(tmp_path / "b" / "run", offset=0.3, drop=("mfu",))
    proc = run_python("lingua.plot", [str(a), str(b)])
    printed = proc.stdout.strip().splitlines()
    assert len(printed) == 1
    out = Path(printed[0])
    assert out.is_absolute() and out == (a / "plots" / "compare.png").absolute()
    check_png(out)
    assert not (a / "plots" / "downstream.png").exists()  # no eval/ keys in any run

    proc = run_python("lingua.plot", [str(a), str(b), "--out", str(tmp_path / "elsewhere")])
    assert Path(proc.stdout.strip()) == (tmp_path / "elsewhere" / "compare.png").absolute()
    check_png(Path(proc.stdout.strip()))


def test_cli_missing_dir_or_metrics_exits_2_naming_the_path(tmp_path):
    missing = tmp_path / "nope"
    proc = run_python("lingua.plot", [str(missing)], check=False)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr

    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_python("lingua.plot", [str(write_run(tmp_path / "ok")), str(empty)], check=False)
    assert proc.returncode == 2
    assert "metrics.jsonl" in proc.stderr and str(empty) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ok" / "plots").exists()


def test_cli_malformed_line_exits_2_naming_file_and_line(tmp_path):
    run = write_run(tmp_path / "run", steps=3)
    path = run / "metrics.jsonl"
    path.write_text(path.read_text().rstrip("\n") + '\n{"step": 4, "loss"\n')  # cut mid-write
    proc = run_python("lingua.plot", [str(run)], check=False)
    assert proc.returncode == 2
    assert f"{path} line 4" in proc.stderr and "Traceback" not in proc.stderr


def test_read_metrics_skips_blank_lines_and_names_bad_lines(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n\n  \n{"step": 2, "loss": 1.5}\n')
    assert [r["step"] for r in plot.read_metrics(run)] == [1, 2]
    (run / "metrics.jsonl").write_text('{"step": 1}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 3"):
        plot.read_metrics(run)
    with pytest.raises(ConfigError, match="does not exist"):
        plot.read_metrics(tmp_path / "missing")


def test_run_labels_tell_equal_names_apart(tmp_path):
    assert plot.run_labels([tmp_path / "a", tmp_path / "b"]) == ["a", "b"]
    assert plot.run_labels([tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "z"]) == \
        ["x/run", "y/run", "z"]
    labels = plot.run_labels([tmp_path / "a", tmp_path / "a"])
    assert len(set(labels)) == 2


def test_panel_without_data_says_so_and_series_skips_missing_keys(tmp_path):
    rows = [{"step": 2, "loss": 1.0}, {"step": 1, "loss": 2.0, "lr": None},
            {"step": 2, "loss": 0.5}]
    assert plot.series(rows, "loss") == ([1, 2], [2.0, 0.5])  # sorted, a step's last row wins
    assert plot.series(rows, "lr") == ([], [])
    fig = plot.compare_figure({"r": rows})
    texts = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes}
    assert texts["loss"] == []
    assert texts["learning rate"] == ["no data"] and texts["MFU"] == ["no data"]
    path = plot.save_figure(fig, tmp_path / "deep" / "dir" / "f.png")
    assert path.is_absolute() and mpimg.imread(path).shape[:2] == EXPECTED_SHAPE
    import matplotlib.pyplot as plt

    assert not plt.fignum_exists(fig.number)  # save_figure closed it


def test_compare_figure_is_fit_for_a_report(tmp_path):
    """Axis labels with units, one legend above the panels (no panel spent on it), runs with
    identical curves still told apart, val_loss as rings on a thin solid line, log scales."""
    a = write_run(tmp_path / "a", val_every=5)
    runs = {"a": plot.read_metrics(a), "a-again": plot.read_metrics(a),
            "b": plot.read_metrics(write_run(tmp_path / "b", offset=0.3))}
    fig = plot.compare_figure(runs)
    assert [ax.get_title() for ax in fig.axes] == \
        ["loss", "learning rate", "grad norm", "throughput", "MFU", "peak memory"]
    assert [ax.get_ylabel() for ax in fig.axes] == \
        ["cross-entropy (nats/token)", "learning rate", "gradient L2 norm",
         "tokens/s (all ranks)", "MFU (%)", "GiB (rank 0)"]
    assert {ax.get_xlabel() for ax in fig.axes} == {"step"}
    assert [ax.get_yscale() for ax in fig.axes] == ["log", "linear", "log", "linear", "linear",
                                                     "linear"]
    # The runs' names as the title, then one figure legend, drawn above every panel.
    assert fig.get_suptitle() == "a, a-again, b: training"
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "a-again", "b", "val_loss"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend_box = fig.legends[0].get_window_extent(renderer)
    assert all(legend_box.y0 >= ax.get_tightbbox(renderer).y1 - 1 for ax in fig.axes)
    assert fig._suptitle.get_window_extent(renderer).y0 >= legend_box.y1 - 1
    # Identical curves: a different colour, line style and marker, markers at other steps.
    lr_a, lr_again, _ = fig.axes[1].get_lines()
    assert (lr_a.get_xydata() == lr_again.get_xydata()).all()
    assert lr_a.get_color() != lr_again.get_color()
    assert lr_a.get_linestyle() != lr_again.get_linestyle()
    assert lr_a.get_marker() != lr_again.get_marker()
    assert lr_a.get_markevery()[0] != lr_again.get_markevery()[0]
    # val_loss: a ring at each evaluated step, joined by a thin solid line.
    val = {line.get_label(): line for line in fig.axes[0].get_lines()}["a val_loss"]
    train = {line.get_label(): line for line in fig.axes[0].get_lines()}["a"]
    assert val.get_xydata()[:, 0].tolist() == [5, 10, 15, 20]
    assert val.get_linestyle() == "-" and val.get_marker() == "o" and val.get_markevery() is None
    assert val.get_markerfacecolor() == "none" and val.get_linewidth() < train.get_linewidth()
    import matplotlib.pyplot as plt

    plt.close("all")


def visible_tick_labels(ax) -> dict:
    """{tick value: its label} of the y axis's major ticks inside the view, after drawing."""
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    return {tick: label.get_text() for tick, label in zip(ax.get_yticks(), ax.get_yticklabels())
            if low <= tick <= high}


@pytest.mark.parametrize("low,high", [(0.6, 1.37), (0.3, 1.9), (0.05, 1.4), (0.9, 40.0)])
def test_log_axes_label_major_ticks_on_both_sides_of_1(low, high):
    """A grad norm crossing 1 (a real run's 0.6 to 1.37 among them) gets labelled major ticks
    above 1 as well as below, in plain numbers."""
    rows = [{"step": s, "loss": 3.2 + s / 20, "grad_norm": low * (high / low) ** (s / 20)}
            for s in range(21)]
    fig = plot.compare_figure({"r": rows})
    loss_ax, grad_ax = fig.axes[0], fig.axes[2]
    assert grad_ax.get_yscale() == "log"
    labels = visible_tick_labels(grad_ax)
    assert any(tick > 1 and text for tick, text in labels.items()), labels
    assert any(tick < 1 and text for tick, text in labels.items()), labels
    assert all(text == f"{tick:g}" for tick, text in labels.items()), labels   # not 10^0
    assert len([t for t in visible_tick_labels(loss_ax).values() if t]) >= 3   # 3.2 to 4.2
    import matplotlib.pyplot as plt

    plt.close("all")


def test_mfu_is_never_drawn_above_100_percent(tmp_path):
    rows = [{"step": s, "loss": 1.0, "mfu": m} for s, m in enumerate([0.2, 1.7, 0.4, 1.3], 1)]
    fig = plot.compare_figure({"r": rows})
    mfu_ax = fig.axes[4]
    (line,) = mfu_ax.get_lines()
    assert line.get_xydata().tolist() == [[1, 20.0], [3, 40.0]]
    assert mfu_ax.get_ylim()[1] <= 100
    assert [t.get_text() for t in mfu_ax.texts] == ["2 value(s) above 100% not drawn: not credible"]
    # Steps that logged no MFU (no known peak): how many, not a line that silently stops.
    rows = [{"step": s, "loss": 1.0, "mfu": m} for s, m in enumerate([0.2, 0.3, None, None], 1)]
    mfu_ax = plot.compare_figure({"r": rows}).axes[4]
    assert [t.get_text() for t in mfu_ax.texts] == ["2 step(s) logged no value (null): not drawn"]
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.mark.slow
def test_plot_a_real_training_run(corpus, tmp_path):
    run = tmp_path / "run"
    run_python("apps.llama.train", tiny_args(corpus, run, steps=3))
    proc = run_python("lingua.plot", [str(run)])
    out = Path(proc.stdout.strip())
    assert out == (run / "plots" / "compare.png").absolute()
    check_png(out)


# Downstream evaluation: eval/<task>/<metric> keys. Values are binary fractions so x100 is exact.
LC = "eval/lingua_continuation"
INLINE_EVAL = {  # inline evaluation: the keys ride in the training rows
    10: {f"{LC}/acc": 0.25, f"{LC}/acc_stderr": 0.03125, f"{LC}/acc_norm": 0.125,
         f"{LC}/acc_norm_stderr": 0.0625, "eval/arc-easy/word_perplexity": 40.5},
    20: {f"{LC}/acc": 0.5, f"{LC}/acc_stderr": 0.015625, f"{LC}/acc_norm": 0.375,
         f"{LC}/acc_norm_stderr": 0.0625, "eval/arc-easy/word_perplexity": 30.25},
}
EVAL_JOB_ROWS = [  # an evaluation job beside training: own rows, out of order, step 20 twice
    {"step": 20, f"{LC}/acc": 0.125, f"{LC}/acc_stderr": 0.5},
    {"step": 10, f"{LC}/acc": 0.25, f"{LC}/acc_stderr": 0.0625, f"{LC}/acc_norm": 0.5,
     f"{LC}/alias": "lingua_continuation"},
    {"step": 5, f"{LC}/acc": 0.0, f"{LC}/acc_stderr": "N/A"},
    {"step": 20, f"{LC}/acc": 0.75, f"{LC}/acc_stderr": 0.125, f"{LC}/acc_norm": 0.625},
]


def downstream_runs(tmp_path):
    base = write_run(tmp_path / "base", val_every=10, inline=INLINE_EVAL)
    fork = write_run(tmp_path / "fork", offset=0.3, appended=EVAL_JOB_ROWS)
    plain = write_run(tmp_path / "plain", offset=0.6, steps=15)
    return base, fork, plain


def test_downstream_series_inline_and_separate_rows(tmp_path):
    base, fork, _ = downstream_runs(tmp_path)
    assert plot.downstream_series(plot.read_metrics(base)) == {
        ("arc-easy", "word_perplexity"): ([10, 20], [40.5, 30.25], None),
        ("lingua_continuation", "acc"): ([10, 20], [0.25, 0.5], [0.03125, 0.015625]),
        ("lingua_continuation", "acc_norm"): ([10, 20], [0.125, 0.375], [0.0625, 0.0625]),
    }
    got = plot.downstream_series(plot.read_metrics(fork))
    assert list(got) == [("lingua_continuation", "acc"), ("lingua_continuation", "acc_norm")]
    # Sorted by step; step 20's later row wins with its own stderr; "N/A" is no stderr (NaN).
    steps, values, stderrs = got[("lingua_continuation", "acc")]
    assert (steps, values) == ([5, 10, 20], [0.0, 0.25, 0.75])
    assert math.isnan(stderrs[0]) and stderrs[1:] == [0.0625, 0.125]
    assert got[("lingua_continuation", "acc_norm")] == ([10, 20], [0.5, 0.625], None)
    # Eval-only rows leave the training series alone.
    assert plot.series(plot.read_metrics(fork), "loss")[0] == list(range(1, 21))
    assert plot.downstream_series([{"step": 1, "loss": 2.0}, {"step": 2, "eval/x": 1.0}]) == {}


def test_downstream_figure_panels_lines_and_percent(tmp_path):
    dirs = downstream_runs(tmp_path)
    runs = {label: plot.read_metrics(d) for label, d in zip(plot.run_labels(dirs), dirs)}
    fig = plot.downstream_figure(runs)
    assert fig.get_suptitle() == "base, fork, plain: downstream tasks"
    assert [ax.get_title() for ax in fig.axes] == \
        ["loss", "arc-easy: word_perplexity", "lingua_continuation: acc",
         "lingua_continuation: acc_norm"]  # 2x3 grid, 2 removed
    assert [ax.get_ylabel() for ax in fig.axes] == \
        ["cross-entropy (nats/token)", "word_perplexity", "acc (%)", "acc_norm (%)"]
    assert {ax.get_xlabel() for ax in fig.axes} == {"step"}
    assert [t.get_text() for t in fig.legends[0].get_texts()] == \
        ["base", "fork", "plain", "val_loss", "chance"]
    loss_ax, ppl_ax, acc_ax, norm_ax = fig.axes
    assert [line.get_label() for line in loss_ax.get_lines()] == \
        ["base", "base val_loss", "fork", "plain"]  # the run without eval keys is drawn too
    assert loss_ax.get_lines()[3].get_xydata()[:, 0].tolist() == list(range(1, 16))

    def lines(ax):
        return {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()
                if not line.get_label().startswith("chance")}

    assert lines(ppl_ax) == {"base": [[10, 40.5], [20, 30.25]]}
    assert lines(acc_ax) == {"base": [[10, 25.0], [20, 50.0]],
                             "fork": [[5, 0.0], [10, 25.0], [20, 75.0]]}
    assert lines(norm_ax) == {"base": [[10, 12.5], [20, 37.5]], "fork": [[10, 50.0], [20, 62.5]]}
    # lingua_continuation has 4 choices: chance is a dashed line at 25% on both accuracies;
    # a perplexity has none.
    for ax in (acc_ax, norm_ax):
        (chance,) = [line for line in ax.get_lines() if line.get_label().startswith("chance")]
        assert chance.get_label() == "chance (1/4)" and chance.get_linestyle() == "--"
        assert set(chance.get_ydata()) == {25.0}
    assert not any(line.get_label().startswith("chance") for line in ppl_ax.get_lines())
    # Each evaluated step has a marker, the run's own (as its line style): base, fork.
    assert [(line.get_marker(), line.get_linestyle(), line.get_markevery())
            for line in acc_ax.get_lines()[:2]] == [("s", "-", None), ("^", "--", None)]
    # Error bars in %: base's two, then fork's two with a stderr (step 5's "N/A" has none).
    bars = [seg.tolist() for c in acc_ax.collections for seg in c.get_segments()]
    assert bars == [[[10, 21.875], [10, 28.125]], [[20, 48.4375], [20, 51.5625]],
                    [[10, 18.75], [10, 31.25]], [[20, 62.5], [20, 87.5]]]
    assert len(ppl_ax.collections) == 0 and len(norm_ax.collections) == 1  # fork's acc_norm: none
    compare_loss = plot.compare_figure(runs).axes[0]
    for ax in (loss_ax, acc_ax):  # a run has the same colour as in compare.png
        assert ax.get_lines()[0].get_color() == compare_loss.get_lines()[0].get_color() == "C0"
    assert acc_ax.get_lines()[1].get_color() == "C1"
    import matplotlib.pyplot as plt

    plt.close("all")
    assert plot.downstream_figure({"plain": runs["plain"]}) is None


@pytest.mark.slow
def test_cli_writes_downstream_png_beside_compare(tmp_path):
    base, fork, plain = downstream_runs(tmp_path)
    proc = run_python("lingua.plot", [str(base), str(fork), str(plain),
                                      "--out", str(tmp_path / "o")])
    assert proc.stdout.strip().splitlines() == [
        str((tmp_path / "o" / "compare.png").absolute()),
        str((tmp_path / "o" / "downstream.png").absolute())]
    check_png(tmp_path / "o" / "compare.png")
    img = mpimg.imread(tmp_path / "o" / "downstream.png")
    legend_h = plot.TITLE_INCHES + plot.LEGEND_ROW_INCHES * 1.2  # 5 legend entries: one row
    assert img.shape[:2] == (round((2 * plot.PANEL_SIZE[1] + legend_h) * plot.DPI),
                             round(3 * plot.PANEL_SIZE[0] * plot.DPI))
    assert img[..., :3].std() > 0.05


def test_chance_comes_from_the_number_of_choices_where_known():
    assert plot.task_choices("lingua_continuation", "acc") == 4
    assert plot.task_choices("piqa", "acc_norm") == 2
    assert plot.task_choices("mmlu_anatomy", "acc") == 4
    assert plot.task_choices("hellaswag", "word_perplexity") is None   # not an accuracy
    assert plot.task_choices("my_new_task", "acc") is None   # unknown: no line, not a guess


def test_a_long_list_of_runs_is_cut_in_the_title():
    labels = [f"sweep_lr_{i:02d}" for i in range(20)]
    title = plot.runs_title(labels, "training")
    assert title.startswith("sweep_lr_00, sweep_lr_01") and title.endswith(" more: training")
    assert len(title) <= plot.TITLE_CHARS + len(": training")
    assert plot.runs_title(["quickstart"], "training") == "quickstart: training"
