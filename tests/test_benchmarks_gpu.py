"""benchmarks/gpu_vs_hf.py (our trainer vs a Hugging Face loop on one GPU): both sides train the
same model, and the whole comparison runs end to end (on the CPU here, tiny shapes, fp32); and
setup/gpu_check.py's device-independent parts."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

pytest.importorskip("transformers")

import gpu_vs_hf  # noqa: E402


@pytest.mark.parametrize("name", sorted(gpu_vs_hf.SHAPES))
def test_hf_side_has_our_shape(name):
    """The HF model of every shape (built from our exporter's config) has our parameter count
    and our head, expert and tying layout; the 1B shape is the llama_1b preset's."""
    shape = gpu_vs_hf.SHAPES[name]
    experts = ["default", "eager"] if shape.app == "moe" else ["default"]
    with torch.device("meta"):
        ours = gpu_vs_hf.our_model(shape)
    count = sum(p.numel() for p in ours.parameters())
    for impl in experts:
        theirs = gpu_vs_hf.hf_model(shape, impl, device="meta")
        assert sum(p.numel() for p in theirs.parameters()) == count, (name, impl)
        cfg = theirs.config
        assert cfg.num_key_value_heads == (shape.model.get("n_kv_heads") or shape.model["n_heads"])
        assert cfg.tie_word_embeddings == shape.model.get("tie_embeddings", False)
        assert cfg._attn_implementation == "sdpa"
        if shape.app == "moe":
            assert type(theirs).__name__ == "MixtralForCausalLM"
            assert cfg.num_local_experts == shape.model["n_experts"]
            assert cfg.intermediate_size == shape.model["expert_hidden_dim"]
            if impl != "default":
                assert cfg._experts_implementation == impl
        if shape.app == "deepseek":
            assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
            assert (cfg.n_routed_experts, cfg.n_group, cfg.q_lora_rank) == (
                shape.model["n_experts"], shape.model["n_groups"], shape.model["q_lora_rank"])
    if name == "8B-wide":   # Llama 3 8B's width, 8 of its layers
        assert count == pytest.approx(2.80e9, rel=0.01) and shape.model["dim"] == 4096
    if name == "deepseek":   # DeepSeek-V3's width, one dense and one 32-expert MoE layer
        assert count == pytest.approx(4.08e9, rel=0.01) and shape.model["dim"] == 7168
    if name == "1B":
        assert count == pytest.approx(1.04e9, rel=0.01)
        assert shape.model["dim"] == 2048 and shape.model["tie_embeddings"] is True


def test_sides():
    """HF's per-expert loop is measured uncompiled only; LLaMA shapes have no experts variants."""
    moe, llama = gpu_vs_hf.SHAPES["moe"], gpu_vs_hf.SHAPES["125M"]
    names = [s.name for s in gpu_vs_hf.sides_for(moe, ["compiled"], ["compiled", "eager"],
                                                 ["default", "eager"])]
    assert names == ["ours", "hf_compiled", "hf_eager", "hf_eager_experts_eager"]
    names = [s.name for s in gpu_vs_hf.sides_for(llama, ["compiled", "eager"], ["eager"],
                                                 ["default", "eager"])]
    assert names == ["ours", "ours_eager", "hf_eager"]
    # --float8: each of ours again in float8, right after its bf16 twin
    sides = gpu_vs_hf.sides_for(llama, ["compiled", "eager"], ["eager"], ["default"],
                                "tensorwise")
    assert [s.name for s in sides] == ["ours", "ours_float8", "ours_eager", "ours_eager_float8",
                                       "hf_eager"]
    assert [s.float8 for s in sides] == ["none", "tensorwise", "none", "tensorwise", "none"]
    # several recipes: each named by its recipe, and its ratio taken to its own bf16 twin
    sides = gpu_vs_hf.sides_for(llama, ["compiled"], [], ["default"], "tensorwise,rowwise")
    assert [(s.name, s.float8) for s in sides] == [
        ("ours", "none"), ("ours_float8_tensorwise", "tensorwise"),
        ("ours_float8_rowwise", "rowwise")]
    run = {"ok": True, "peak_mem_gib": 1.0}
    results = {"shapes": {"125M": {"flops_per_token": 1.0, "sides": {
        "ours": {"runs": [dict(run, tokens_per_s=100.0)]},
        "ours_float8_rowwise": {"runs": [dict(run, tokens_per_s=125.0)]}}}}}
    gpu_vs_hf.summarize(results, {})
    assert results["shapes"]["125M"]["ratios"] == {"ours_float8_rowwise/ours": 1.25}
    cli = type("Cli", (), {"float8": "rowwise", "float8_shapes": "8B-wide"})
    assert [gpu_vs_hf.float8_of(cli, n) for n in ("8B-wide", "moe")] == ["rowwise", "none"]
    assert "distributed.float8=rowwise" in gpu_vs_hf.ours_overrides(
        llama, True, "cuda", 1, "d", "r", "rowwise")


@pytest.fixture(scope="module",
                params=["tiny", "tiny-moe", "tiny-deepseek", "tiny-qwen3-next"])
def cpu_run(request, tmp_path_factory, corpus):
    """One end-to-end run on CPU of one tiny shape (the LLaMA, the MoE, DeepSeek, Qwen3-Next: a
    run each, so that no test waits for another): ours and HF eager, one round; on the LLaMA ours
    in float8 too (--float8 adds a side whatever the shape: gpu_vs_hf.sides_for, tested above;
    the MoE's float8 training is tests/test_float8_moe.py's)."""
    work = tmp_path_factory.mktemp("gpu_vs_hf")
    out = work / "results.json"
    cmd = [sys.executable, "benchmarks/gpu_vs_hf.py", "--device", "cpu",
           "--shapes", request.param, "--ours-eager", "--hf", "eager", "--rounds", "1",
           *(["--float8", "tensorwise"] if request.param == "tiny" else []),
           "--warmup", "2", "--steps", "2",
           "--workdir", str(work), "--data-root", str(corpus), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return request.param, proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_runs_end_to_end_on_cpu(cpu_run):
    name, stdout, results = cpu_run
    assert results["complete"] and results["env"]["device"] == "cpu"
    assert results["env"]["torch"] == torch.__version__ and results["env"]["transformers"]
    # The step counts are whole windows of the trainer's own logging (the debug presets': 10).
    assert results["settings"]["logging_every"] == 10
    assert (results["settings"]["warmup"], results["settings"]["steps"]) == (10, 10)
    table = stdout[stdout.rindex("shape "):]   # the table comes last
    sides = {"tiny": ["ours_eager", "hf_eager"], "tiny-deepseek": ["ours_eager", "hf_eager"],
             "tiny-qwen3-next": ["ours_eager", "hf_eager"],
             "tiny-moe": ["ours_eager", "hf_eager", "hf_eager_experts_eager"]}[name]
    assert list(results["shapes"]) == [name]
    shape = results["shapes"][name]
    for side in sides:
        got = shape["sides"][side]
        assert got["rounds_ok"] == 1 and got["tokens_per_s"] > 0, (name, side, got)
        assert got["peak_mem_gib"] > 0 and 0 < got["mfu_measured"] < 1
        assert re.search(rf"^{re.escape(name)} +{side}\b.* [\d,]+ +1 ", table, re.M), table
    ours, hf = shape["sides"]["ours_eager"], shape["sides"]["hf_eager"]
    assert shape["ratios"]["ours_eager/hf_eager"] == pytest.approx(
        ours["tokens_per_s"] / hf["tokens_per_s"])
    run = ours["runs"][0]
    # Ours measured its rows after the warm-up only: the row at step 20 (steps 11-20).
    assert run["rows"] == [10, 20] and run["measured_steps"] == 10
    # MFU is over the FLOPs per token the trainer itself logs its MFU with (read back from
    # its logged mfu and its one peak).
    assert not run["trainer_peak_note"]
    assert run["trainer_flops_per_token"] == pytest.approx(shape["flops_per_token"], rel=1e-9)
    assert run["wall_tokens_per_s"] > 0
    if name == "tiny":   # --float8: our side again in float8, side by side
        fast = shape["sides"]["ours_eager_float8"]
        assert fast["rounds_ok"] == 1 and fast["tokens_per_s"] > 0
        assert "distributed.float8=tensorwise" in fast["runs"][0]["command"]
        assert shape["ratios"]["ours_eager_float8/ours_eager"] == pytest.approx(
            fast["tokens_per_s"] / shape["sides"]["ours_eager"]["tokens_per_s"])
    elif name == "tiny-moe":
        moe = shape["sides"]
        assert moe["hf_eager"]["runs"][0]["experts_implementation"]   # transformers' own choice
        assert moe["hf_eager_experts_eager"]["runs"][0]["experts_implementation"] == "eager"


def test_gpu_check_installs_only_what_the_image_lacks_and_reads_junit(tmp_path, monkeypatch):
    """setup/gpu_check.py: the wheels of distributions the image has are kept out of the install
    (nothing of the image replaced); pytest's JUnit XML becomes per-test outcomes; without CUDA it
    stops after the install with its reason in the summary."""
    sys.path.insert(0, str(REPO / "setup"))
    import gpu_check

    for name in ("hydra_core-1.3.8-py3-none-any.whl", "Omega.Conf-2.3.1-py3-none-any.whl",
                 "peft-0.21.2-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    install, kept = gpu_check.missing_wheels(tmp_path, {"peft": "0.17.0", "omega-conf": "2.3.1"})
    assert [w.name for w in install] == ["hydra_core-1.3.8-py3-none-any.whl"]
    assert kept == {"omega-conf": ("2.3.1", "2.3.1"), "peft": ("0.17.0", "0.21.2")}

    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_a" time="1.5"/>'
        '<testcase classname="tests.test_gpu" name="test_b" time="2"><failure message="boom&#10;'
        'more">trace</failure></testcase><testcase classname="tests.test_gpu" name="test_c" '
        'time="0"><skipped message="needs 2 GPUs"/></testcase></testsuite></testsuites>')
    assert gpu_check.test_results(tmp_path / "junit.xml") == {
        "tests.test_gpu::test_a": {"outcome": "passed", "seconds": 1.5, "message": ""},
        "tests.test_gpu::test_b": {"outcome": "failed", "seconds": 2.0, "message": "boom"},
        "tests.test_gpu::test_c": {"outcome": "skipped", "seconds": 0.0,
                                   "message": "needs 2 GPUs"}}

    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path / "none")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--budget", "60"])
    assert gpu_check.main() == 1
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["gpu"] is None and "no CUDA" in summary["error"]
