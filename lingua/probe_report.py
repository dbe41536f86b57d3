"""Reading and plotting what the probe recorded: `python -m lingua.probe plot <dump_dir>`.

`read(dump_dir)` returns `dump_dir/probe/probe.jsonl` as a pandas DataFrame (one row per step,
module, tensor and stat); `plot(dump_dir)` draws its PNGs to `dump_dir/probe/plots/`; `main` is
the command line (`python -m lingua.probe plot ...`, or `python -m lingua.probe_report plot ...`).
Both `read` and `plot` are also importable from `lingua.probe`, as documented.

The other half, collecting the statistics during training (hooks, reduction over ranks, alerts)
and the schema of a probe.jsonl line, is `lingua/probe.py`. This module needs neither torch nor
lingua.probe, so reading and plotting a run's probe stay cheap and import no training code.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import List


def read(dump_dir):
    """probe.jsonl as a pandas DataFrame: one row per (step, module, tensor, stat) with `value`."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("lingua.probe.read needs pandas: pip install -e '.[dev]'") from None
    rows = []
    for step, stats in _read_lines(dump_dir):
        for key, values in stats.items():
            module, _, tensor = key.rpartition("/")
            for stat, value in values.items():
                rows.append((step, module, tensor, stat, value))
    return pd.DataFrame(rows, columns=["step", "module", "tensor", "stat", "value"])


def _read_lines(dump_dir):
    path = Path(dump_dir) / "probe" / "probe.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run with probe.every=N to record "
                                f"statistics (python -m apps.llama.train probe.every=10 ...).")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}: not JSON ({err}).") from None
        out.append((row["step"], row["stats"]))
    return out


def _layer_of(module: str):
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1]), ".".join(parts[2:]) or "block"
    return None, module


def plot(dump_dir, out_dir=None, stats=("abs_max", "rms", "kurtosis")) -> List[Path]:
    """PNGs: per stat, a layer x step heatmap for each sub-module kind and lines per module; the
    attention entropy and max logit; and the loss curve. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from lingua.plot import save_figure

    dump_dir = Path(dump_dir)
    out_dir = Path(out_dir) if out_dir else dump_dir / "probe" / "plots"
    lines = _read_lines(dump_dir)
    if not lines:
        raise ValueError(f"{dump_dir / 'probe' / 'probe.jsonl'} holds no probe steps yet.")
    steps = [s for s, _ in lines]
    written = []
    # Block outputs (the residual stream) are the first thing to look at; then each sub-module.
    by_kind = defaultdict(dict)            # (sub-module, tensor) -> {(layer, step): stats}
    for step, step_stats in lines:
        for key, values in step_stats.items():
            module, _, tensor = key.rpartition("/")
            layer, sub = _layer_of(module)
            if layer is not None:
                by_kind[(sub, tensor)][(layer, step)] = values
    for stat in stats:
        # The residual stream (block output), the attention and FFN outputs, and the output
        # projections' weights and gradients: where outliers usually show first.
        chosen = [("block", "output"), ("attention", "output"), ("feed_forward", "output"),
                  ("attention.wo", "weight"), ("attention.wo", "weight.grad"),
                  ("feed_forward.w2", "weight"), ("feed_forward.w2", "weight.grad")]
        panels = [(k, by_kind[k]) for k in chosen
                  if k in by_kind and any(stat in x for x in by_kind[k].values())]
        if not panels:
            continue
        fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels)), squeeze=False,
                                 constrained_layout=True)
        for ax, ((sub, tensor), cells) in zip(axes[:, 0], panels):
            layers = sorted({layer for layer, _ in cells})
            grid = np.full((len(layers), len(steps)), np.nan)
            for (layer, step), values in cells.items():
                if stat in values and values[stat] is not None:
                    grid[layers.index(layer), steps.index(step)] = values[stat]
            image = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest")
            fig.colorbar(image, ax=ax)
            ticks = sorted(set(np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int)))
            ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
            ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
            ax.set_title(f"{stat} of {sub} {tensor} (layer x step)", fontsize=9)
            ax.set_ylabel("layer")
        axes[-1, 0].set_xlabel("step")
        written.append(save_figure(fig, out_dir / f"heatmap_{stat}.png"))

        fig, ax = plt.subplots(figsize=(9, 4.5), constrained_layout=True)
        for (sub, tensor), cells in panels[:1]:
            for layer in sorted({layer for layer, _ in cells}):
                xs = [s for s in steps if (layer, s) in cells and stat in cells[(layer, s)]]
                ax.plot(xs, [cells[(layer, s)][stat] for s in xs], label=f"layer {layer}")
            ax.set_title(f"{stat} of {sub} {tensor}, one line per layer")
        ax.set_xlabel("step")
        ax.legend(fontsize=7, ncol=2)
        written.append(save_figure(fig, out_dir / f"lines_{stat}.png"))
    attention = [(k, v) for k, v in sorted(by_kind.items()) if k[1] == "attention"]
    if attention:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
        for (sub, _), cells in attention:
            for layer in sorted({layer for layer, _ in cells}):
                xs = [s for s in steps if (layer, s) in cells and cells[(layer, s)]]
                for ax, stat in zip(axes, ("entropy", "max_logit")):
                    ax.plot(xs, [cells[(layer, s)][stat] for s in xs], label=f"layer {layer}")
                    ax.set_title(f"attention {stat}")
                    ax.set_xlabel("step")
        axes[0].legend(fontsize=7)
        written.append(save_figure(fig, out_dir / "attention.png"))
    metrics_path = dump_dir / "metrics.jsonl"
    if metrics_path.is_file():
        rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
        fig, ax = plt.subplots(figsize=(9, 4), constrained_layout=True)
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="loss")
        val = [r for r in rows if "val_loss" in r]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", label="val_loss")
        for step in steps:
            ax.axvline(step, color="grey", alpha=0.15)
        ax.set_xlabel("step")
        ax.set_title("loss (grey: probe steps)")
        ax.legend()
        written.append(save_figure(fig, out_dir / "loss.png"))
    return written


def main(argv=None, prog: str = "python -m lingua.probe") -> int:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Plot the statistics a run recorded with probe.every.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plot", help="write PNGs of dump_dir/probe/probe.jsonl and print their paths")
    p.add_argument("dump_dir")
    p.add_argument("--out", default=None, help="output directory (default: dump_dir/probe/plots)")
    p.add_argument("--stats", default="abs_max,rms,kurtosis",
                   help="comma-separated statistics to draw (default: abs_max,rms,kurtosis)")
    args = parser.parse_args(argv)
    try:
        paths = plot(args.dump_dir, args.out, tuple(s for s in args.stats.split(",") if s))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(Path(path).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m lingua.probe_report"))
