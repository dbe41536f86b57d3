"""Compare training runs from their metrics.jsonl: loss (and val_loss), lr, grad_norm, tokens/s, MFU.

    python -m lingua.plot runs/a runs/b [--out DIR]

writes DIR/compare.png (default: the first run's dump_dir/plots/) and prints its absolute path.
`save_figure` is the one place figures are written, so every plot this project makes has the
same backend, dpi and therefore a pixel size that depends only on the figure size.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: plots are written from training nodes that have no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from lingua.errors import ConfigError  # noqa: E402

DPI = 100
FIGSIZE = (15.0, 8.0)  # inches: with DPI, a 1500 x 800 PNG
COMPARE_NAME = "compare.png"

# (key, panel title, scale applied to the values): one panel each, in this order.
PANELS = [
    ("loss", "loss", 1.0),
    ("lr", "learning rate", 1.0),
    ("grad_norm", "grad norm", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("mfu", "MFU (%)", 100.0),
]


def read_metrics(dump_dir) -> List[dict]:
    """The rows of dump_dir/metrics.jsonl, blank lines skipped.

    Raises ConfigError (a ValueError) naming the path when the directory or file is missing, and
    the file and line number when a line is not a JSON object with a `step`."""
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
    """Each run's directory name; runs with equal names get as many parent dirs as tell them apart."""
    parts = [Path(d).resolve().parts for d in dump_dirs]
    depth = [1] * len(parts)
    while True:
        labels = ["/".join(p[-k:]) for p, k in zip(parts, depth)]
        clashes = [i for i, lab in enumerate(labels) if labels.count(lab) > 1 and depth[i] < len(parts[i])]
        if not clashes:
            break
        for i in clashes:
            depth[i] += 1
    # The same directory given twice still needs two legend entries one can tell apart.
    return [lab if labels.count(lab) == 1 else f"{lab} #{labels[:i].count(lab) + 1}"
            for i, lab in enumerate(labels)]


def series(rows: Sequence[dict], key: str, scale: float = 1.0):
    """(steps, values) for key, sorted by step, each step once (its last row) and rows without a
    numeric value skipped, so a key a run does not log simply has no points."""
    by_step = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_step[row["step"]] = value * scale
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def compare_figure(runs: Mapping[str, Sequence[dict]]) -> Figure:
    """A figure with one panel per metric in PANELS, x = step, one colour per run (label -> rows).
    val_loss is drawn in the loss panel as dashed markers in the run's colour."""
    fig, axes = plt.subplots(2, 3, figsize=FIGSIZE, dpi=DPI)
    axes = axes.ravel()
    colours = {label: f"C{i % 10}" for i, label in enumerate(runs)}
    has_val = False
    for ax, (key, title, scale) in zip(axes, PANELS):
        drawn = False
        for label, rows in runs.items():
            steps, values = series(rows, key, scale)
            if steps:
                # A lone point needs a marker: a one-point line draws nothing.
                ax.plot(steps, values, color=colours[label], linewidth=1.2,
                        marker="o" if len(steps) == 1 else None, markersize=4)
                drawn = True
            if key == "loss":
                steps, values = series(rows, "val_loss")
                if steps:
                    ax.plot(steps, values, color=colours[label], linestyle="--", marker="o",
                            markersize=4)
                    drawn = has_val = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                    color="gray", fontsize=14)
    # The sixth slot holds one legend for all panels: run colours, then the loss line styles.
    legend_ax = axes[len(PANELS)]
    legend_ax.axis("off")
    handles = [Line2D([], [], color=colours[label], linewidth=2, label=label) for label in runs]
    if has_val:
        handles += [Line2D([], [], color="black", label="train loss"),
                    Line2D([], [], color="black", linestyle="--", marker="o", markersize=4,
                           label="val_loss")]
    legend_ax.legend(handles=handles, loc="center", frameon=False, fontsize=11)
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path) -> Path:
    """Write fig to path (format from the suffix) at a fixed dpi, close it, return the absolute path.

    No bbox_inches="tight": the image size stays figsize x DPI whatever the labels are."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return path


def plot_runs(dump_dirs: Sequence, out_dir=None) -> List[Path]:
    """Read each run's metrics.jsonl and write out_dir/compare.png (default: the first run's
    dump_dir/plots/). Returns the paths written."""
    if not dump_dirs:
        raise ConfigError("no run directory given: pass one or more dump_dirs, e.g. "
                          "`python -m lingua.plot runs/a runs/b`.")
    runs: Dict[str, List[dict]] = {}
    for label, dump_dir in zip(run_labels(dump_dirs), dump_dirs):
        runs[label] = read_metrics(dump_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path(dump_dirs[0]) / "plots"
    return [save_figure(compare_figure(runs), out_dir / COMPARE_NAME)]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lingua.plot",
        description="Plot loss (and val_loss), lr, grad_norm, tokens/s and MFU against step for "
                    "one or more runs, one colour per run, into one PNG.")
    parser.add_argument("dump_dirs", nargs="+", metavar="DIR", help="a training run's dump_dir")
    parser.add_argument("--out", metavar="OUT_DIR", default=None,
                        help="directory for compare.png (default: the first run's dump_dir/plots)")
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
