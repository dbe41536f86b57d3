"""Download, into .whl/, every wheel the lent GPU machine's image lacks for the GPU tier
(`bash setup/gpu_check.sh` installs them there): that machine reaches no package index.

    bash setup/gpu_wheels.sh            # here, where the package index is reachable

The image (../shared/DESIGN.md, "Facts checked on the lent GPU machine") has Python 3.12, torch
2.11.0+cu130, transformers 5.17.0 and much else (IMAGE_HAS); it lacks hydra-core, omegaconf,
antlr4-python3-runtime, submitit, lm-eval with datasets (lm-eval's task manager imports it),
torchao and fla-core (flash-linear-attention's kernels). pip's resolver, asked for the GPU tier's
needs at this project's pins for CPython 3.12 on manylinux x86_64 (the image's torch and
transformers as constraints, so that it picks what works beside them), names their whole
closure; every wheel of it the image lacks is downloaded, the source-only ones
(antlr4-python3-runtime 4.9.3, sqlitedict, word2number) built here. Beside them goes a tarball
of 02984d0's tree, whose MoE trainer gpu_check.py measures beside today's (the GPU machine gets
no .git). The device tool sends the folder when a run names it in `carry`.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / ".whl"
PYTHON, PLATFORMS = "3.12", ("manylinux_2_28_x86_64", "manylinux2014_x86_64",
                             "manylinux_2_17_x86_64")
# The GPU tier's own needs, at the project's pins (pyproject.toml)
WANTED = ["hydra-core==1.3.8", "omegaconf>=2.3,<2.4", "submitit==1.5.4", "lm-eval==0.4.13",
          "datasets==5.2.0", "torchao==0.18.0", "peft==0.21.2", "accelerate==1.15.0",
          # flash-linear-attention's kernels (apps/qwen3_next's model.linear_kernel=fla): pure
          # Python and Triton, needing only einops beside the image's torch and triton
          "fla-core==0.6.0"]
# The image's torch and transformers: the resolver picks what works beside them. torch stands in
# as a stub wheel of the image's version with no dependencies (its CUDA libraries are the image's).
IMAGE = {"torch==2.11.0+image", "transformers==5.17.0"}
# What else the image holds (the device library's KINDS.md, read 2026-11-17): never carried, since
# gpu_check.py installs only what is missing (pyarrow and scipy alone would pass the 64 MiB the
# device tool sends).
IMAGE_HAS = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc
anyio attrs certifi charset-normalizer click cloudpickle colorama contourpy cycler einops filelock
fonttools frozenlist fsspec h11 hf-xet httpcore httpx huggingface-hub idna iniconfig jinja2 joblib
kiwisolver lxml markdown-it-py markupsafe matplotlib mdurl mpmath multidict narwhals networkx
numpy packaging pandas peft pillow pip pluggy portalocker propcache protobuf psutil pyarrow
pygments pyparsing pytest pytest-xdist python-dateutil pyyaml regex requests rich sacrebleu
safetensors scikit-learn scipy sentencepiece setuptools shellingham six sympy tabulate
threadpoolctl tiktoken tokenizers torch tqdm transformers triton typer typing-extensions urllib3
xxhash yarl zipp""".split())
SKIP = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.3"]
BEFORE = "02984d0"   # setup/gpu_check.py measures this commit's MoE trainer beside today's


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          check=check, capture_output=not check, text=True)


def platform_args() -> list:
    args = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def stub_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel of `name` at `version` that holds nothing and needs nothing: what the resolver
    sees of a package the image has."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\n"
                                        f"Version: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: lingua\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def closure() -> list:
    """name==version of every distribution the resolver picks for WANTED on the image's Python.
    A dependency published as source only (sqlitedict, word2number, rouge-score, ... all pure
    Python) gets its wheel built here, and the resolver asked again."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp, "constraints.txt")
        constraints.write_text("\n".join(sorted(IMAGE)) + "\n")
        report = Path(tmp, "report.json")
        stub_wheel(Path(tmp), "torch", "2.11.0+image")
        for _ in range(20):
            proc = pip("install", "--dry-run", "--quiet", "--ignore-installed", "--report",
                       str(report), "--target", str(Path(tmp, "target")), *platform_args(),
                       "-c", str(constraints), "--find-links", str(OUT), "--find-links", tmp,
                       *WANTED, check=False)
            if proc.returncode == 0:
                break
            missing = re.search(r"No matching distribution found for ([\w.-]+)", proc.stderr)
            if not missing or missing.group(1) in ("torch", "transformers"):
                sys.exit(f"pip could not resolve the GPU tier's wheels:\n{proc.stderr[-3000:]}")
            print(f"{missing.group(1)} is published as source only: building its wheel")
            pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(OUT), missing.group(1))
        else:
            sys.exit("pip could not resolve the GPU tier's wheels after 20 tries")
        picked = json.loads(report.read_text())["install"]
    return sorted(f"{p['metadata']['name'].lower().replace('_', '-')}=="
                  f"{p['metadata']['version']}" for p in picked)


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for requirement in SOURCE_ONLY:
        name = requirement.split("==")[0].replace("-", "_")
        if not list(OUT.glob(f"{name}-*.whl")):
            pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(OUT), requirement)
    wheels = [r for r in closure()
              if not SKIP.match(r.split("==")[0]) and r.split("==")[0] not in IMAGE_HAS]
    for stale in OUT.glob("*.whl"):   # what an earlier, wider download left
        name = re.sub(r"[-_.]+", "-", stale.name.split("-")[0]).lower()
        if name in IMAGE_HAS or SKIP.match(name):
            stale.unlink()
    before = OUT / f"lingua-{BEFORE}.tar.gz"   # the MoE trainer before the sync removal
    if not before.exists():
        with open(before, "wb") as tarball:
            subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar.gz", BEFORE],
                           stdout=tarball, check=True)
    for requirement in wheels:
        name = requirement.split("==")[0].replace("-", "_")
        version = requirement.split("==")[1]
        if any(OUT.glob(f"{name}-{version}-*.whl")) or \
                any(p.name.lower().startswith(f"{name.lower()}-{version}-")
                    for p in OUT.glob("*.whl")):
            continue
        pip("download", "--quiet", "--no-deps", "--dest", str(OUT), *platform_args(),
            requirement)
    size = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"{len(list(OUT.glob('*.whl')))} wheels in {OUT} ({size / 2**20:.0f} MiB) for CPython "
          f"{PYTHON} beside the image's {', '.join(sorted(IMAGE))}; on the GPU machine: "
          f"bash setup/gpu_check.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
