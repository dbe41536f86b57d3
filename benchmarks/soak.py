"""Soak: a long debug run, watched from /proc, to catch leaks that short tests cannot see.

    python benchmarks/soak.py [--steps 2000] [--every 100] [--keep 3] [--interval 2]
                              [--dump-dir DIR] [--keep-dump] [extra Hydra overrides]

Runs `python -m apps.llama.train` (the debug preset) with steps=N, checkpoint.every,
checkpoint.keep, logging.every=10 and eval.every=100 (the preset's: evaluation is a code path a
long run takes every few minutes, so it belongs in the soak; it costs 4 forward passes of 8
sequences per 100 steps) as a subprocess, and every --interval seconds reads from /proc the
resident memory (VmRSS), open file descriptors, threads and child processes of the training
process and its descendants, and from the dump_dir its disk use (sum of file sizes) and its
checkpoint directories. The step of a sample is the newest step in metrics.jsonl. Then it prints:
  - steps/s: over the whole run (start-up, evaluation and checkpoints included), sustained after
    the warm-up, and the step alone (median `step_s` of metrics.jsonl);
  - RSS: first/last/max and the least-squares slope in MiB per 1000 steps over the samples after
    the warm-up (--warmup steps, default 200: two checkpoints and two evaluations have run by
    then, so the allocator has seen every kind of step), with its standard error, and the same
    slope over the second half alone (growth that settles is not a leak; a leak keeps its slope);
  - fds, threads, processes: max and final, and whether their floor (the minimum over the first
    vs the last third of the samples after the warm-up) rose. The floor, not the maximum, because
    a save or an evaluation may hold a file or a thread for a moment; a leak raises the floor;
  - disk: max vs final, the checkpoint count (at most `keep`; a sample may see keep+1 between a
    save's rename and its pruning, and one `.tmp-*` directory while a save writes);
  - metrics.jsonl holds exactly one row per logged step, evaluation rows where expected, and the
    newest checkpoint is the final step;
  - a PASS/FAIL verdict per property. The exit code is 0 whatever the verdicts (a benchmark, not a
    test); it is 1 only when the training run itself failed, 130 when interrupted (Ctrl-C or TERM,
    which also stop the training run).

The memory threshold, 5 MiB per 1000 steps: the debug preset's smallest per-step tensors (one
activation or the logits of a batch, 8 x 256 x 256 fp32) are 2 MiB, so keeping one of them per
checkpoint or evaluation (every 100 steps) grows RSS by 20 MiB per 1000 steps and fails clearly,
and one per step fails by far; 5 MiB is several times the fit's standard error on this 2-core
machine (printed with the slope), so allocator noise does not fail it. A leak too small to see
here (a Python dict per logged row, ~0.1 MiB per 1000 steps) would cost under 100 MiB in a
million steps.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
STEP_DIR = re.compile(r"^\d+$")
MIB = 1024 * 1024


# --- /proc readings --------------------------------------------------------------------------

def _ppid_map() -> dict:
    """pid -> parent pid of every process we can read."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int) -> list:
    parents = _ppid_map()
    children = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _status(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def process_sample(pid: int) -> dict:
    """RSS (bytes), fds and threads summed over pid and its descendants, and how many those are."""
    rss = fds = threads = 0
    kids = descendants(pid)
    for p in [pid, *kids]:
        try:
            st = _status(p)
            rss += int(st.get("VmRSS", "0 kB").split()[0]) * 1024  # absent for a zombie
            threads += int(st.get("Threads", "0"))
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except (OSError, ValueError):
            continue  # exited between the listing and the read
    return {"rss": rss, "fds": fds, "threads": threads, "children": len(kids)}


def disk_sample(dump: Path) -> dict:
    total = 0
    for root, _dirs, files in os.walk(dump):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # pruned while we walked
    ckpts = dump / "checkpoints"
    names = os.listdir(ckpts) if ckpts.is_dir() else []
    return {"disk": total, "ckpts": sum(1 for n in names if STEP_DIR.match(n)),
            "tmp": sum(1 for n in names if ".tmp" in n)}


def newest_logged_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError):
            continue  # a line being written
    return 0


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --- statistics ------------------------------------------------------------------------------

def fit(xs: list, ys: list) -> tuple:
    """Least-squares slope of ys over xs and its standard error."""
    n = len(xs)
    if n < 3:
        return float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan"), float("nan")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, (resid / (n - 2) / sxx) ** 0.5


def thirds(values: list) -> tuple:
    k = max(1, len(values) // 3)
    return values[:k], values[-k:]


def verdict(name: str, ok: bool, detail: str) -> bool:
    print(f"verdict {name:<26s} {'PASS' if ok else 'FAIL'}  {detail}")
    return ok


# --- the run ---------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100, help="checkpoint.every")
    p.add_argument("--keep", type=int, default=3, help="checkpoint.keep")
    p.add_argument("--log-every", type=int, default=10, help="logging.every")
    p.add_argument("--eval-every", type=int, default=100, help="eval.every (0: only at the end)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--warmup", type=int, default=200, help="steps before the fits start")
    p.add_argument("--rss-threshold", type=float, default=5.0, help="MiB per 1000 steps")
    p.add_argument("--dump-dir", help="run directory (must not hold a run); default: a temp dir")
    p.add_argument("--keep-dump", action="store_true", help="do not delete the run directory")
    p.add_argument("extra", nargs="*", help="Hydra overrides passed to the training run")
    a = p.parse_intermixed_args()

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    dump = Path(a.dump_dir).resolve() if a.dump_dir else work / "dump"
    if dump.exists() and any(dump.iterdir()):
        sys.exit(f"error: --dump-dir {dump} is not empty; the run would resume from it. "
                 f"Give a new directory.")
    log_path = work / "train.log"  # outside dump_dir, so it is not counted as the run's disk use
    overrides = [f"dump_dir={dump}", f"steps={a.steps}", f"checkpoint.every={a.every}",
                 f"checkpoint.keep={a.keep}", f"logging.every={a.log_every}",
                 f"eval.every={a.eval_every}", *a.extra]
    cmd = [sys.executable, "-m", "apps.llama.train", *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    print("command: " + " ".join(cmd[1:]), flush=True)

    samples = []
    # A TERM (a scheduler, a cleanup) stops the training run too and says so, like Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                s = {"t": time.monotonic() - t0, "step": newest_logged_step(dump / "metrics.jsonl"),
                     **process_sample(proc.pid), **disk_sample(dump)}
                if proc.poll() is None and s["rss"] > 0:
                    samples.append(s)
                time.sleep(a.interval)
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)  # the trainer saves a checkpoint and stops
            proc.wait()
            print(f"interrupted after {time.monotonic() - t0:.0f} s at step "
                  f"{newest_logged_step(dump / 'metrics.jsonl')}; training log {log_path}, run "
                  f"directory {dump} (kept)", flush=True)
            return 130
    wall = time.monotonic() - t0
    rc = proc.returncode
    if rc != 0:
        print(f"FAIL: the training run exited with {rc}; last lines of {log_path}:")
        print("\n".join(log_path.read_text().splitlines()[-40:]))
        return 1

    try:
        report(a, dump, samples, wall)
    finally:
        if a.keep_dump:
            print(f"kept: run directory {dump}, training log {log_path}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            if a.dump_dir:
                shutil.rmtree(dump, ignore_errors=True)
    return 0


def report(a, dump: Path, samples: list, wall: float) -> None:
    cfg = yaml.safe_load((dump / "config.yaml").read_text())
    steps, keep = cfg["steps"], cfg["checkpoint"]["keep"]
    log_every, eval_cfg = cfg["logging"]["every"], cfg["eval"]
    rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines() if x.strip()]
    final_disk = disk_sample(dump)
    after = [s for s in samples if s["step"] >= a.warmup]
    extra = " ".join(a.extra) or "(none)"
    print(f"steps {steps}, checkpoint.every={cfg['checkpoint']['every']} keep={keep}, "
          f"logging.every={log_every}, eval.every={eval_cfg['every']}, extra overrides: {extra}")
    print(f"samples: {len(samples)} every {a.interval:g} s, {len(after)} after the warm-up "
          f"(step >= {a.warmup})")

    # Speed.
    step_s = statistics.median(r["step_s"] for r in rows)
    line = f"steps/s: {steps / wall:.2f} over the whole run ({wall:.0f} s, start-up included)"
    if len(after) >= 2 and after[-1]["t"] > after[0]["t"]:
        sustained = (after[-1]["step"] - after[0]["step"]) / (after[-1]["t"] - after[0]["t"])
        line += f", {sustained:.2f} sustained after the warm-up"
    print(line + f", {1 / step_s:.2f} for the step alone (median step_s {1000 * step_s:.0f} ms)")

    ok = True
    if len(after) < 6:
        print(f"FAIL: only {len(after)} samples after the warm-up; run more steps or sample "
              f"more often (--interval) to judge memory, fds and threads.")
        ok = False
    else:
        ok &= report_memory(a, samples, after)
        ok &= report_counts(after, samples)
    ok &= report_disk(dump, samples, final_disk, keep)
    ok &= report_metrics(rows, steps, log_every, eval_cfg, dump)
    print("overall: " + ("PASS" if ok else "FAIL (see the verdict lines above)"))


def report_memory(a, samples: list, after: list) -> bool:
    rss = [s["rss"] / MIB for s in after]
    xs = [s["step"] for s in after]
    slope, err = fit(xs, rss)
    half = after[len(after) // 2:]
    slope2, err2 = fit([s["step"] for s in half], [s["rss"] / MIB for s in half])
    peak = max(samples, key=lambda s: s["rss"])
    print(f"RSS (MiB): first {samples[0]['rss'] / MIB:.0f} (step {samples[0]['step']}), at the "
          f"warm-up {rss[0]:.0f}, last {rss[-1]:.0f} (step {xs[-1]}), max {peak['rss'] / MIB:.0f} "
          f"(step {peak['step']})")
    print(f"RSS slope after the warm-up: {1000 * slope:+.2f} +- {1000 * err:.2f} MiB per 1000 "
          f"steps; second half alone: {1000 * slope2:+.2f} +- {1000 * err2:.2f}")
    return verdict("memory flat", abs(1000 * slope) < a.rss_threshold,
                   f"|{1000 * slope:+.2f}| MiB per 1000 steps vs threshold {a.rss_threshold:g}")


def report_counts(after: list, samples: list) -> bool:
    ok = True
    for key, name in (("fds", "open fds"), ("threads", "threads"), ("children", "child processes")):
        values = [s[key] for s in after]
        first, last = thirds(values)
        grew = min(last) > min(first)
        print(f"{name}: first {samples[0][key]}, max {max(s[key] for s in samples)}, final "
              f"{samples[-1][key]}; after the warm-up floor {min(first)} (first third) -> "
              f"{min(last)} (last third), ceiling {max(first)} -> {max(last)}")
        ok &= verdict(f"no {name} growth", not grew,
                      f"floor {min(first)} -> {min(last)}" + (" (rising: a leak?)" if grew else ""))
    return ok


def report_disk(dump: Path, samples: list, final: dict, keep: int) -> bool:
    ckpts = sorted((p for p in (dump / "checkpoints").iterdir() if STEP_DIR.match(p.name)),
                   key=lambda p: int(p.name))
    ckpt_size = dir_size(ckpts[-1]) if ckpts else 0
    other = final["disk"] - sum(dir_size(c) for c in ckpts)
    max_disk = max([s["disk"] for s in samples] + [final["disk"]])
    max_ckpts = max([s["ckpts"] for s in samples] + [final["ckpts"]])
    max_tmp = max([s["tmp"] for s in samples] + [final["tmp"]])
    # Worst moment: `keep` checkpoints plus one being written (or renamed and not yet pruned).
    bound = (keep + 1) * ckpt_size + other if keep else float("inf")
    print(f"disk (MiB): max {max_disk / MIB:.1f}, final {final['disk'] / MIB:.1f} "
          f"(one checkpoint {ckpt_size / MIB:.1f}, other files {other / MIB:.2f}); bound "
          f"(keep + 1) x checkpoint + other files = {bound / MIB:.1f}")
    print(f"checkpoints: final {final['ckpts']} ({', '.join(c.name for c in ckpts)}), max seen "
          f"{max_ckpts}, max .tmp seen {max_tmp}, .tmp at the end {final['tmp']}")
    ok = (not keep or (final["ckpts"] <= keep and max_ckpts <= keep + 1
                       and max_disk <= bound * 1.01 + MIB)) and final["tmp"] == 0 and max_tmp <= 1
    return verdict("disk bounded", ok, f"final {final['ckpts']} <= keep {keep}, max seen "
                   f"{max_ckpts} <= keep + 1, max {max_disk / MIB:.1f} <= bound "
                   f"{bound / MIB:.1f} MiB, no .tmp left")


def report_metrics(rows: list, steps: int, log_every: int, eval_cfg: dict, dump: Path) -> bool:
    logged = [r["step"] for r in rows]
    expected = sorted(set(range(log_every, steps + 1, log_every)) | {steps})
    evals = [r["step"] for r in rows if "val_loss" in r]
    expected_evals = [s for s in expected if (eval_cfg["every"] and s % eval_cfg["every"] == 0)
                      or (s == steps and eval_cfg["at_end"])]
    ok = verdict("metrics.jsonl rows", logged == expected and evals == expected_evals,
                 f"{len(logged)} rows for {len(expected)} logged steps"
                 + ("" if logged == expected
                    else f" (unexpected: {sorted(set(logged) ^ set(expected))[:10]},"
                    f" duplicates: {len(logged) - len(set(logged))})")
                 + f", {len(evals)} with val_loss (expected {len(expected_evals)})")
    complete = [p for p in (dump / "checkpoints").iterdir()
                if STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    newest = max((int(p.name) for p in complete), default=None)
    return ok & verdict("final checkpoint", newest == steps,
                        f"newest complete checkpoint is step {newest}, the run's last is {steps}")


if __name__ == "__main__":
    sys.exit(main())
