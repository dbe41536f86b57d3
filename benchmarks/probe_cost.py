"""What probing costs a training run: the same run with the probe off and with probe.every=N.

    python benchmarks/probe_cost.py [--steps 300] [--every 100] [--preset debug] [extra overrides]

Runs `python -m apps.llama.train` twice with the same config, logging every step: once with the
probe off (the baseline: no hooks at all) and once with probe.every=N. Prints
  - the mean step time of each run (steps after the first 10) and their ratio (probe / off);
  - the probe step's own cost: its step time over the median non-probe step of the same run,
    and the average overhead that implies at probe.every=N, ((probe step - median) / N) / median,
    which is what the ratio measures but without the noise of two separate runs.
The budget is at most 2% average overhead at probe.every=100.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(dump: Path, steps: int, extra: list) -> list:
    cmd = [sys.executable, "-m", "apps.llama.train", f"dump_dir={dump}", f"steps={steps}",
           "logging.every=1", "eval.every=0", "eval.at_end=false", "checkpoint.every=0",
           "checkpoint.save_final=false", *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("extra", nargs="*", help="Hydra overrides for both runs")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        off = run(Path(tmp) / "off", a.steps, a.extra)
        on = run(Path(tmp) / "on", a.steps, [f"probe.every={a.every}", *a.extra])
    skip = 10
    mean_off = statistics.mean(r["step_s"] for r in off[skip:])
    mean_on = statistics.mean(r["step_s"] for r in on[skip:])
    probe_steps = [r for r in on if r["step"] % a.every == 0]
    plain = statistics.median(r["step_s"] for r in on[skip:] if r["step"] % a.every)
    probe_step = statistics.mean(r["step_s"] for r in probe_steps)
    print(f"steps {a.steps}, probe.every={a.every}, "
          f"overrides: {' '.join(a.extra) or '(debug preset)'}")
    print(f"mean step, probe off:            {1000 * mean_off:8.1f} ms")
    print(f"mean step, probe.every={a.every:<4d}:      {1000 * mean_on:8.1f} ms")
    print(f"ratio (probe / off):             {mean_on / mean_off:8.4f}")
    print(f"probe step / median plain step:  {probe_step / plain:8.2f}  "
          f"({len(probe_steps)} probe steps: {1000 * probe_step:.0f} ms vs {1000 * plain:.0f} ms)")
    print(f"implied average overhead at every={a.every}: "
          f"{100 * (probe_step - plain) / a.every / plain:.2f}%")


if __name__ == "__main__":
    main()
