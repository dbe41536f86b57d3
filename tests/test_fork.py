"""A researcher's fork: copy apps/llama to a new app, change its model, train it with the same
data, parallelism, checkpointing and launch machinery (README: "Forking an app")."""

import json
import os
import shutil
import subprocess
import sys

from tests.conftest import REPO, read_metrics, tiny_args


def fork_llama(dest):
    """cp -r apps/llama <dest>/myarch, rename the package and its config schema (README steps)."""
    shutil.copytree(REPO / "apps" / "llama", dest / "forks" / "myarch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "forks" / "__init__.py").write_text("")
    for path in (dest / "forks" / "myarch").glob("*.py"):
        text = path.read_text().replace("apps.llama", "forks.myarch")
        text = text.replace('"llama_schema"', '"myarch_schema"').replace('config.load("llama"', 'config.load("myarch"')
        path.write_text(text)
    preset = (REPO / "configs" / "llama" / "debug.yaml").read_text().replace("llama_schema", "myarch_schema")
    (dest / "myarch_debug.yaml").write_text(preset)
    return dest / "forks" / "myarch"


def train_fork(tmp_path, corpus, dump, extra=()):
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    cmd = [sys.executable, "-m", "forks.myarch.train", f"config={tmp_path / 'myarch_debug.yaml'}",
           *tiny_args(corpus, dump, *extra, steps=8)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(dump)


def test_fork_with_a_changed_model_trains_with_the_shared_machinery(corpus, tmp_path):
    app = fork_llama(tmp_path)
    unchanged = train_fork(tmp_path, corpus, tmp_path / "unchanged")
    # The researcher's change: a residual branch scale on the feed-forward (only the model file).
    model = app / "model.py"
    text = model.read_text()
    assert "return x + self.feed_forward(self.ffn_norm(x))" in text
    model.write_text(text.replace("return x + self.feed_forward(self.ffn_norm(x))",
                                  "return x + 0.5 * self.feed_forward(self.ffn_norm(x))"))
    changed = train_fork(tmp_path, corpus, tmp_path / "changed")
    assert changed[0]["loss"] != unchanged[0]["loss"]            # the new model is what trained
    assert changed[-1]["loss"] < changed[0]["loss"] - 0.5        # and it learns
    ckpt = tmp_path / "changed" / "checkpoints" / "8"
    assert (ckpt / ".metadata").is_file()                        # with the shared checkpointing
    assert json.loads((tmp_path / "changed" / "metrics.jsonl").read_text().splitlines()[0])["mfu"] > 0


def shared_runs(a_lines, b_lines, length):
    """Runs of `length` identical consecutive lines (stripped, blank lines and comments ignored)."""
    def norm(lines):
        return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    a, b = norm(a_lines), norm(b_lines)
    windows = {tuple(b[i:i + length]) for i in range(len(b) - length + 1)}
    return [a[i:i + length] for i in range(len(a) - length + 1) if tuple(a[i:i + length]) in windows]


def test_llama_and_moe_apps_share_no_block_of_ten_lines():
    """What both apps need lives in lingua/: a fix there reaches both, nothing drifts."""
    for llama_file in (REPO / "apps" / "llama").glob("*.py"):
        for moe_file in (REPO / "apps" / "moe").glob("*.py"):
            runs = shared_runs(llama_file.read_text().splitlines(), moe_file.read_text().splitlines(), 10)
            assert not runs, f"{llama_file.name} and {moe_file.name} share:\n" + "\n".join(runs[0])


def test_shared_runs_finds_a_copied_block():
    block = [f"x{i} = {i}" for i in range(12)]
    assert shared_runs(["a = 1", *block], [*block, "b = 2"], 10)
    assert not shared_runs(block[:9], block[:9], 10)
