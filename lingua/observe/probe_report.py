"""Reading and plotting what the probe recorded: `python -m lingua.probe plot <dump_dir>`. This
module imports neither torch nor training code, so reading a run's probe stays cheap."""

import argparse
import fnmatch
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import List

from lingua.errors import ConfigError


def read(dump_dir):
    """probe.jsonl as a pandas DataFrame: one row per (step, module, tensor, stat) with `value`."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("lingua.observe.probe_report.read needs pandas: "
                          "pip install -e '.[dev]'") from None
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


DEFAULT_STATS = ("abs_max", "rms", "kurtosis")
# Default heatmaps: block, attention and FFN outputs, output projections (outliers show first).
DEFAULT_KINDS = [("block", "output"), ("attention", "output"), ("feed_forward", "output"),
                 ("attention.wo", "weight"), ("attention.wo", "weight.grad"),
                 ("feed_forward.w2", "weight"), ("feed_forward.w2", "weight.grad")]
TENSOR_ORDER = ("output", "input", "weight", "weight.grad")
# Per-head summaries and routing, recorded beside the module statistics: not --stats names.
SUMMARY_TENSORS = ("attention", "router")
# Heatmap colours clip at the quartiles +- CLIP_IQR IQRs (Tukey): one outlier washes out the rest.
CLIP_IQR = 3.0
STAT_LABELS = {"abs_max": "max |x|", "rms": "rms", "kurtosis": "kurtosis (normal: 3)",
               "std": "std", "mean": "mean", "zero_frac": "fraction of zeros",
               "outlier_frac": "fraction beyond 6 std", "nonfinite": "NaN/Inf count"}


def recorded_stats(lines) -> List[str]:
    """The statistic names of the module tensors in probe.jsonl (what --stats may name)."""
    names = set()
    for _, step_stats in lines:
        for key, values in step_stats.items():
            if key.rpartition("/")[2] not in SUMMARY_TENSORS:
                names.update(values)
    return sorted(names)


def recorded_modules(lines) -> List[str]:
    """The module names in probe.jsonl, in layer order."""
    names = {key.rpartition("/")[0] for _, step_stats in lines for key in step_stats}
    return sorted(names, key=_module_order)


def _module_order(module: str):
    layer, sub = _layer_of(module)
    return (layer is not None, -1 if layer is None else layer, "" if sub == "block" else sub)


def _short_list(modules: List[str]) -> str:
    """Module names with layer numbers folded into * (layers.*.attention.wq), for a message."""
    seen = []
    for module in modules:
        layer, sub = _layer_of(module)
        name = module if layer is None else f"layers.*.{sub}".removesuffix(".block")
        if name not in seen:
            seen.append(name)
    return ", ".join(seen)


def check_stats(stats, lines, path) -> None:
    """ConfigError (one line) naming the stats this run did not record, and those it did."""
    known = recorded_stats(lines)
    unknown = [s for s in stats if s not in known]
    if unknown:
        raise ConfigError(f"--stats: {', '.join(unknown)} not recorded in {path}; known: "
                          f"{','.join(known)} (probe.stats chooses what a run records).")


def select_modules(patterns, lines, path) -> List[str]:
    """ConfigError for a pattern that matches none, with the modules there are."""
    modules = recorded_modules(lines)
    chosen = []
    for pattern in patterns:
        matched = [m for m in modules if fnmatch.fnmatchcase(m, pattern)]
        if not matched:
            raise ConfigError(f"--modules: '{pattern}' matches no module in {path}; modules "
                              f"recorded: {_short_list(modules)} (a name or a glob pattern, "
                              f"e.g. 'layers.*.attention.wq').")
        chosen += [m for m in matched if m not in chosen]
    return sorted(chosen, key=_module_order)


def plot(dump_dir, out_dir=None, stats=None, modules=None) -> List[Path]:
    """PNG paths: per stat, layer x step heatmaps and lines per module; attention entropy and max
    logit; the loss with probe steps marked. `modules`: names or globs (default: block outputs in
    lines, DEFAULT_KINDS in heatmaps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lingua.observe.plot import save_figure

    dump_dir = Path(dump_dir)
    run = dump_dir.resolve().name
    out_dir = Path(out_dir) if out_dir else dump_dir / "probe" / "plots"
    path = dump_dir / "probe" / "probe.jsonl"
    lines = _read_lines(dump_dir)
    if not lines:
        raise ValueError(f"{path} holds no probe steps yet.")
    if stats is None:
        stats = [s for s in DEFAULT_STATS if s in recorded_stats(lines)]
    check_stats(stats, lines, path)
    chosen = select_modules(modules, lines, path) if modules else None
    steps = [s for s, _ in lines]
    by_kind = defaultdict(dict)            # (sub-module, tensor) -> {(layer, step): stats}
    by_module = defaultdict(dict)          # (module, tensor) -> {step: stats}
    for step, step_stats in lines:
        for key, values in step_stats.items():
            module, _, tensor = key.rpartition("/")
            by_module[(module, tensor)][step] = values
            layer, sub = _layer_of(module)
            if layer is not None:
                by_kind[(sub, tensor)][(layer, step)] = values
    kinds = DEFAULT_KINDS if chosen is None else _kinds_of(chosen, by_kind)
    figures = {}   # file name -> (figure, what it shows)
    for stat in stats:
        panels = [(k, by_kind[k]) for k in kinds
                  if k in by_kind and any(stat in x for x in by_kind[k].values())]
        if panels:
            figures[f"heatmap_{stat}.png"] = (_heatmaps(plt, stat, panels, steps),
                                              f"probe {stat} per layer and step")
        series = _line_series(stat, chosen, by_kind, by_module)
        if series:
            figures[f"lines_{stat}.png"] = (_lines(plt, stat, series), f"probe {stat} per step")
    attention = [(k, v) for k, v in sorted(by_kind.items()) if k[1] == "attention"]
    if attention:
        figures["attention.png"] = (_attention(plt, attention, steps), "attention per layer")
    metrics_path = dump_dir / "metrics.jsonl"
    if metrics_path.is_file():
        rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
        figures["loss.png"] = (_loss(plt, rows, steps), "loss, with the probe steps marked")
    for fig, what in figures.values():   # a figure pasted into a report still names its run
        fig.suptitle(f"{run}: {what}")
    return [save_figure(fig, out_dir / name) for name, (fig, _) in figures.items()]


def _kinds_of(modules, by_kind) -> list:
    """The (sub-module, tensor) kinds of the chosen per-layer modules, for the heatmaps."""
    subs = dict.fromkeys(sub for layer, sub in map(_layer_of, modules) if layer is not None)
    return [(sub, tensor) for sub in subs for tensor in TENSOR_ORDER if (sub, tensor) in by_kind]


def _line_series(stat, chosen, by_kind, by_module) -> dict:
    """{panel title: {line label: [(step, value), ...]}}."""
    out = {}
    if chosen is None:
        cells = by_kind.get(("block", "output"), {})
        for layer in sorted({layer for layer, _ in cells}):
            points = sorted((s, v[stat]) for (lay, s), v in cells.items()
                            if lay == layer and v.get(stat) is not None)
            if points:
                out.setdefault("block output (the residual stream)", {})[f"layer {layer}"] = points
        return out
    for tensor in TENSOR_ORDER:
        for module in chosen:
            points = sorted((s, v[stat]) for s, v in by_module.get((module, tensor), {}).items()
                            if v.get(stat) is not None)
            if points:
                out.setdefault(tensor, {})[module] = points
    return out


def colour_limits(grid):
    """(vmin, vmax, cells below vmin, cells above vmax) for a heatmap: the finite values' range,
    narrowed to the quartiles +- CLIP_IQR IQR on a side where cells lie beyond."""
    import numpy as np

    finite = grid[np.isfinite(grid)]
    if finite.size == 0:
        return None, None, 0, 0
    q1, q3 = np.percentile(finite, [25, 75])
    low = max(finite.min(), q1 - CLIP_IQR * (q3 - q1))
    high = min(finite.max(), q3 + CLIP_IQR * (q3 - q1))
    if high <= low and finite.min() < finite.max():
        # The other cells all equal: a range around them keeps the outliers apart.
        low, high = low - 0.05 * (abs(low) or 1.0), high + 0.05 * (abs(high) or 1.0)
    return float(low), float(high), int((finite < low).sum()), int((finite > high).sum())


def _colour_bar(fig, ax, image, stat, below: int, above: int) -> None:
    """The colour bar, labelled with the statistic and colour scale, arrowed at a clipped end."""
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max"}
    bar = fig.colorbar(image, ax=ax, extend=extend.get((below > 0, above > 0), "both"))
    fences = f"quartiles ± {CLIP_IQR:g} IQR"
    scale = (f"colour clipped at {fences}\n({below + above} cell(s) beyond)" if below + above
             else f"colour: full range\n(no cell beyond {fences})")
    bar.set_label(f"{STAT_LABELS.get(stat, stat)}\n{scale}", fontsize=8)


def _heatmaps(plt, stat, panels, steps):
    import numpy as np

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels) + 0.4), squeeze=False,
                             constrained_layout=True)
    for ax, ((sub, tensor), cells) in zip(axes[:, 0], panels):
        layers = sorted({layer for layer, _ in cells})
        grid = np.full((len(layers), len(steps)), np.nan)
        for (layer, step), values in cells.items():
            if stat in values and values[stat] is not None:
                grid[layers.index(layer), steps.index(step)] = values[stat]
        vmin, vmax, below, above = colour_limits(grid)
        image = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                          vmin=vmin, vmax=vmax)
        _colour_bar(fig, ax, image, stat, below, above)
        ticks = sorted(set(np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int)))
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_title(f"{stat} of {sub} {tensor} (layer x step)", fontsize=9)
        ax.set_ylabel("layer")
        ax.set_xlabel("step")
    return fig


def _lines(plt, stat, series: dict):
    from lingua.observe.plot import log_scale

    fig, axes = plt.subplots(len(series), 1, figsize=(10, 3.6 * len(series)), squeeze=False,
                             constrained_layout=True)
    styles = ["-", "--", ":", "-."]
    for ax, (title, lines) in zip(axes[:, 0], series.items()):
        for i, (label, points) in enumerate(lines.items()):
            ax.plot([s for s, _ in points], [v for _, v in points], label=label, marker="o",
                    markersize=3, linestyle=styles[i % len(styles)])
        values = [v for points in lines.values() for _, v in points]
        if min(values) > 0 and max(values) / min(values) > 10:
            log_scale(ax)
        ax.set_title(f"{stat} of {title}, one line per "
                     f"{'layer' if title.startswith('block') else 'module'}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(STAT_LABELS.get(stat, stat))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=1 + len(lines) // 16, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def _attention(plt, attention, steps):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    labels = {"entropy": "entropy (nats)", "max_logit": "max attention logit"}
    for (_sub, _), cells in attention:
        for layer in sorted({layer for layer, _ in cells}):
            xs = [s for s in steps if (layer, s) in cells and cells[(layer, s)]]
            for ax, stat in zip(axes, ("entropy", "max_logit")):
                ax.plot(xs, [cells[(layer, s)][stat] for s in xs], label=f"layer {layer}",
                        marker="o", markersize=3)
    for ax, stat in zip(axes, ("entropy", "max_logit")):
        ax.set_title(f"attention {stat}, one line per layer", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(labels[stat])
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def _loss(plt, rows, probe_steps):
    """The loss with each probe step marked, so the probe's plots can be read against it."""
    fig, ax = plt.subplots(figsize=(10, 4.2), constrained_layout=True)
    loss = {r["step"]: r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))}
    ax.plot(list(loss), list(loss.values()), color="C0", linewidth=1.4, label="train loss")
    val = [r for r in rows if isinstance(r.get("val_loss"), (int, float))]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], color="C1",
                linewidth=0.8, marker="o", markersize=6, markeredgecolor="white", label="val_loss")
    for step in probe_steps:
        ax.axvline(step, color="C3", alpha=0.35, linewidth=1.2, zorder=0)
    if loss:   # on the curve, interpolated where logging.every skipped the probe's step
        import numpy as np

        from lingua.observe.plot import log_scale

        ax.plot(probe_steps, np.interp(probe_steps, list(loss), list(loss.values())),
                linestyle="none", marker="v", markersize=7, color="C3",
                label=f"probe step ({len(probe_steps)})")
        # The values, not ax's lines: the probe steps' vertical lines span the axes.
        log_scale(ax, [*loss.values(), *(r["val_loss"] for r in val)])
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right")
    return fig


def main(argv=None, prog: str = "python -m lingua.probe") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Plot the statistics a run recorded with probe.every.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plot", help="write PNGs of dump_dir/probe/probe.jsonl, print their paths")
    p.add_argument("dump_dir")
    p.add_argument("--out", default=None, help="output directory (default: dump_dir/probe/plots)")
    p.add_argument("--stats", default=None,
                   help="comma-separated statistics to draw (default: abs_max,rms,kurtosis)")
    p.add_argument("--modules", nargs="+", default=None, metavar="PATTERN",
                   help="module names or glob patterns to draw, e.g. 'layers.*.attention.wq' "
                        "(default: the block outputs, and the usual sub-modules in heatmaps)")
    args = parser.parse_args(argv)
    try:
        stats = None if args.stats is None else tuple(s for s in args.stats.split(",") if s)
        paths = plot(args.dump_dir, args.out, stats, args.modules)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(Path(path).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
