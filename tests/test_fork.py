"""docs/forking.md, "Forking an app", applied literally: its shell block and its diff
(HunYuan-Dense's QK-norm after RoPE) run on a copy of the repository. The fork must change nothing
outside apps/myarch/ and configs/myarch/, train with `python -m apps.myarch.train`, match one
process under tp, fsdp x tp and pp (through tests/equivalence.py), and export its new weights to
Hugging Face as HunYuanDenseV1ForCausalLM. Without the recipe's key_map hunk in hf.py, the export
must refuse and name the weight."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, tiny_args
from tests.equivalence import assert_equivalent, final_checkpoint, model_checksums, read_rows

STEPS = 4
FORK_DIRS = ("apps/myarch/", "configs/myarch/")
NEW_WEIGHTS = ("layers.0.attention.q_post_norm.weight", "layers.0.attention.k_post_norm.weight")
# Their Hugging Face names (transformers' HunYuanDenseV1Attention).
HF_NAMES = ("model.layers.0.self_attn.query_layernorm.weight",
            "model.layers.0.self_attn.key_layernorm.weight")


def fork_recipe() -> tuple:
    """(shell block, diff) of docs/forking.md, the page "Forking an app": its first ```bash and
    first ```diff fence, before the page's next section."""
    page = REPO / "docs" / "forking.md"
    assert page.is_file(), "docs/forking.md, the fork recipe this test applies, is missing"
    text = page.read_text()
    assert text.startswith("# Forking an app\n"), "docs/forking.md must start '# Forking an app'"
    recipe = text.split("\n## ", 1)[0]      # the steps, before "A bigger fork" and the rest
    shell = re.search(r"^```bash\n(.*?)^```", recipe, re.S | re.M)
    diff = re.search(r"^```diff\n(.*?)^```", recipe, re.S | re.M)
    assert shell and diff, "docs/forking.md needs a ```bash block and a ```diff block"
    return shell.group(1), diff.group(1)


def diff_without(diff: str, path: str) -> str:
    """The diff less its hunks for `path` (files start at their '--- a/...' line)."""
    files = re.split(r"(?m)^(?=--- )", diff)
    kept = [f for f in files if not f.startswith(f"--- a/{path}")]
    assert len(kept) == len(files) - 1, f"the recipe's diff has no part for {path}"
    return "".join(kept)


def diff_without_hunk(diff: str, path: str, text: str) -> str:
    """The diff less the one hunk of `path` that contains `text`."""
    part = diff_part(diff, path)
    hunks = re.split(r"(?m)^(?=@@ )", part)
    kept = [h for h in hunks if text not in h]
    assert len(kept) == len(hunks) - 1, f"the recipe's {path} part has no one hunk with {text}"
    return diff.replace(part, "".join(kept))


def copy_repo(dest: Path) -> Path:
    """The repository's files as git sees them (tracked and untracked, not ignored: no .venv,
    .git, runs/, data/ or caches), as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file() and "__pycache__" not in src.parts:   # not deleted in the working tree
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def apply_patch(root: Path, diff: str) -> None:
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch"]
    else:
        cmd = ["git", "apply", "-p1", "-"]
    proc = subprocess.run(cmd, cwd=root, input=diff, capture_output=True, text=True)
    assert proc.returncode == 0, (f"the recipe's diff does not apply to the tree its shell block "
                                  f"made ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")


def apply_recipe(root: Path, diff: str) -> Path:
    """Run the recipe's shell block from `root`, then apply `diff` there."""
    shell, _ = fork_recipe()
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", shell], cwd=root,
                          capture_output=True, text=True)
    assert proc.returncode == 0, (f"the recipe's shell block failed:\n{shell}\n"
                                  f"{proc.stdout}{proc.stderr}")
    apply_patch(root, diff)
    return root


def env_for(root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("WORLD_SIZE", None)
    return env


def run_in(root: Path, args: list, nproc: int = 1, module: str = "apps.myarch.train",
           check: bool = True) -> subprocess.CompletedProcess:
    """`python -m module args` (nproc 1) or torchrun of it, in the fork's copy of the repo."""
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", module, *args]
    proc = subprocess.run(cmd, cwd=root, env=env_for(root), capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, (f"{' '.join(cmd[2:5])} failed ({proc.returncode}):\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    """(copy of the repo with the recipe's recipe applied, file hashes before, after)."""
    root = copy_repo(tmp_path_factory.mktemp("fork"))
    before = hashes(root)
    apply_recipe(root, fork_recipe()[1])
    return root, before, hashes(root)


@pytest.fixture(scope="module")
def reference(fork, corpus, tmp_path_factory):
    """The fork trained by one process, global batch 8."""
    dump = tmp_path_factory.mktemp("fork_reference") / "run"
    run_in(fork[0], tiny_args(corpus, dump, "data.batch_size=8", steps=STEPS))
    return dump


def test_recipe_diff_matches_lingua_models_llama_line_for_line(tmp_path):
    """Each hunk applies at the line its header names: patch/git apply would still apply a diff
    whose numbers went stale (an offset), but a reader following them by hand would not."""
    shutil.copytree(REPO / "lingua" / "models" / "llama", tmp_path / "apps" / "myarch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    diff = fork_recipe()[1]
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--dry-run", "--batch", "--fuzz=0"]
    else:
        cmd = ["git", "apply", "--check", "-v", "-p1", "-"]
    proc = subprocess.run(cmd, cwd=tmp_path, input=diff, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the recipe's diff does not apply to lingua/models/llama:\n{out}"
    assert "offset" not in out and "fuzz" not in out, (f"docs/forking.md's diff line numbers are "
                                                       f"stale:\n{out}")


def test_recipe_changes_only_the_fork(fork):
    root, before, after = fork
    changed = sorted(p for p in before if after.get(p) != before[p])
    added = sorted(set(after) - set(before))
    outside = [p for p in changed + added if not p.startswith(FORK_DIRS)]
    assert not outside, f"the recipe's recipe changed or made files outside {FORK_DIRS}: {outside}"
    made = {"apps/myarch/model.py", "apps/myarch/parallelize.py", "apps/myarch/train.py"}
    assert made <= set(added)
    for path in (root / "apps" / "myarch").glob("*.py"):
        for old in ("apps.llama", "lingua.models.llama"):
            assert old not in path.read_text(), f"{path.name} still refers to {old}"
    assert "self.q_post_norm = RMSNorm" in (root / "apps/myarch/model.py").read_text()


@pytest.mark.slow
def test_fork_trains_its_new_weights(fork, reference):
    rows = read_rows(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, [r["loss"] for r in rows]
    sums = model_checksums(final_checkpoint(reference, STEPS))
    head_dim = 64 // 4   # tiny_args: model.dim=64, model.n_heads=4
    for name in NEW_WEIGHTS:
        assert name in sums, f"the fork's checkpoint has no {name}: {sorted(sums)[:8]}..."
        # RMSNorm weights start at 1: a moved sum means the new weights were trained.
        assert abs(sums[name][0] - head_dim) > 1e-4, f"{name} did not change from its init"


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
    (4, ["distributed.tp=2", "distributed.dp_shard=2", "data.batch_size=4"]),
    (2, ["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=8",
         "distributed.pp_microbatches=4"]),
], ids=["tp2", "fsdp2_tp2", "pp2"])
def test_fork_layouts_match_one_process(fork, reference, corpus, tmp_path, nproc, layout):
    dump = tmp_path / "run"
    run_in(fork[0], tiny_args(corpus, dump, *layout, steps=STEPS), nproc=nproc)
    assert_equivalent(dump, reference)


def diff_part(diff: str, path: str) -> str:
    return next(f for f in re.split(r"(?m)^(?=--- )", diff) if f.startswith(f"--- a/{path}"))


@pytest.mark.distributed
def test_tp_without_the_plan_hunk_is_refused_naming_its_lines(corpus, tmp_path):
    """lingua/parallel/coverage.py asks, at start, for exactly the lines the recipe's parallelize.py
    hunk adds."""
    diff = fork_recipe()[1]
    hunk = diff_part(diff, "apps/myarch/parallelize.py").splitlines()
    added = [line[1:].strip().rstrip(",") for line in hunk
             if line.startswith("+") and not line.startswith("+++")
             and not line[1:].strip().startswith("#")]
    assert len(added) == 2, added
    root = apply_recipe(copy_repo(tmp_path / "fork"),
                        diff_without(diff, "apps/myarch/parallelize.py"))
    proc = run_in(root, tiny_args(corpus, tmp_path / "run", "distributed.tp=2",
                                  "distributed.dp_shard=1", steps=1), nproc=2, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "layers.0.attention.q_post_norm.weight (not reduced over tp=2)" in log, log[-3000:]
    for line in added:
        assert line in log, f"the refusal does not name {line}:\n{log[-3000:]}"
    assert not (tmp_path / "run" / "checkpoints").exists()


def safetensors_names(path: Path) -> set:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


# transformers (a pinned dependency) reads the export as HunYuan-Dense (Llama + QK-norm after
# RoPE), and the fork reads it back with its own load_hf: their logits, at the trained eps and at
# one far from RMSNorm's default. The first catches the norms placed before RoPE (about 1e-3 off
# after the reference's 4 steps); the second q/k norms that ignore model.norm_eps, as HunYuan's
# take rms_norm_eps (a large eps shrinks the first difference, hence both).
HUNYUAN_CHECK = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from apps.myarch.hf import load_hf
path = Path(sys.argv[1])
config = json.loads((path / "config.json").read_text())
tokens = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))
for eps in (config["rms_norm_eps"], 0.5):
    (path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": eps}))
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours, _ = load_hf(path)
    with torch.no_grad():
        diff = (theirs(tokens).logits - ours.eval()(tokens)).abs().max().item()
    print(type(theirs).__name__, eps, diff)
"""


@pytest.mark.slow
def test_export_maps_the_new_weights(fork, reference, tmp_path):
    out = tmp_path / "hf"
    proc = run_in(fork[0], ["export", str(final_checkpoint(reference, STEPS)), str(out)],
                  module="apps.myarch.hf")
    assert "wrote HunYuanDenseV1ForCausalLM from" in proc.stdout, proc.stdout
    names = safetensors_names(out / "model.safetensors")
    for theirs in HF_NAMES:
        assert theirs in names, f"the export lacks {theirs}: {sorted(names)}"
    assert json.loads((out / "config.json").read_text())["model_type"] == "hunyuan_v1_dense"
    proc = subprocess.run([sys.executable, "-c", HUNYUAN_CHECK, str(out)], cwd=fork[0],
                          env=env_for(fork[0]), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines()[-2:]]
    assert [(arch, float(eps)) for arch, eps, _ in rows] == [
        ("HunYuanDenseV1ForCausalLM", 1e-5), ("HunYuanDenseV1ForCausalLM", 0.5)], proc.stdout
    assert all(float(diff) < 1e-5 for *_, diff in rows), proc.stdout


@pytest.mark.slow
def test_export_without_the_key_map_hunk_refuses_naming_the_weight(fork, reference, tmp_path):
    """The fork names its family in hf.py but forgets to map its new weights."""
    root = apply_recipe(copy_repo(tmp_path / "fork"),
                        diff_without_hunk(fork_recipe()[1], "apps/myarch/hf.py",
                                          "self_attn.query_layernorm"))
    out = tmp_path / "hf"
    proc = run_in(root, ["export", str(final_checkpoint(reference, STEPS)), str(out)],
                  module="apps.myarch.hf", check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "layers.0.attention.q_post_norm.weight" in proc.stderr, proc.stderr[-3000:]
    assert "key_map in apps/myarch/hf.py" in proc.stderr, proc.stderr[-3000:]
    assert not (out / "model.safetensors").exists()


def shared_runs(a_lines, b_lines, length):
    """Runs of `length` identical consecutive lines (stripped, blank lines and comments
    ignored)."""
    def norm(lines):
        return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    a, b = norm(a_lines), norm(b_lines)
    windows = {tuple(b[i:i + length]) for i in range(len(b) - length + 1)}
    return [a[i:i + length] for i in range(len(a) - length + 1)
            if tuple(a[i:i + length]) in windows]


# What the composition rule lets a fork copy from the architecture it forks.
ARCHITECTURE_FILES = ("model.py", "parallelize.py", "hf.py")
# A bound on what the recipe's fork copies (non-blank lines of every file the recipe's shell block
# makes, configs included), so plumbing that should be lingua/'s does not creep back into
# apps/llama or lingua/models/llama. 335 today: the four HF families' options and names are
# LLaMA's architecture files' now.
FORK_LINES_LIMIT = 360


def test_apps_share_no_plumbing():
    """Apps copy the architecture they fork (model.py, parallelize.py, hf.py's names); everything
    else lives in lingua/, where a fix reaches every app and nothing drifts."""
    apps = sorted(p for p in (REPO / "apps").iterdir() if (p / "__init__.py").is_file())
    for i, a in enumerate(apps):
        for b in apps[i + 1:]:
            for a_file in a.glob("*.py"):
                for b_file in b.glob("*.py"):
                    if a_file.name in ARCHITECTURE_FILES and b_file.name in ARCHITECTURE_FILES:
                        continue
                    runs = shared_runs(a_file.read_text().splitlines(),
                                       b_file.read_text().splitlines(), 10)
                    assert not runs, (f"{a.name}/{a_file.name} and {b.name}/{b_file.name} share:\n"
                                      + "\n".join(runs[0]))


def test_an_architecture_trained_unchanged_is_imported_not_copied():
    """apps/llama pretrains and apps/sft fine-tunes lingua/models/llama: neither holds a copy of it
    (no run of 10 lines in common with its files)."""
    architecture = sorted((REPO / "lingua" / "models" / "llama").glob("*.py"))
    for app in ("llama", "sft"):
        for path in sorted((REPO / "apps" / app).glob("*.py")):
            for arch in architecture:
                runs = shared_runs(path.read_text().splitlines(),
                                   arch.read_text().splitlines(), 10)
                assert not runs, (f"apps/{app}/{path.name} copies {arch.name}:\n"
                                  + "\n".join(runs[0]))


def imported_apps(path: Path) -> set:
    """The apps (apps.<name>) a file imports, absolute or relative, read with ast."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the file's package apps.<app>
                base = ["apps", path.parent.name][:max(0, 3 - node.level)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            modules = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {m.split(".")[1] for m in modules if m.startswith("apps.")}
    return found


def test_no_app_imports_another_app():
    """The composition rule: an app imports lingua/ and itself, never another app. A fork copies
    model.py, parallelize.py, hf.py, train.py and its thin entry points (docs/forking.md),
    so a change to one app never reaches another unseen."""
    offenders = []
    for path in sorted((REPO / "apps").glob("*/*.py")):
        others = imported_apps(path) - {path.parent.name}
        offenders += [f"{path.relative_to(REPO)} imports apps.{o}" for o in sorted(others)]
    assert not offenders, ("an app imports another app; copy what it needs into it instead:\n"
                           + "\n".join(offenders))


def test_imported_apps_reads_every_form(tmp_path):
    f = tmp_path / "apps" / "moe" / "x.py"
    f.parent.mkdir(parents=True)
    f.write_text("import apps.llama.model\nfrom apps import mtp\nfrom ..sft import y\n"
                 "from . import z\nfrom apps.moe.model import w\nimport lingua\n")
    assert imported_apps(f) == {"llama", "mtp", "sft", "moe"}


def test_the_recipes_fork_copies_under_the_limit(fork):
    """Counted: the non-blank lines of every file the recipe's shell block makes (after its diff),
    configs included."""
    root, before, after = fork
    made = sorted(p for p in set(after) - set(before) if p.startswith(FORK_DIRS))
    lines = {p: sum(1 for line in (root / p).read_text().splitlines() if line.strip())
             for p in made}
    total = sum(lines.values())
    assert total < FORK_LINES_LIMIT, (f"the recipe's fork copies {total} non-blank lines (limit "
                                      f"{FORK_LINES_LIMIT}): {lines}")


def test_shared_runs_finds_a_copied_block():
    block = [f"x{i} = {i}" for i in range(12)]
    assert shared_runs(["a = 1", *block], [*block, "b = 2"], 10)
    assert not shared_runs(block[:9], block[:9], 10)
