"""The GPU tier in one command, on the lent GPU machine (which reaches no package index):

    bash setup/gpu_check.sh [--budget 530]

1. installs into the image's own Python, from .whl/ (made here by `bash setup/gpu_wheels.sh`),
   only the distributions it lacks, with --no-deps, so nothing of the image is replaced (not
   with --target plus PYTHONPATH: the tests start subprocesses whose PYTHONPATH drops it);
2. runs every `gpu` test (those that need two GPUs or more skip on one);
3. runs the runbook's benchmarks (benchmarks/gpu_vs_hf.py): the 8B-wide shape in bf16 and in
   float8 tensorwise and rowwise, the 1B, MoE, DeepSeek and Qwen3-Next shapes (the last with
   flash-linear-attention's kernel, fla-core from .whl/), each against Hugging Face compiled;
   then
   the MoE trainer of 02984d0 (the last commit before the sync removal, carried as a tarball)
   with the same harness, to set beside today's MoE figure;
4. writes one JSON summary: $OUT/gpu_check.json where $OUT is set (the device tool brings it
   back), else gpu_check.json here; beside it the full log and each step's own results.

Each step gets what is left of --budget (seconds for the whole check, under the device tool's
10-minute command), and one that would not fit is skipped and named in the summary, so a slow
machine still returns the figures it got.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".whl"
BEFORE = "02984d0"   # the last commit before the MoE sync removal (issue 32)


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()   # PEP 503


def wheel_name(path: Path) -> tuple:
    """(normalised distribution name, version) from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return normalised(name), version


def missing_wheels(folder: Path, installed: dict) -> tuple:
    """The wheels in `folder` whose distribution is not installed, and the installed ones kept
    (name -> (installed version, carried version))."""
    install, kept = [], {}
    for wheel in sorted(folder.glob("*.whl")):
        name, version = wheel_name(wheel)
        if name in installed:
            kept[name] = (installed[name], version)
        else:
            install.append(wheel)
    return install, kept


def installed_distributions() -> dict:
    return {normalised(d.metadata["Name"]): d.version
            for d in metadata.distributions() if d.metadata["Name"]}


class Check:
    def __init__(self, budget: float, out: Path):
        self.deadline = time.monotonic() + budget
        self.out = out
        self.log = open(out / "gpu_check.log", "a")
        self.summary = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": budget,
                        "steps": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, step: str, cmd: list, cap: float, need: float, cwd: Path = REPO) -> dict:
        """Run cmd for at most min(cap, what is left); skip it when less than `need` is left."""
        left = self.left()
        record = {"command": " ".join(map(str, cmd))}
        if left < need:
            record.update(skipped=f"{left:.0f} s left of the budget, {need:.0f} s needed")
            print(f">> {step}: skipped ({record['skipped']})", flush=True)
        else:
            timeout = min(cap, left)
            print(f">> {step} (at most {timeout:.0f} s): {record['command']}", flush=True)
            self.log.write(f"\n>> {step}: {record['command']}\n")
            self.log.flush()
            start = time.monotonic()
            env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            sys.path.insert(0, str(REPO / "benchmarks"))
            from gpu_vs_hf import Killer  # kills the process group, even one printing nothing

            killer = Killer(proc, timeout)
            for line in proc.stdout:   # to the log, and to the console
                self.log.write(line)
                sys.stdout.write(line)
            killer.cancel()
            record["rc"] = "timeout" if killer.fired else proc.wait()
            record["seconds"] = round(time.monotonic() - start, 1)
            self.log.flush()
        self.summary["steps"][step] = record
        self.write()
        return record

    def write(self) -> None:
        self.summary["seconds_left"] = round(self.left(), 1)
        path = self.out / "gpu_check.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.summary, indent=1) + "\n")
        os.replace(path.with_suffix(".tmp"), path)


def install(check: Check) -> None:
    wheels, kept = missing_wheels(WHEELS, installed_distributions())
    record = {"installed": [w.name for w in wheels],
              "image_has": {n: v[0] for n, v in kept.items()}}
    if wheels:
        check.run("install", [sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                              "--no-deps", "--no-compile", "--no-cache-dir", *wheels],
                  cap=120, need=0)
    check.summary["steps"].setdefault("install", {}).update(record)
    check.write()


def test_results(xml_path: Path) -> dict:
    """Per test: outcome, seconds and the failure's first line, from pytest's JUnit XML."""
    if not xml_path.exists():
        return {}
    tests = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or "").splitlines()[0][:300] if \
                    node.get("message") else ""
        tests[f"{case.get('classname')}::{case.get('name')}"] = {
            "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message}
    return tests


def bench_figures(path: Path) -> dict:
    """tokens/s, MFU and peak memory per shape and side, and the ratios, of a gpu_vs_hf run."""
    if not path.exists():
        return {}
    results = json.loads(path.read_text())
    return {"env": results.get("env"), "complete": results.get("complete"),
            "shapes": {name: {"ratios": shape.get("ratios", {}),
                              "sides": {side: {k: s.get(k) for k in (
                                  "tokens_per_s", "mfu_datasheet", "mfu_measured",
                                  "peak_mem_gib", "rounds_ok")}
                                  for side, s in shape["sides"].items()}}
                       for name, shape in results.get("shapes", {}).items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=530.0,
                        help="seconds for the whole check (default 530: under 9 minutes)")
    parser.add_argument("--tests", default="tests/", help="what pytest -m gpu runs")
    cli = parser.parse_args()
    out = Path(os.environ.get("OUT") or REPO).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check(cli.budget, out)
    if not WHEELS.is_dir():
        print(f"note: no {WHEELS} (bash setup/gpu_wheels.sh makes it where pip reaches an "
              f"index): nothing to install", flush=True)
    else:
        install(check)
    try:
        import torch

        check.summary["gpu"] = (torch.cuda.get_device_name() if torch.cuda.is_available()
                                else None)
        check.summary["torch"] = torch.__version__
    except ImportError:
        check.summary["gpu"] = None
    if not check.summary["gpu"]:
        check.summary["error"] = "no CUDA device visible: the GPU tier needs one"
        check.write()
        print(f"error: {check.summary['error']}", file=sys.stderr)
        return 1

    python = sys.executable
    check.run("gpu_tests", [python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                            "--junitxml", out / "gpu_tests.xml", cli.tests],
              cap=300, need=60)
    check.summary["steps"]["gpu_tests"]["tests"] = test_results(out / "gpu_tests.xml")
    check.write()

    bench = [python, "benchmarks/gpu_vs_hf.py", "--rounds", "1", "--warmup", "10",
             "--steps", "10", "--hf", "compiled"]
    before_s = 75.0   # the step below: the environment probe and one MoE side
    check.run("bench_vs_hf", [*bench, "--shapes", "8B-wide,1B,moe,deepseek,qwen3-next",
                              "--float8", "tensorwise,rowwise", "--float8-shapes", "8B-wide",
                              "--out", out / "gpu_vs_hf.json",
                              "--time-limit", f"{max(check.left() - before_s - 10, 60):.0f}"],
              cap=check.left() - before_s, need=120)
    check.summary["steps"]["bench_vs_hf"]["figures"] = bench_figures(out / "gpu_vs_hf.json")
    check.write()

    tarball = WHEELS / f"lingua-{BEFORE}.tar.gz"
    if tarball.exists():
        tree = Path("/tmp") / f"lingua-{BEFORE}"
        if not tree.exists():
            with tarfile.open(tarball) as tar:
                tar.extractall(tree, filter="data")
        check.run("moe_before_sync_removal",
                  [*bench, "--hf", "none", "--shapes", "moe", "--trainer", tree,
                   "--out", out / "gpu_vs_hf_before.json",
                   "--time-limit", f"{max(check.left() - 5, 30):.0f}"],
                  cap=check.left(), need=before_s)
        before = bench_figures(out / "gpu_vs_hf_before.json")
        after = check.summary["steps"]["bench_vs_hf"].get("figures", {})
        tps = [f.get("shapes", {}).get("moe", {}).get("sides", {}).get("ours", {})
               .get("tokens_per_s") for f in (before, after)]
        check.summary["steps"]["moe_before_sync_removal"].update(
            figures=before, moe_tokens_per_s={BEFORE: tps[0], "now": tps[1]},
            now_over_before=tps[1] / tps[0] if all(tps) else None)
    else:
        check.summary["steps"]["moe_before_sync_removal"] = {
            "skipped": f"no {tarball.name} in .whl/ (bash setup/gpu_wheels.sh makes it)"}
    check.write()

    failed = [s for s, r in check.summary["steps"].items() if r.get("rc") not in (0, None)]
    skipped = [s for s, r in check.summary["steps"].items() if "skipped" in r]
    print(f"\ngpu check: {len(check.summary['steps'])} steps, failed {failed or 'none'}, "
          f"skipped {skipped or 'none'}; summary {out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
