"""Honest MFU: on a CPU without bf16 instructions (faked here through metrics.cpu_flags) a bf16 run
warns once that it will be slow and logs mfu as null instead of a number against an emulated
peak; an MFU above 100% is never logged."""

import json

import pytest
import torch

from apps.llama import train
from lingua.observe import metrics
from tests.conftest import read_metrics, tiny_args

AVX2_ONLY = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma avx2".split())
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(metrics, "_warned", set())


def fake_cpu(monkeypatch, flags) -> None:
    monkeypatch.setattr(metrics, "cpu_flags", lambda: flags)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                   "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n")
    assert metrics.cpu_flags(str(x86)) == {"fpu", "avx2", "avx512_bf16"}
    assert "bf16" in metrics.cpu_flags(str(arm))
    assert metrics.cpu_flags(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("flags,emulated", [
    (AVX2_ONLY, True),
    (AVX2_ONLY | {"avx512f"}, True),          # AVX-512 alone has no bf16 dot products
    (AVX2_ONLY | {"avx512_bf16"}, False),
    (SAPPHIRE_RAPIDS, False),
    (frozenset({"fp", "asimd", "bf16"}), False),   # Arm with the BF16 extension
    (None, False),                             # unknown (no /proc/cpuinfo): no claim
])
def test_bf16_emulation_is_told_by_the_flags(monkeypatch, flags, emulated):
    fake_cpu(monkeypatch, flags)
    assert metrics.cpu_bf16_emulated() is emulated


def test_no_peak_and_one_warning_for_emulated_bf16(monkeypatch, caplog, tmp_path):
    fake_cpu(monkeypatch, AVX2_ONLY)
    monkeypatch.setattr(metrics, "measure_cpu_peak",
                        lambda *a, **k: pytest.fail("timed the emulation (seconds per matmul)"))
    assert metrics.peak_flops(torch.device("cpu"), "bf16") is None
    assert metrics.peak_flops(torch.device("cpu"), "bf16") is None
    warnings = [r for r in caplog.records if "without bf16 instructions" in r.getMessage()]
    assert len(warnings) == 1
    assert "30-100x slower" in warnings[0].getMessage()
    assert "distributed.model_dtype=fp32" in warnings[0].getMessage()
    # fp32 on the same CPU is measured.
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda *a, **k: 30e9)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))   # not the real cache of measured peaks
    assert metrics.peak_flops(torch.device("cpu"), "fp32") == 30e9


def test_an_mfu_above_one_is_null_with_one_warning(caplog):
    assert metrics.mfu(2e9, 10e9) == pytest.approx(0.2)
    assert metrics.mfu(35e9, 10e9) is None      # 350%: the peak is wrong, not the run
    assert metrics.mfu(50e9, 10e9) is None
    assert metrics.mfu(1e9, None) is None       # no credible peak
    assert metrics.mfu(float("inf"), 10e9) is None
    warnings = [r for r in caplog.records if "not credible" in r.getMessage()]
    assert len(warnings) == 1 and "350%" in warnings[0].getMessage()


def test_a_null_mfu_is_formatted_and_written_as_null():
    row = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0,
           "mfu": None, "data_s": 0.001, "peak_mem_gib": 0.1}
    assert "mfu n/a" in metrics.format_line(row)
    assert json.loads(json.dumps(row))["mfu"] is None
    assert "mfu 12.5%" in metrics.format_line(dict(row, mfu=0.125))


def test_plots_skip_a_null_mfu():
    from lingua.observe.plot import series

    rows = [{"step": 1, "mfu": None}, {"step": 2, "mfu": 0.25}]
    assert series(rows, "mfu", 100.0) == ([2], [25.0])


def test_a_bf16_run_on_a_cpu_without_bf16_warns_and_logs_null_mfu(corpus, tmp_path, monkeypatch,
                                                                   capsys):
    """The real trainer, with this CPU's flags replaced by an AVX2-only machine's."""
    fake_cpu(monkeypatch, AVX2_ONLY)
    dump = tmp_path / "run"
    assert train.main(tiny_args(corpus, dump, "distributed.model_dtype=bf16", steps=2)) == 0
    out = capsys.readouterr()
    log = out.out + out.err
    assert log.count("without bf16 instructions") == 1, log[-3000:]
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("mfu" in r and r["mfu"] is None for r in rows)
    assert '"mfu": null' in (dump / "metrics.jsonl").read_text()
    assert "mfu n/a" in log
