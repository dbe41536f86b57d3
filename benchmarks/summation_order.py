"""How far apart two correct runs land when only the order of floating-point sums differs: the
noise floor a layout test's tolerance must sit above, measured on this CPU and on the CPU kinds
emulated here.

    python benchmarks/summation_order.py --case float8_moe [--steps 8] [--out DIR]

A case is one of the layout tests (tests/test_float8_moe.py, tests/test_float8.py,
tests/test_moe_train.py): its one-process reference and its layouts, run as the test runs them
(the reference with 2 threads, as in-process in pytest; the layouts under torchrun, 1 thread a
rank) under each kernel setting below, every run a fresh process. What varies between the CPUs
CI runs on (an Intel Xeon with AMX, an AMD EPYC with AVX2 only, an AMD EPYC with avx512_bf16)
is which kernels ATen, MKL and oneDNN pick and how they block their sums; these variables pick
them here:
  native     this CPU's own choice
  threads1   the reference on 1 thread too
  avx2       ATen's AVX2 kernels, MKL and oneDNN limited to AVX2 (the AVX2-only EPYC)
  avx512     ATen's AVX512 kernels, MKL's AVX512 code path (the Xeon's)
  scalar     ATen's unvectorised kernels (libm's exp and log instead of SLEEF's), MKL's
             "compatible" path: no CI CPU runs this, it is a harder shake than any of them
Each layout is compared with the reference under the same setting, as a test on that CPU would
compare them, and each setting's reference with the native one (how far apart two CPUs' runs
land). The table prints, per group of keys, the largest relative difference over the steps and
the first step where one over 1e-7 shows. A float8 case also runs the reference without float8:
that row is float8's whole rounding error, the scale against which a few float8 values that
moved are measured. A test's tolerance for a key must sit above every layout row; a planted bug
(setup/mutants.sh) must land above the tolerance.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import free_port  # noqa: E402
from tests.equivalence import final_checkpoint, model_checksums, read_rows  # noqa: E402

# kernel setting: (the reference's environment, the layouts' environment)
ONE, TWO = {"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2"}
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX512 = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
          "MKL_CBWR": "AVX512"}
SCALAR = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
          "ONEDNN_MAX_CPU_ISA": "SSE41"}
KERNELS = {
    "native": (TWO, ONE),                  # as the tests run: in-process 2 threads, torchrun 1
    "threads1": (ONE, ONE),
    "avx2": ({**TWO, **AVX2}, {**ONE, **AVX2}),
    "avx512": ({**TWO, **AVX512}, {**ONE, **AVX512}),
    "scalar": ({**TWO, **SCALAR}, {**ONE, **SCALAR}),
}

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.multiple_of=32", "model.max_seq_len=128", "data.seq_len=64", "data.val_sequences=8",
        "optim.warmup=2", "optim.lr=3e-3", "logging.every=1", "eval.every=0",
        "checkpoint.every=0", "data.prepare_embedded=false"]
MOE = ["config=debug", "model.n_layers=4", "model.n_experts=4", "model.top_k=2",
       "model.n_shared_experts=1", "model.expert_hidden_dim=32", "model.n_dense_layers=1",
       "model.aux_loss_coef=0.01", "model.z_loss_coef=0.001", "model.bias_update_rate=0.001"]
MB4 = ["data.batch_size=4", "data.grad_accum=2"]
MB8 = ["data.batch_size=8"]
FSDP2 = ["distributed.dp_shard=2", "data.batch_size=4"]

# case: (app module, arguments, {layout: (ranks, arguments, the reference's own arguments)})
CASES = {
    "float8_moe": ("apps.moe.train", [*MOE, "distributed.float8=tensorwise",
                                      "model.aux_loss_coef=0"], {
        "fsdp2": (2, FSDP2, MB4),
        "ep2": (2, ["distributed.ep=2", *FSDP2], MB4),
        "pp2": (2, ["distributed.pp=2", "distributed.dp_shard=1", *MB8,
                    "distributed.pp_microbatches=2"], MB4),
        "tp2": (2, ["distributed.tp=2", "distributed.dp_shard=1", *MB4], MB4),
    }),
    "float8_llama": ("apps.llama.train", ["distributed.float8=tensorwise"], {
        "fsdp2": (2, FSDP2, MB4),
        "pp2": (2, ["distributed.pp=2", "distributed.dp_shard=1", *MB8], MB4),
        "tp2": (2, ["distributed.tp=2", "distributed.dp_shard=1", *MB8], MB8),
        "fsdp2_tp2": (4, ["distributed.tp=2", *FSDP2], MB4),
        "cp2": (2, ["distributed.cp=2", "distributed.dp_shard=1", *MB8], MB8),
    }),
    "moe": ("apps.moe.train", MOE, {
        "fsdp2": (2, FSDP2, MB8),
        "ep2": (2, ["distributed.ep=2", *FSDP2], MB8),
        "tp2": (2, ["distributed.tp=2", "distributed.dp_shard=1", *MB8], MB8),
        "pp2": (2, ["distributed.pp=2", "distributed.dp_shard=1", *MB8,
                    "distributed.pp_microbatches=2"], MB4),
    }),
}


def run(module: str, args: list, env_extra: dict, nproc: int, log: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    env.pop("WORLD_SIZE", None)
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", module, *args]
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)


def group(key: str) -> str:
    return "moe/*" + key.rsplit("/", 1)[-1] if key.startswith("moe/") else key


def differences(dump: Path, base: Path) -> dict:
    """{key group: (largest relative difference, first step with a difference over 1e-7)}."""
    out = {}
    for got, want in zip(read_rows(dump), read_rows(base)):
        for key, value in want.items():
            if not (key in ("loss", "grad_norm", "val_loss") or key.startswith("moe/")):
                continue
            d = abs(got[key] - value) / max(abs(value), 1e-30)
            worst, first = out.get(group(key), (0.0, None))
            out[group(key)] = (max(worst, d), first if first or d <= 1e-7 else got["step"])
    last = read_rows(base)[-1]["step"]
    mine = model_checksums(final_checkpoint(dump, last))
    theirs = model_checksums(final_checkpoint(base, last))
    worst = max(abs(mine[k][1] - v[1]) / abs(v[1]) for k, v in theirs.items())
    out["final sum of squares"] = (worst, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, default="float8_moe")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--corpus", default=None, help="a prepared corpus (default: made here)")
    opts = parser.parse_args()
    out = Path(opts.out or tempfile.mkdtemp(prefix="summation_order_"))
    corpus = Path(opts.corpus) if opts.corpus else out / "corpus"
    if not opts.corpus:
        from lingua.data import ensure_embedded_corpus
        ensure_embedded_corpus(str(corpus))
    module, args, layouts = CASES[opts.case]
    common = [f"data.root={corpus}", *TINY, f"steps={opts.steps}", *args]
    references = sorted({tuple(ref) for _, _, ref in layouts.values()})
    name_of = {ref: f"reference{i}" for i, ref in enumerate(references)}
    table = {}
    for kernel, (ref_env, layout_env) in KERNELS.items():
        for ref in references:
            dump = out / f"{name_of[ref]}_{kernel}"
            run(module, [f"dump_dir={dump}", *common, *ref], ref_env, 1, out / f"{dump.name}.log")
            if kernel != "native":
                table[f"{name_of[ref]}@{kernel} vs @native"] = differences(
                    dump, out / f"{name_of[ref]}_native")
        for layout, (nproc, extra, ref) in layouts.items():
            dump = out / f"{layout}_{kernel}"
            run(module, [f"dump_dir={dump}", *common, *extra], layout_env, nproc,
                out / f"{dump.name}.log")
            reference = out / f"{name_of[tuple(ref)]}_{kernel}"
            table[f"{layout}@{kernel}"] = differences(dump, reference)
    if "distributed.float8=tensorwise" in args:   # float8's own error: the same run without it
        for ref in references:
            dump = out / f"{name_of[ref]}_without_float8"
            run(module, [f"dump_dir={dump}", *[a for a in common if not a.startswith(
                "distributed.float8")], *ref], KERNELS["native"][0], 1, out / f"{dump.name}.log")
            table[f"{name_of[ref]} without float8"] = differences(
                dump, out / f"{name_of[ref]}_native")
    for ref, name in name_of.items():
        print(f"{name}: {' '.join(ref)}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    print(f"case {opts.case}, {opts.steps} steps; CPU {cpu}; "
          f"{'avx512_bf16' if 'avx512_bf16' in flags else 'no avx512_bf16'}, "
          f"{'amx' if 'amx_tile' in flags else 'no amx'}; "
          "each layout against its reference under the same kernels")
    keys = sorted({k for row in table.values() for k in row})
    print(f"{'run':<30}" + "".join(f"{k[:22]:>24}" for k in keys))
    for name, row in table.items():
        cells = []
        for k in keys:
            worst, first = row.get(k, (float("nan"), None))
            cells.append(f"{worst:.1e}" + (f" (s{first})" if first else ""))
        print(f"{name:<30}" + "".join(f"{c:>24}" for c in cells))
    (out / "table.json").write_text(json.dumps(table))
    print(f"runs and table.json in {out}")


if __name__ == "__main__":
    main()
