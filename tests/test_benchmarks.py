"""benchmarks/llama_cpu.py (our trainer vs a Hugging Face loop, side by side), and what makes our
step faster than HF's: the hand-written RMSNorm / RoPE backward passes of the eager step, sdpa's
own grouped-query attention, and one compiled graph shared by all blocks."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lingua.models.llama.model import LlamaArgs, Transformer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import trainer_vs_hf  # noqa: E402


@pytest.mark.parametrize("shape", ["5M", "10M", "50M", "10M-vocab32k", "tiny"])
def test_hf_side_has_our_shape(shape):
    """Both sides train the same model: same parameter count, from the same shape table."""
    args = trainer_vs_hf.SHAPES[shape]
    with torch.device("meta"):
        ours = Transformer(LlamaArgs(**{"vocab_size": trainer_vs_hf.VOCAB, **args},
                                     multiple_of=trainer_vs_hf.MULTIPLE_OF, max_seq_len=1024))
        theirs = trainer_vs_hf.hf_model(args, 512)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == trainer_vs_hf.n_params(args)
    assert theirs.config.num_key_value_heads == args["n_kv_heads"]


def test_the_reported_ratio_is_the_median_of_the_rounds_not_the_better_of_two():
    import llama_cpu

    assert llama_cpu.median([1.105, 1.048]) == pytest.approx(1.0765)
    assert llama_cpu.median([1.264, 0.942, 1.034]) == 1.034


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="the benchmark runs its two sides at once, one core each")
def test_llama_cpu_benchmark_runs_end_to_end(tmp_path):
    """One round on a tiny shape through `python -m apps.llama.train` and the HF loop; prints
    the CPU, each side's tokens/s and a ratio."""
    out = subprocess.run(
        [sys.executable, "benchmarks/llama_cpu.py", "--shapes", "tiny", "--dtypes", "fp32",
         "--rounds", "1", "--warmup", "2", "--steps", "3", "--batch", "2", "--seq-len", "64",
         "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CPU: " in out.stdout and "flags:" in out.stdout
    assert "HF's malloc glibc default" in out.stdout
    assert re.search(r"round 1: ours +\d+ tokens/s .* HF +\d+ tokens/s", out.stdout), out.stdout
    match = re.search(r"ratio ours/hf tokens/s: tiny fp32 ([\d.]+) \(per CPU-second ([\d.]+)\)",
                      out.stdout)
    assert match and float(match.group(1)) > 0 and float(match.group(2)) > 0, out.stdout
    rows = (tmp_path / "ours_tiny_fp32_eager_0" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 5   # every step logged (logging.every=1), as the benchmark reads them


def test_compiled_blocks_share_one_graph():
    """distributed.compile compiles one graph for all blocks: a block's integer attributes
    (layer_id) are not read in training, so dynamo does not guard on them. Otherwise each block
    compiles separately and those past dynamo's recompile limit (8) run eager."""
    from torch._dynamo.testing import CompileCounter

    from lingua.parallel.distributed import apply_compile

    torch._dynamo.reset()
    model = Transformer(LlamaArgs(dim=32, n_layers=10, n_heads=2, vocab_size=32, max_seq_len=8))
    counter = CompileCounter()
    apply_compile(model.layers, counter)
    model(torch.randint(0, 32, (1, 8))).sum().backward()
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_keep_freed_memory_leaves_the_users_own_malloc_settings(monkeypatch):
    """The trainer tunes glibc's malloc for CPU runs unless the user set one of the knobs it
    turns (then start_process logs that it left them); unrelated settings do not stop it. Only
    refusals call keep_freed_memory here: accepting would tune this pytest process's malloc
    (the next test checks the effect, in a subprocess)."""
    from lingua.launch.host_memory import keep_freed_memory, user_malloc_setting

    for key in [k for k in os.environ if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
    assert user_malloc_setting() is None
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert user_malloc_setting() == "MALLOC_TRIM_THRESHOLD_"
    assert keep_freed_memory() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0:glibc.malloc.mmap_max=0")
    assert "glibc.malloc.mmap_max" in user_malloc_setting()
    assert keep_freed_memory() is False


def test_hf_side_takes_our_malloc_setting_only_when_asked(monkeypatch):
    """`--hf-malloc-like-ours` reaches the HF process as an environment variable; there it tunes
    malloc as the trainer does, and says so when it cannot rather than measure something else."""
    import lingua.launch.host_memory

    calls = []
    monkeypatch.setattr(lingua.launch.host_memory, "keep_freed_memory",
                        lambda: calls.append(1) or True)
    monkeypatch.delenv(trainer_vs_hf.HF_MALLOC_VAR, raising=False)
    trainer_vs_hf.hf_malloc_like_ours()                 # not asked: nothing happens
    assert calls == []
    monkeypatch.setenv(trainer_vs_hf.HF_MALLOC_VAR, "1")
    trainer_vs_hf.hf_malloc_like_ours()
    assert calls == [1]
    monkeypatch.setattr(lingua.launch.host_memory, "keep_freed_memory", lambda: False)
    with pytest.raises(SystemExit, match="GLIBC_TUNABLES"):
        trainer_vs_hf.hf_malloc_like_ours()


_FAULTS_OF_REALLOCATION = """
import ctypes, resource, sys, torch
from lingua.launch.host_memory import keep_freed_memory
# Base pages only: with transparent huge pages (THP 'always', or THP_MEM_ALLOC_ENABLE) a 256 MiB
# block takes 2 MiB faults and the default's count would be 128 times smaller.
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)   # PR_SET_THP_DISABLE
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # warm-up: the heap settles (its 2nd block is sometimes fresh memory too)
    x = torch.ones(256 << 20, dtype=torch.uint8); del x   # 256 MiB: a step's logits, real vocab
before = faults()
for _ in range(3):
    x = torch.ones(256 << 20, dtype=torch.uint8); del x
print(faults() - before, resource.getpagesize())
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keep_freed_memory_reuses_large_blocks_without_page_faults():
    """A block freed and allocated again, as every step's logits and activations are, comes back
    without page faults once the trainer tuned malloc; by default glibc unmaps it and the kernel
    zeroes every page again (65,536 faults per 256 MiB of 4 KiB pages).
    Both processes run with glibc's per-thread cache off for small chunks (tcache_max=0): torch
    allocates with posix_memalign(64), and glibc 2.36's memalign cuts a 48-96 byte tail off the
    block it takes from the heap's top and frees it into that cache, where it stays between the
    freed block and the top; the freed block, exactly the size asked, is then too small for the
    next memalign (size + alignment) and every round takes fresh pages. That happens in 3 of the
    4 alignments the heap's start can have (10 of 12 processes on the AMD EPYC, 2026-11-28; the
    earlier form of this test, which took the first of 10 processes that reused, failed there).
    Without the cache the tail goes to a fastbin, which the next large malloc merges back."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")
           and k not in ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")}
    env["GLIBC_TUNABLES"] = "glibc.malloc.tcache_max=0"

    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS_OF_REALLOCATION, mode], cwd=REPO,
                             env=env, capture_output=True, text=True, check=True)
        count, page = out.stdout.split()[-2:]
        return int(count), int(page)

    count, page = faults("default")
    pages_per_round = (256 << 20) // page
    assert count > 3 * pages_per_round * 0.9
    assert faults("tuned")[0] < pages_per_round * 0.02


@pytest.mark.slow
def test_loss_cpu_benchmark_runs_and_checks_the_loss_it_times():
    """benchmarks/loss_cpu.py: the three losses side by side; it asserts lingua's compiled loss
    equals eager F.cross_entropy (value and gradient) before timing anything."""
    out = subprocess.run([sys.executable, "benchmarks/loss_cpu.py", "--tokens", "64", "--vocab",
                          "100", "--dtypes", "fp32", "--repeats", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "flags:" in out.stdout
    for side in ["eager F.cross_entropy", "compiled F.cross_entropy", "lingua compiled"]:
        assert re.search(rf"fp32 {side}.* forward +[\d.]+ ms +backward +[\d.]+ ms .* [\d.]+x",
                         out.stdout), out.stdout


def test_norm_rope_benchmark_checks_each_side_against_torch_before_timing(capsys):
    """benchmarks/norm_rope_cpu.py, in process on a small shape: lingua's RMSNorm and RoPE
    functions equal F.rms_norm and the rotate_half composite (outputs and gradients) before
    it times them, and it prints each side's ratio to the baseline."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import norm_rope_cpu

    assert norm_rope_cpu.main(["--shape", "2,8,32", "--heads", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for line in ("rmsnorm F.rms_norm", "rmsnorm lingua", "rope composite", "rope lingua"):
        assert re.search(rf"{line} +fwd\+bwd +[\d.]+ ms +\S+/this +[\d.]+x", out), out


def test_mesh_groups_benchmark_checks_both_meshes_alike(capsys):
    """benchmarks/mesh_groups.py, in process: torch's mesh and ours give every dimension the
    same ranks (else it exits), and ours joins fewer groups where dimensions share ranks."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import mesh_groups

    assert mesh_groups.main(["--layout", "64:dp_shard=8,tp=8"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"64:dp_shard=8,tp=8 +(\d+) +(\d+) +[\d.]+", out)
    assert row and int(row.group(1)) > int(row.group(2)), out
