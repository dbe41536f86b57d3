import json

import torch

from lingua.observe import metrics
from lingua.observe.metrics import LoggingArgs


def test_flops_per_token_counts_linears_and_attention():
    model = torch.nn.Module()
    model.tok_embeddings = torch.nn.Embedding(100, 8)
    model.proj = torch.nn.Linear(8, 16, bias=False)
    model.output = torch.nn.Linear(8, 100, bias=False)
    n_matmul = 8 * 16 + 8 * 100  # embeddings excluded: a lookup is not a matmul
    assert (metrics.flops_per_token(model, n_layers=2, attn_width=8, seq_len=32)
            == 6 * n_matmul + 12 * 2 * 8 * 32)
    del model.output
    model.output = None
    tied = metrics.flops_per_token(model, n_layers=2, attn_width=8, seq_len=32,
                                  tied_embeddings=True)
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
    from lingua.models.llama.model import LlamaArgs, Transformer

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


def test_attention_flops_count_the_heads_width_not_dim(corpus, tmp_path):
    """Qwen3's heads are not dim / n_heads wide: q, k, v, wo and attention's QK^T and AV use
    n_heads x head_dim (the planner's count, the trainer's expression)."""
    from lingua.launch import plan as planner

    shape = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
             "model.head_dim=24", "model.qk_norm=true", "model.family=qwen3",
             "model.vocab_size=258", "model.multiple_of=32", "data.seq_len=64"]
    p = planner.plan("apps.llama.train", [f"data.root={corpus}", "data.prepare_embedded=false",
                                          f"dump_dir={tmp_path / 'run'}", *shape], 1,
                     device_type="cpu")
    width = 4 * 24
    attention = 2 * 64 * width + 2 * 64 * 2 * 24                     # wq, wo; wk, wv (GQA)
    n = 2 * (attention + 3 * 64 * 192) + 64 * 258
    assert p.flops_per_token == 6 * n + attention_flops(2, width, 64)


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
    rng = torch.get_rng_state()
    peak = metrics.run_peak(torch.device("cpu"), "fp32", [model], tokens=128, step=0,
                            dump_dir=tmp_path)
    assert torch.equal(torch.get_rng_state(), rng)   # not the run's generator (checkpointed)
    record = json.loads((tmp_path / "peak.json").read_text())
    assert record["source"] == "measured" and record["dtype"] == "fp32"
    assert record["matmul"] == [128, 32, 96]        # tokens x the largest linear (in, out)
    assert record["flops_per_s"] == peak.flops_per_s and 1e7 < peak.flops_per_s < 1e14
    assert len(record["rounds"]) == metrics.PEAK_ROUNDS
    assert record["flops_per_s"] == max(record["rounds"])
    assert record["repeats"] >= 3 * metrics.PEAK_ROUNDS and record["measured_at"]
    assert record["earlier"] == [] and f"{torch.get_num_threads()} threads" in record["device"]
    # A resumed run measures again: the first run's entry stays, under "earlier".
    metrics.run_peak(torch.device("cpu"), "fp32", [model], tokens=64, step=7, dump_dir=tmp_path)
    record = json.loads((tmp_path / "peak.json").read_text())
    assert record["from_step"] == 7 and record["matmul"] == [64, 32, 96]
    assert [e["from_step"] for e in record["earlier"]] == [0]


def fake_rates(monkeypatch, rates) -> list:
    """measure_matmul_peak returning `rates` in turn (then failing); the calls made."""
    rates, calls = iter(rates), []

    def measure(*a, **k):
        calls.append(a)
        return {"flops_per_s": next(rates), "best_s": 1e-3, "repeats": 5}

    monkeypatch.setattr(metrics, "measure_matmul_peak", measure)
    return calls


def test_nothing_is_cached_across_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = fake_rates(monkeypatch, [1e11] * 2 * metrics.PEAK_ROUNDS)
    metrics.run_peak(torch.device("cpu"), "fp32")
    metrics.run_peak(torch.device("cpu"), "fp32")
    assert len(calls) == 2 * metrics.PEAK_ROUNDS and not list(tmp_path.rglob("*"))


def test_a_measured_peak_is_the_best_round_and_never_changes(tmp_path, monkeypatch):
    """One round can come out low (the machine busy in that moment): the peak is the best of
    PEAK_ROUNDS rounds, all taken by run_peak, before the loop. An MFU above 1 later (the peak
    was still wrong) does not measure again or move the peak, which would make the run's MFU
    jump between rows at the same tokens/s: mfu is null, the ratio goes to mfu_above_peak."""
    calls = fake_rates(monkeypatch, [40e9, 80e9, 60e9])
    peak = metrics.run_peak(torch.device("cpu"), "fp32", [torch.nn.Linear(16, 32)], tokens=64,
                            dump_dir=tmp_path)
    written = (tmp_path / "peak.json").read_text()
    record = json.loads(written)
    assert peak.flops_per_s == record["flops_per_s"] == 80e9
    assert record["rounds"] == [40e9, 80e9, 60e9] and record["repeats"] == 15
    assert metrics.mfu_fields(60e9, peak) == {"mfu": 0.75} and metrics.mfu(60e9, peak) == 0.75
    metrics._warned.discard("mfu_above_1")
    warnings = []
    monkeypatch.setattr(metrics.logger, "warning", lambda msg, *a: warnings.append(msg))
    assert metrics.mfu_fields(100e9, peak) == {"mfu": None, "mfu_above_peak": 1.25}
    assert metrics.mfu(100e9, peak) is None and "not credible" in warnings[0]
    assert len(calls) == metrics.PEAK_ROUNDS and peak.flops_per_s == 80e9
    assert (tmp_path / "peak.json").read_text() == written
    assert metrics.mfu_fields(60e9, peak) == {"mfu": 0.75}   # the next row: the same peak


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
