import json

import torch

from lingua import metrics
from lingua.metrics import LoggingArgs


def test_flops_per_token_counts_linears_and_attention():
    model = torch.nn.Module()
    model.tok_embeddings = torch.nn.Embedding(100, 8)
    model.proj = torch.nn.Linear(8, 16, bias=False)
    model.output = torch.nn.Linear(8, 100, bias=False)
    n_matmul = 8 * 16 + 8 * 100  # embeddings excluded: a lookup is not a matmul
    assert metrics.flops_per_token(model, n_layers=2, dim=8, seq_len=32) == 6 * n_matmul + 12 * 2 * 8 * 32
    del model.output
    model.output = None
    tied = metrics.flops_per_token(model, n_layers=2, dim=8, seq_len=32, tied_embeddings=True)
    assert tied == 6 * (8 * 16 + 100 * 8) + 12 * 2 * 8 * 32


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda dtype: calls.append(dtype) or 1e11)
    assert metrics.peak_flops(torch.device("cpu"), "fp32") == 1e11
    assert metrics.peak_flops(torch.device("cpu"), "fp32") == 1e11
    assert calls == [torch.float32]
    cached = json.loads((tmp_path / "lingua" / "matmul_peak.json").read_text())
    assert list(cached.values()) == [1e11]


def test_measured_peak_is_a_plausible_flop_rate():
    peak = metrics.measure_cpu_peak(torch.float32, seconds=0.2)
    assert 1e8 < peak < 1e14


def test_metric_logger_writes_unrounded_json_lines_on_rank0_only(tmp_path):
    log = metrics.MetricLogger(tmp_path, LoggingArgs(), {}, enabled=True)
    log.log({"step": 1, "loss": 1.23456789012345})
    log.close()
    quiet = metrics.MetricLogger(tmp_path / "other", LoggingArgs(), {}, enabled=False)
    quiet.log({"step": 1, "loss": 2.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 1.23456789012345}]
    assert not (tmp_path / "other").exists()
