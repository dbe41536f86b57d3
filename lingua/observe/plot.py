"""Compare training runs from their metrics.jsonl against step: `python -m lingua.plot runs/a
runs/b [--out DIR]` writes compare.png (and downstream.png for `eval/<task>/<metric>` keys)."""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # before pyplot: plots are written from training nodes that have no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FormatStrFormatter, MaxNLocator, NullFormatter  # noqa: E402

from lingua.errors import ConfigError  # noqa: E402

DPI = 100
FIGSIZE = (15.0, 8.0)  # inches: with DPI, a 1500 x 800 PNG (the legend band included)
COMPARE_NAME = "compare.png"
DOWNSTREAM_NAME = "downstream.png"
EVAL_PREFIX = "eval/"  # metrics.jsonl keys eval/<task>/<metric>, with <metric>_stderr beside them
STDERR_SUFFIX = "_stderr"
PERCENT_METRICS = ("acc", "acc_norm", "exact_match")  # fractions in [0, 1], drawn in %
DOWNSTREAM_COLS = 3
PANEL_SIZE = (5.0, 3.6)  # inches per downstream panel; the figure grows with the grid
LEGEND_COLS = 6
LEGEND_ROW_INCHES = 0.35  # the legend band above the grid grows a row per LEGEND_COLS entries
TITLE_INCHES = 0.35  # the figure title, above the legend
TITLE_CHARS = 110    # a longer list of run names ends in "and N more" (the legend names them all)
LOG_SUBS = [(1,), (1, 2, 5), (1, 2, 3, 5, 7), (1, 1.5, 2, 3, 4, 5, 6, 8)]  # tick mantissas
MAX_LOG_TICKS = 8
TICK_SLACK = 1.05  # a log axis may end this factor beyond its end tick rather than a tick further
# Multiple-choice task -> choices per question, for the chance line (unlisted: no line, no guess).
TASK_CHOICES = {
    "lingua_continuation": 4, "arc_easy": 4, "arc_challenge": 4, "hellaswag": 4, "openbookqa": 4,
    "sciq": 4, "mmlu": 4, "race": 4, "logiqa": 4, "piqa": 2, "winogrande": 2, "boolq": 2,
    "copa": 2, "rte": 2, "wic": 2, "wsc273": 2, "social_iqa": 3, "siqa": 3, "commonsense_qa": 5,
    "mathqa": 5,
}
CHANCE_METRICS = ("acc", "acc_norm")
CHANCE_STYLE = {"color": "0.35", "linestyle": "--", "linewidth": 1.0}
# Run i: colour C<i>, style and marker cycled at other periods (greyscale-distinct); "o": val_loss.
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["s", "^", "D", "v", "P", "X"]
MARKERS_PER_LINE = 8
VAL_MARKER = "o"


@dataclass(frozen=True)
class Panel:
    key: str          # metrics.jsonl key
    title: str
    ylabel: str       # with the unit
    scale: float = 1.0
    log: bool = False
    cap: Optional[float] = None   # values above it (after scale) are not credible: dropped


PANELS = [  # a 2 x 3 grid, in this order
    Panel("loss", "loss", "cross-entropy (nats/token)", log=True),
    Panel("lr", "learning rate", "learning rate"),
    Panel("grad_norm", "grad norm", "gradient L2 norm", log=True),
    Panel("tokens_per_s", "throughput", "tokens/s (all ranks)"),
    Panel("mfu", "MFU", "MFU (%)", scale=100.0, cap=100.0),
    Panel("peak_mem_gib", "peak memory", "GiB (rank 0)"),
]


def read_metrics(dump_dir) -> List[dict]:
    """The rows of dump_dir/metrics.jsonl, blank lines skipped."""
    dump_dir = Path(dump_dir)
    path = dump_dir / "metrics.jsonl"
    if not dump_dir.is_dir():
        raise ConfigError(
            f"run directory {dump_dir} does not exist. Pass the dump_dir of a training run (the "
            f"directory holding metrics.jsonl), e.g. `python -m lingua.plot runs/quickstart`.")
    if not path.is_file():
        raise ConfigError(
            f"{dump_dir} has no metrics.jsonl, so it is not a training run's dump_dir (or the run "
            f"has not logged a step yet). Pass the directory given as dump_dir= to the training "
            f"command; a run writes {path} every logging.every steps.")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # so the error column is on this line
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{path} line {lineno} is not valid JSON ({err.msg} at column {err.colno}). "
                    f"A run killed mid-write can leave a partial last line: delete that line "
                    f"and run again.") from None
            if not isinstance(row, dict) or "step" not in row:
                raise ConfigError(
                    f"{path} line {lineno} is not a JSON object with a 'step' key: every line of "
                    f"metrics.jsonl is one logged step. Delete that line and run again.")
            rows.append(row)
    return rows


def run_labels(dump_dirs: Sequence) -> List[str]:
    """Each run's directory name, with as many parent dirs as tell equal names apart."""
    parts = [Path(d).resolve().parts for d in dump_dirs]
    depth = [1] * len(parts)
    while True:
        labels = ["/".join(p[-k:]) for p, k in zip(parts, depth)]
        clashes = [i for i, lab in enumerate(labels)
                   if labels.count(lab) > 1 and depth[i] < len(parts[i])]
        if not clashes:
            break
        for i in clashes:
            depth[i] += 1
    # The same directory given twice still needs two legend entries one can tell apart.
    return [lab if labels.count(lab) == 1 else f"{lab} #{labels[:i].count(lab) + 1}"
            for i, lab in enumerate(labels)]


def series(rows: Sequence[dict], key: str, scale: float = 1.0):
    """(steps, values) for key, sorted by step, each step once (its last row)."""
    by_step = {row["step"]: row[key] * scale for row in rows if _number(row.get(key))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


Series = Tuple[List[int], List[float], Optional[List[float]]]


def downstream_series(rows: Sequence[dict]) -> Dict[Tuple[str, str], Series]:
    """{(task, metric): (steps, values, stderrs)} from eval/ keys; a step's last row wins."""
    by_key: Dict[Tuple[str, str], Dict[int, Tuple[float, Optional[float]]]] = {}
    for row in rows:
        for key, value in row.items():
            if not key.startswith(EVAL_PREFIX) or key.endswith(STDERR_SUFFIX) or not _number(value):
                continue
            task, _, metric = key[len(EVAL_PREFIX):].partition("/")
            if not task or not metric:
                continue
            stderr = row.get(key + STDERR_SUFFIX)
            by_key.setdefault((task, metric), {})[row["step"]] = (
                value, stderr if _number(stderr) else None)
    out = {}
    for task_metric in sorted(by_key):
        points = by_key[task_metric]
        steps = sorted(points)
        stderrs = [points[s][1] for s in steps]
        out[task_metric] = (steps, [points[s][0] for s in steps],
                            None if all(e is None for e in stderrs)
                            else [math.nan if e is None else e for e in stderrs])
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_styles(runs: Mapping[str, Sequence[dict]]) -> Dict[str, dict]:
    """label -> {color, linestyle, marker} by run order (the same in every figure)."""
    return {label: {"color": f"C{i % 10}", "linestyle": LINESTYLES[i % len(LINESTYLES)],
                    "marker": MARKERS[i % len(MARKERS)]} for i, label in enumerate(runs)}


def plot_run(ax, steps, values, style: dict, index: int, n_runs: int, **kwargs):
    """Markers shifted per run so that identical curves show every run's markers."""
    every = max(n_runs, len(steps) // MARKERS_PER_LINE, 1)
    return ax.plot(steps, values, color=style["color"], linestyle=style["linestyle"],
                   marker=style["marker"], markersize=5, linewidth=1.4,
                   markevery=(index % every, every), **kwargs)


def draw_loss(ax, runs: Mapping[str, Sequence[dict]], styles: Mapping[str, dict]) -> bool:
    """Each run's loss and val_loss; returns whether any val_loss was drawn."""
    drawn = has_val = False
    for i, (label, rows) in enumerate(runs.items()):
        steps, values = series(rows, "loss")
        if steps:
            plot_run(ax, steps, values, styles[label], i, len(runs), label=label)
            drawn = True
        steps, values = series(rows, "val_loss")
        if steps:
            # Hollow rings, the earlier runs' larger: equal val_losses show as concentric rings.
            ax.plot(steps, values, color=styles[label]["color"], linestyle="-", linewidth=0.8,
                    marker=VAL_MARKER, markersize=6 + 3 * min(len(runs) - 1 - i, 3),
                    markerfacecolor="none", markeredgewidth=1.5, label=f"{label} val_loss")
            drawn = has_val = True
    style_panel(ax, PANELS[0].title, drawn, PANELS[0].ylabel)
    if drawn:
        log_scale(ax)
    return has_val


def legend_handles(runs, styles: Mapping[str, dict], has_val: bool) -> List[Line2D]:
    handles = [Line2D([], [], color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                      linewidth=2, markersize=6, label=label) for label, st in styles.items()
               if label in runs]
    if has_val:
        handles.append(Line2D([], [], color="black", linewidth=0.8, marker=VAL_MARKER,
                              markersize=7, markerfacecolor="none", markeredgewidth=1.5,
                              label="val_loss"))
    return handles


def style_panel(ax, title: str, drawn: bool, ylabel: Optional[str] = None) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.grid(True, which="minor", axis="y", alpha=0.12)
    if not drawn:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                color="gray", fontsize=14)


def log_scale(ax, values=None) -> None:
    """A log y axis where every value is positive, its ticks plain numbers (0.6, 0.8, 1, 1.2)."""
    values = list(values or [y for line in ax.get_lines() for y in line.get_ydata()])
    if not values or min(values) <= 0:
        return
    ax.set_yscale("log")
    ticks = log_ticks(min(values), max(values))
    if ticks:   # else too many decades for plain numbers: matplotlib's own labels stay
        lo, hi = math.log10(min(ticks[0], min(values))), math.log10(max(ticks[-1], max(values)))
        pad = 0.03 * (hi - lo)   # no marker cut in half by the frame
        ax.set_ylim(10 ** (lo - pad), 10 ** (hi + pad))
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def log_ticks(low: float, high: float) -> List[float]:
    """3 to MAX_LOG_TICKS ticks enclosing [low, high] from the tightest, then densest, LOG_SUBS
    grid; [] where none fits (many decades)."""
    decades = range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
    grids = [sorted(m * 10.0 ** k for k in decades for m in subs) for subs in LOG_SUBS]
    if math.log10(high / low) < 1:
        grids.append([float(t) for t in MaxNLocator(nbins=5, steps=[1, 2, 5, 10])
                      .tick_values(low, high) if t > 0])
    fits = []
    for grid in grids:
        below = [t for t in grid if t <= low * TICK_SLACK]
        above = [t for t in grid if t >= high / TICK_SLACK]
        if below and above:
            ticks = [t for t in grid if below[-1] <= t <= above[0]]
            if 3 <= len(ticks) <= MAX_LOG_TICKS:
                fits.append(ticks)
    return min(fits, key=lambda ticks: (ticks[-1] / ticks[0], -len(ticks)), default=[])


def legend_band(handles: List[Line2D]) -> float:
    """Inches above the panels for the title and a legend of these entries, LEGEND_COLS to a row."""
    return TITLE_INCHES + LEGEND_ROW_INCHES * (math.ceil(len(handles) / LEGEND_COLS) + 0.2)


def runs_title(labels: Sequence[str], what: str) -> str:
    """"<run names>: <what>", the names cut to about TITLE_CHARS (the legend lists every run)."""
    names = ", ".join(labels)
    for shown in range(len(labels) - 1, 0, -1):
        if len(names) <= TITLE_CHARS:
            break
        names = f"{', '.join(labels[:shown])} and {len(labels) - shown} more"
    return f"{names}: {what}"


def figure_header(fig, title: str, handles: List[Line2D], height: float) -> None:
    """Title and legend above the panels, hiding no curve."""
    fig.suptitle(title, y=1 - 0.06 / height, va="top", fontsize=13)
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), LEGEND_COLS) or 1,
               frameon=False, fontsize=11, bbox_to_anchor=(0.5, 1 - TITLE_INCHES / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - legend_band(handles) / height))


def draw_panel(ax, panel: Panel, runs, styles) -> None:
    drawn, dropped, nulls = False, 0, 0
    for i, (label, rows) in enumerate(runs.items()):
        # Nulls (MFU with no credible peak) are counted: a line that stops is not a run stopping.
        nulls += sum(1 for row in rows if panel.key in row and row[panel.key] is None)
        steps, values = series(rows, panel.key, panel.scale)
        if panel.cap is not None:
            kept = [(s, v) for s, v in zip(steps, values) if v <= panel.cap]
            dropped += len(steps) - len(kept)
            steps, values = [s for s, _ in kept], [v for _, v in kept]
        if steps:
            plot_run(ax, steps, values, styles[label], i, len(runs), label=label)
            drawn = True
    notes = []
    if dropped:
        notes.append(f"{dropped} value(s) above {panel.cap:.0f}% not drawn: not credible")
    if nulls and drawn:   # with nothing drawn, the panel says "no data"
        notes.append(f"{nulls} step(s) logged no value (null): not drawn")
    for k, note in enumerate(notes):
        ax.text(0.99, 0.98 - 0.06 * k, note, transform=ax.transAxes, ha="right", va="top",
                fontsize=8, color="gray")
    if drawn and panel.cap is not None:
        ax.set_ylim(0, min(panel.cap, ax.get_ylim()[1]))
    style_panel(ax, panel.title, drawn, panel.ylabel)
    if panel.log and drawn:
        log_scale(ax)


def compare_figure(runs: Mapping[str, Sequence[dict]]) -> Figure:
    fig, axes = plt.subplots(2, 3, figsize=FIGSIZE, dpi=DPI)
    styles = run_styles(runs)
    has_val = draw_loss(axes[0, 0], runs, styles)   # PANELS[0]
    for ax, panel in zip(axes.ravel()[1:], PANELS[1:]):
        draw_panel(ax, panel, runs, styles)
    handles = legend_handles(runs, styles, has_val)
    figure_header(fig, runs_title(list(runs), "training"), handles, FIGSIZE[1])
    return fig


def downstream_figure(runs: Mapping[str, Sequence[dict]]) -> Optional[Figure]:
    """The loss, then one panel per (task, metric); None when no run has eval/ keys."""
    per_run = {label: downstream_series(rows) for label, rows in runs.items()}
    task_metrics = sorted({tm for s in per_run.values() for tm in s})
    if not task_metrics:
        return None
    n = 1 + len(task_metrics)
    cols = min(DOWNSTREAM_COLS, n)
    nrows = math.ceil(n / cols)
    styles = run_styles(runs)
    has_val = any(series(rows, "val_loss")[0] for rows in runs.values())
    handles = legend_handles(runs, styles, has_val)
    if any(task_choices(task, metric) for task, metric in task_metrics):
        handles.append(Line2D([], [], **CHANCE_STYLE, label="chance"))
    legend_h = legend_band(handles)
    height = PANEL_SIZE[1] * nrows + legend_h
    fig, axes = plt.subplots(nrows, cols, figsize=(PANEL_SIZE[0] * cols, height), dpi=DPI,
                             squeeze=False)
    axes = list(axes.ravel())
    for ax in axes[n:]:
        ax.remove()  # the last row's empty slots; fig.axes then holds only panels

    draw_loss(axes[0], runs, styles)
    for ax, (task, metric) in zip(axes[1:n], task_metrics):
        # Shared x so an evaluation lines up with the loss at that step; tick labels stay on.
        ax.sharex(axes[0])
        draw_task(ax, task, metric, per_run, styles)

    figure_header(fig, runs_title(list(runs), "downstream tasks"), handles, height)
    return fig


def task_choices(task: str, metric: str) -> Optional[int]:
    """Choices per question for an accuracy's chance line; None where unknown."""
    if metric not in CHANCE_METRICS:
        return None
    return TASK_CHOICES.get("mmlu" if task.startswith("mmlu_") else task)  # mmlu_<subject>


def draw_task(ax, task: str, metric: str, per_run, styles) -> None:
    """Each run's evaluated steps (accuracies in %), stderr bars, and the chance level."""
    scale, ylabel = (100.0, f"{metric} (%)") if metric in PERCENT_METRICS else (1.0, metric)
    for label, run_series in per_run.items():
        if (task, metric) not in run_series:
            continue
        steps, values, stderrs = run_series[(task, metric)]
        st = styles[label]   # every evaluated step gets its marker: there are few
        ax.plot(steps, [v * scale for v in values], color=st["color"], linestyle=st["linestyle"],
                linewidth=1.2, marker=st["marker"], markersize=5, label=label)
        bars = [(s, v * scale, e * scale) for s, v, e in zip(steps, values, stderrs or [])
                if math.isfinite(e) and e >= 0]
        if bars:
            # fmt="none", capsize=0: only the bars, so ax.get_lines() gains no line per run.
            ax.errorbar([b[0] for b in bars], [b[1] for b in bars], yerr=[b[2] for b in bars],
                        fmt="none", ecolor=st["color"], elinewidth=1.0, alpha=0.7, capsize=0)
    choices = task_choices(task, metric)
    if choices:
        level = scale / choices
        ax.axhline(level, **CHANCE_STYLE, label=f"chance (1/{choices})", zorder=1)
        # At the left end: evaluations (often the last step's) sit to the right.
        ax.annotate(f"chance {level:g}{'%' if scale == 100 else ''}", (0, level),
                    xycoords=("axes fraction", "data"), xytext=(3, 3),
                    textcoords="offset points", ha="left", va="bottom", fontsize=8, color="0.35")
    style_panel(ax, f"{task}: {metric}", True, ylabel)


def save_figure(fig: Figure, path) -> Path:
    """The one place figures are written; no bbox_inches="tight", so the image size stays fixed."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return path


def plot_runs(dump_dirs: Sequence, out_dir=None) -> List[Path]:
    """Write compare.png (and downstream.png) to out_dir (default: first run's dump_dir/plots/)."""
    if not dump_dirs:
        raise ConfigError("no run directory given: pass one or more dump_dirs, e.g. "
                          "`python -m lingua.plot runs/a runs/b`.")
    runs = {label: read_metrics(d) for label, d in zip(run_labels(dump_dirs), dump_dirs)}
    out_dir = Path(out_dir) if out_dir is not None else Path(dump_dirs[0]) / "plots"
    paths = [save_figure(compare_figure(runs), out_dir / COMPARE_NAME)]
    downstream = downstream_figure(runs)
    if downstream is not None:
        paths.append(save_figure(downstream, out_dir / DOWNSTREAM_NAME))
    return paths


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lingua.plot",
        description="Plot loss, lr, grad_norm, tokens/s and MFU against step for one or more runs "
                    "into compare.png, and logged downstream tasks into downstream.png.")
    parser.add_argument("dump_dirs", nargs="+", metavar="DIR", help="a training run's dump_dir")
    parser.add_argument("--out", metavar="OUT_DIR", default=None,
                        help="directory for compare.png and downstream.png (default: the first "
                             "run's dump_dir/plots)")
    ns = parser.parse_args(argv)
    try:
        paths = plot_runs(ns.dump_dirs, ns.out)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:
        print(f"error: cannot write the plot ({err}). Pass --out a directory you can write to.",
              file=sys.stderr)
        sys.exit(2)
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
