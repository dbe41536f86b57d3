import json
import math
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from lingua import plot
from lingua.errors import ConfigError

from .conftest import run_python, tiny_args

EXPECTED_SHAPE = (round(plot.FIGSIZE[1] * plot.DPI), round(plot.FIGSIZE[0] * plot.DPI))


def write_run(dump_dir: Path, offset: float = 0.0, steps: int = 20, val_every: int = 0,
              drop=()) -> Path:
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
        lines.append(json.dumps(row))
    (dump_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n\n")  # a trailing blank line
    return dump_dir


def check_png(path: Path) -> None:
    assert path.is_file(), path
    img = mpimg.imread(path)
    assert img.shape[:2] == EXPECTED_SHAPE
    assert img[..., :3].std() > 0.05, "image is (nearly) blank"
    colours = np.unique((img[..., :3] * 255).round().reshape(-1, 3), axis=0)
    assert len(colours) > 2


def test_cli_compares_two_runs(tmp_path):
    a = write_run(tmp_path / "a" / "run", val_every=5)
    b = write_run(tmp_path / "b" / "run", offset=0.3, drop=("mfu",))
    proc = run_python("lingua.plot", [str(a), str(b)])
    printed = proc.stdout.strip().splitlines()
    assert len(printed) == 1
    out = Path(printed[0])
    assert out.is_absolute() and out == (a / "plots" / "compare.png").absolute()
    check_png(out)

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
    rows = [{"step": 2, "loss": 1.0}, {"step": 1, "loss": 2.0, "lr": None}, {"step": 2, "loss": 0.5}]
    assert plot.series(rows, "loss") == ([1, 2], [2.0, 0.5])  # sorted, a step's last row wins
    assert plot.series(rows, "lr") == ([], [])
    fig = plot.compare_figure({"r": rows})
    texts = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes}
    assert texts["loss"] == []
    assert texts["learning rate"] == ["no data"] and texts["MFU (%)"] == ["no data"]
    path = plot.save_figure(fig, tmp_path / "deep" / "dir" / "f.png")
    assert path.is_absolute() and mpimg.imread(path).shape[:2] == EXPECTED_SHAPE
    import matplotlib.pyplot as plt

    assert not plt.fignum_exists(fig.number)  # save_figure closed it


def test_plot_a_real_training_run(corpus, tmp_path):
    run = tmp_path / "run"
    run_python("apps.llama.train", tiny_args(corpus, run, steps=3))
    proc = run_python("lingua.plot", [str(run)])
    out = Path(proc.stdout.strip())
    assert out == (run / "plots" / "compare.png").absolute()
    check_png(out)
