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


# -- FLOPs per token against a hand count ---------------------------------------------------
# The parameters are counted from the architecture by formula here, not by walking the model.
def attention_params(dim, n_heads, n_kv_heads):
    head_dim = dim // n_heads
    return 2 * dim * dim + 2 * dim * n_kv_heads * head_dim          # wq, wo; wk, wv (GQA)


def attention_flops(n_layers, dim, seq_len):
    # QK^T and AV: 2 x seq_len x dim multiply-adds each per token per layer forward, x3 with the
    # backward (PaLM's convention, as if not causal).
    return 3 * 2 * (2 * seq_len * dim) * n_layers


def test_llama_flops_per_token_match_a_hand_count():
    from apps.llama.model import LlamaArgs, Transformer

    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=32)
    hidden = 192                # 2/3 x 4 x 64 = 170, rounded up to a multiple of 32
    per_layer = attention_params(64, 4, 2) + 3 * 64 * hidden        # + SwiGLU w1, w2, w3
    n = 2 * per_layer + 64 * 258                                    # + output projection
    assert n == 114816
    expected = 6 * n + attention_flops(2, 64, 64)
    with torch.device("meta"):
        model = Transformer(args)
    assert metrics.flops_per_token(model, 2, 64, 64) == expected == 787200
    # Tied embeddings: the output matmul still costs its FLOPs (through the embedding matrix).
    tied = LlamaArgs(**{**args.__dict__, "tie_embeddings": True})
    with torch.device("meta"):
        model = Transformer(tied)
    assert metrics.flops_per_token(model, 2, 64, 64, tied_embeddings=True) == expected


def test_moe_flops_per_token_count_active_experts_only():
    from apps.moe.model import MoEArgs, flops_per_token

    args = MoEArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=32,
                   n_experts=8, top_k=2, n_shared_experts=1, expert_hidden_dim=48,
                   n_dense_layers=1)
    expert = 3 * 64 * 48                                            # one expert's w1, w2, w3
    moe_layer = (attention_params(64, 4, 2) + 64 * 8                # + router gate
                 + 1 * expert                                       # the shared expert: always
                 + 2 * expert)                                      # top_k of the 8 routed ones
    dense_layer = attention_params(64, 4, 2) + 3 * 64 * 192
    n_active = dense_layer + 2 * moe_layer + 64 * 258
    assert n_active == 146560
    assert flops_per_token(args, 64) == 6 * n_active + attention_flops(3, 64, 64) == 1026816


# -- the peak MFU is divided by ---------------------------------------------------------------
def test_run_peak_measures_the_model_shape_and_writes_peak_json(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 96, bias=False),
                                torch.nn.Linear(96, 32, bias=False), torch.nn.Linear(32, 8))
    peak = metrics.run_peak(torch.device("cpu"), "fp32", [model], tokens=128, step=0,
                            dump_dir=tmp_path)
    record = json.loads((tmp_path / "peak.json").read_text())
    assert record["source"] == "measured" and record["dtype"] == "fp32"
    assert record["matmul"] == [128, 32, 96]        # tokens x the largest linear (in, out)
    assert record["flops_per_s"] == peak.flops_per_s and 1e7 < peak.flops_per_s < 1e14
    assert record["repeats"] >= 3 and record["measured_at"] and record["earlier"] == []
    assert f"{torch.get_num_threads()} threads" in record["device"]
    # A resumed run measures again: the first run's entry stays, under "earlier".
    metrics.run_peak(torch.device("cpu"), "fp32", [model], tokens=64, step=7, dump_dir=tmp_path)
    record = json.loads((tmp_path / "peak.json").read_text())
    assert record["from_step"] == 7 and record["matmul"] == [64, 32, 96]
    assert [e["from_step"] for e in record["earlier"]] == [0]


def test_nothing_is_cached_across_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(metrics, "measure_matmul_peak",
                        lambda *a, **k: calls.append(a) or {"flops_per_s": 1e11, "best_s": 1e-3,
                                                            "repeats": 3})
    metrics.run_peak(torch.device("cpu"), "fp32")
    metrics.run_peak(torch.device("cpu"), "fp32")
    assert len(calls) == 2 and not list(tmp_path.rglob("*"))


def test_mfu_is_never_above_one_even_against_a_tiny_peak(tmp_path, monkeypatch):
    """A peak measured while the machine was busy (here: 1 kFLOP/s) is measured again when MFU
    comes out above 1; the higher is kept and peak.json says why. Neither measurement draws from
    torch's global generator: it is the run's (checkpointed), and whether the peak is measured
    again depends on the machine's load (a CI run's resumed RNG state once differed so)."""
    model = torch.nn.Linear(16, 16)
    rng = torch.get_rng_state()
    peak = metrics.run_peak(torch.device("cpu"), "fp32", [model], tokens=64, dump_dir=tmp_path)
    peak.flops_per_s = 1e3
    real = 1e6        # far below any CPU's matmul rate: credible against a real measurement
    value = metrics.mfu(real, peak)
    assert value is not None and 0 < value <= 1
    assert torch.equal(torch.get_rng_state(), rng)
    record = json.loads((tmp_path / "peak.json").read_text())
    assert record["flops_per_s"] == peak.flops_per_s > 1e6
    assert "measured again" in record["note"]
    # Measured once more only: a rate above even the new peak is logged as null, with a warning.
    metrics._warned.discard("mfu_above_1")
    with_warning = []
    monkeypatch.setattr(metrics.logger, "warning", lambda msg, *a: with_warning.append(msg))
    assert metrics.mfu(peak.flops_per_s * 1.3, peak) is None
    assert "not credible" in with_warning[0]


def test_a_measured_peak_is_measured_again_once_at_the_first_logged_step(tmp_path, monkeypatch):
    """One measurement at start can come out low (the machine busy in that moment), which
    overstates every MFU of the run: the trainer measures again at its first logged row and keeps
    the higher, once per run, and never lowers a peak; peak.json records both."""
    rates = iter([40e9, 80e9, 10e9])
    calls = []

    def measure(*a, **k):
        calls.append(a)
        return {"flops_per_s": next(rates), "best_s": 1e-3, "repeats": 5}

    monkeypatch.setattr(metrics, "measure_matmul_peak", measure)
    model = torch.nn.Linear(16, 32)
    peak = metrics.run_peak(torch.device("cpu"), "fp32", [model], tokens=64, dump_dir=tmp_path)
    assert peak.flops_per_s == 40e9
    peak.measure_again(step=10)
    assert peak.flops_per_s == 80e9 and metrics.mfu(60e9, peak) == 0.75
    record = json.loads((tmp_path / "peak.json").read_text())
    assert record["flops_per_s"] == 80e9
    assert record["measured_again"] == {"step": 10, "flops_per_s": 80e9,
                                        "start_flops_per_s": 40e9, "kept": True}
    assert not record["note"]   # the note is for a peak measured again because MFU passed 1
    peak.measure_again(step=20)          # once per run: the third rate (lower) is never drawn
    assert len(calls) == 2 and peak.flops_per_s == 80e9

    # A second measurement lower than the start's leaves the peak as it was.
    rates = iter([50e9, 30e9])
    low = metrics.run_peak(torch.device("cpu"), "fp32", [model], tokens=64, dump_dir=tmp_path)
    low.measure_again(step=1)
    record = json.loads((tmp_path / "peak.json").read_text())
    assert low.flops_per_s == record["flops_per_s"] == 50e9
    assert record["measured_again"]["kept"] is False
    assert [e["flops_per_s"] for e in record["earlier"]] == [80e9]

    # A data-sheet peak, or none (bf16 emulated), is not measured.
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda *a, **k: 1 / 0)
    for fixed in (metrics.Peak(1e15, "datasheet", "bf16", "NVIDIA H100"),
                  metrics.Peak(None, "none", "bf16", "cpu")):
        fixed.measure_again(step=10)
        assert fixed.measured_again is None


def test_a_data_sheet_peak_is_not_measured_and_above_one_is_null(monkeypatch):
    peak = metrics.Peak(1e9, "datasheet", "bf16", "NVIDIA H100")
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda *a, **k: 1 / 0)
    assert metrics.mfu(5e8, peak) == 0.5
    assert metrics.mfu(2e9, peak) is None
    assert metrics.mfu(2e9, 1e9) is None and metrics.mfu(5e8, 1e9) == 0.5   # a bare number too


def test_bf16_on_a_cpu_that_emulates_it_has_no_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    peak = metrics.run_peak(torch.device("cpu"), "bf16", dump_dir=tmp_path)
    assert peak.flops_per_s is None and metrics.mfu(1e9, peak) is None
    record = json.loads((tmp_path / "peak.json").read_text())
    assert record["source"] == "none" and "emulated" in record["note"]


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
