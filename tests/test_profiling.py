"""profiling.*: torch.profiler traces and summaries per rank, per-phase step times in metrics."""

import json

import pytest
import torch

from apps.llama import train
from lingua.errors import ConfigError
from lingua.observe import metrics, profiling
from tests.conftest import read_metrics, run_python, run_torchrun, tiny_args

# Steps 1..5; the profiler starts at step 2, waits 1, warms up 1 and records steps 4 and 5.
WINDOW = ["profiling.enabled=true", "profiling.start_step=2", "profiling.wait=1",
          "profiling.warmup=1", "profiling.active=2"]


def trace_names(path) -> set:
    trace = json.loads(path.read_text())
    assert "traceEvents" in trace
    return {event.get("name") for event in trace["traceEvents"]}


@pytest.mark.slow
def test_one_process_run_writes_a_chrome_trace_and_a_summary(corpus, tmp_path):
    dump = tmp_path / "run"
    proc = run_python("apps.llama.train", tiny_args(corpus, dump, *WINDOW, steps=5))
    traces = sorted((dump / "profiling").glob("trace_rank0_step*.json"))
    # Named after the last recorded step.
    assert [p.name for p in traces] == ["trace_rank0_step5.json"]
    names = trace_names(traces[0])
    assert {"data", "forward", "backward", "optimizer"} <= names
    assert {"aten::mm", "aten::addmm"} & names
    assert len([n for n in names if str(n).startswith("ProfilerStep#")]) == 2  # the active steps
    summary = (dump / "profiling" / "summary_rank0.txt").read_text()
    assert "steps 4..5" in summary and "aten::mm" in summary and "Self CPU" in summary
    assert "self_cpu_memory_usage" in summary  # memory=true on CPU adds the memory table
    assert "profiling: trace" in proc.stdout and "MFU" in proc.stdout
    # Profiling does not change what is logged: every step still has its row.
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4, 5]


@pytest.mark.distributed
def test_each_rank_writes_its_own_trace(corpus, tmp_path):
    dump = tmp_path / "run"
    run_torchrun(2, "apps.llama.train",
                 tiny_args(corpus, dump, "distributed.dp_shard=2", "data.batch_size=4", *WINDOW,
                           steps=5))
    out = dump / "profiling"
    for rank in (0, 1):
        assert {"forward", "backward"} <= trace_names(out / f"trace_rank{rank}_step5.json")
        assert "aten::mm" in (out / f"summary_rank{rank}.txt").read_text()


def test_metrics_split_each_step_into_phases(corpus, tmp_path):
    dump = tmp_path / "run"
    assert train.main(tiny_args(corpus, dump, "logging.every=2", steps=4)) == 0
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["optim_s"] > 0
        # Disjoint parts of the same steps, averaged over the same window: never more than the step.
        assert r["fwd_s"] + r["bwd_s"] + r["optim_s"] + r["data_s"] <= r["step_s"] * 1.05
        assert "fwd_bwd_s" not in r


@pytest.mark.distributed
def test_pipeline_logs_forward_and_backward_as_one_phase(corpus, tmp_path):
    dump = tmp_path / "run"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, dump, "distributed.pp=2", steps=2))
    for r in read_metrics(dump):
        assert r["fwd_bwd_s"] > 0 and r["optim_s"] > 0
        assert "fwd_s" not in r and "bwd_s" not in r


def test_disabled_profiling_creates_no_profiler_and_no_directory(corpus, tmp_path, monkeypatch):
    def no_profiler(*args, **kwargs):
        raise AssertionError("a profiler was created with profiling disabled")

    monkeypatch.setattr(torch.profiler, "profile", no_profiler)
    dump = tmp_path / "run"
    assert train.main(tiny_args(corpus, dump, steps=2)) == 0
    assert not (dump / "profiling").exists()
    assert "fwd_s" in read_metrics(dump)[-1]  # the phase times do not need the profiler


@pytest.mark.parametrize("override, key", [
    ("profiling.start_step=0", "profiling.start_step"),
    ("profiling.wait=-1", "profiling.wait"),
    ("profiling.warmup=-2", "profiling.warmup"),
    ("profiling.active=0", "profiling.active"),
    ("profiling.top_ops=0", "profiling.top_ops"),
])
def test_bad_profiling_values_are_refused_naming_the_key(corpus, tmp_path, override, key):
    with pytest.raises(ConfigError, match=key):
        train.load_config(tiny_args(corpus, tmp_path / "run", override))


def test_a_window_past_the_last_step_is_refused(corpus, tmp_path):
    # Defaults record steps 7..9: a 5-step run would never finish the window.
    with pytest.raises(ConfigError, match=r"profiling.start_step=5 .* steps=5") as err:
        train.load_config(tiny_args(corpus, tmp_path / "run", "profiling.enabled=true", steps=5))
    assert "Lower profiling.start_step" in str(err.value)
    # Off, the same window is not an error.
    train.load_config(tiny_args(corpus, tmp_path / "run", steps=5))


def test_window_averages_phases_over_the_timed_steps_only():
    window = metrics.Window()
    window.add(1.0, 0.1, 10, {"fwd": 0.3, "bwd": 0.5})
    window.add(2.0, 0.1, 10, {})  # an untimed step (CUDA, not logged) counts for step_s only
    window.add(1.0, 0.1, 10, {"fwd": 0.1, "bwd": 0.3})
    assert window.phase_s() == pytest.approx({"fwd_s": 0.2, "bwd_s": 0.4})
    assert window.step_s() == pytest.approx(4.0 / 3)
    window.reset()
    assert window.phase_s() == {}


def test_phase_timer_sums_micro_batches_and_syncs_only_timed_steps():
    timer = profiling.PhaseTimer(torch.device("cpu"))
    timer.start_step(timed=False)  # on CPU there is nothing to synchronize: every step is timed
    for _ in range(2):
        with timer.phase("fwd"):
            pass
    assert set(timer.step_seconds()) == {"fwd"}
    syncs = []
    timer.synchronize = lambda: syncs.append(1)  # what CUDA's PhaseTimer holds
    timer.start_step(timed=False)
    with timer.phase("bwd"):
        pass
    assert timer.step_seconds() == {} and syncs == []
    timer.start_step(timed=True)
    with timer.phase("bwd"):
        pass
    assert set(timer.step_seconds()) == {"bwd"} and len(syncs) == 2
