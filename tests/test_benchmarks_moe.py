"""Smoke test of benchmarks/moe_trainer_vs_hf.py on a tiny shape (one round): the trainer and the
HF Mixtral loop run side by side on the exported weights and a ratio comes out."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="the benchmark pins each side to its own core")
def test_moe_trainer_vs_hf_smoke(tmp_path, corpus):
    work = tmp_path / "bench"
    cmd = [sys.executable, "benchmarks/moe_trainer_vs_hf.py", "--shapes", "tiny", "--rounds", "1",
           "--batch", "2", "--seq-len", "64", "--hf-experts", "grouped_mm", "--workdir", str(work),
           "--extra", f"data.root={corpus}", "--extra", "data.prepare_embedded=false"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "avx2" in out.stdout or "flags:" in out.stdout  # the CPU is named with its flags
    round_line = re.search(r"round 1: ours +(\d+) tok/s \((\d+) steps.*"
                           r"HF +(\d+) tok/s \((\d+) steps.*"
                           r"ours/HF (\d+\.\d+)", out.stdout)
    assert round_line, out.stdout
    ours, ours_steps, hf, hf_steps, ratio = (float(g) for g in round_line.groups())
    assert ours > 0 and hf > 0 and ours_steps >= 1 and hf_steps >= 1
    assert ratio == pytest.approx(ours / hf, rel=0.02)
    assert re.search(r"tiny +fp32 +HF grouped_mm +\d+\.\d+", out.stdout)
    # The HF side trained the export of our own checkpoint, as Mixtral, with the experts asked for.
    config = json.loads((work / "hf_tiny" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 8
    (hf_log_path,) = work.glob("hf_tiny_fp32_grouped_mm_*.jsonl")
    hf_log = [json.loads(line) for line in hf_log_path.read_text().splitlines()
              if line.startswith("{")]
    assert hf_log[0] == {"hf_experts": "grouped_mm"} and "hf_step" in hf_log[1]


def test_measured_rows_skip_the_warmup_window(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from moe_trainer_vs_hf import measured_rows

    rows = [{"step": 10, "tokens_per_s": 50.0}, {"step": 20, "tokens_per_s": 100.0},
            {"step": 25, "tokens_per_s": 200.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, measured = measured_rows(tmp_path, tokens_per_step=100)
    # 10 steps of 100 tokens at 100 tok/s = 10 s; 5 steps at 200 tok/s = 2.5 s; step 10's window
    # (the warm-up) is left out.
    assert first == 10 and measured == [(10, 10.0), (5, 2.5)]


@pytest.mark.parametrize("script", ["moe_trainer_vs_hf", "llama_cpu"])
def test_bf16_is_refused_where_the_cpu_only_emulates_it(monkeypatch, script):
    """Both CPU benchmarks share one dtype check (llama_cpu.dtypes_for_this_cpu): asked for bf16
    where it is emulated (30-100x slower than fp32), they exit before starting anything, naming
    the fix; where it is native they accept it."""
    import importlib

    from lingua.observe import metrics

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    bench = importlib.import_module(script)
    started = []
    # What each script starts first once the dtypes are accepted: the side-by-side runs.
    monkeypatch.setattr(bench, "bench" if script == "moe_trainer_vs_hf" else "two_cores",
                        lambda *a: started.append(a))
    monkeypatch.setattr(metrics, "cpu_bf16_emulated", lambda: True)
    with pytest.raises(SystemExit, match="--dtypes fp32"):
        bench.main(["--dtypes", "bf16"])
    assert not started
    from llama_cpu import dtypes_for_this_cpu

    monkeypatch.setattr(metrics, "cpu_bf16_emulated", lambda: False)
    assert dtypes_for_this_cpu("bf16") == (["bf16"], False)
    assert dtypes_for_this_cpu(None) == (["fp32", "bf16"], False)
