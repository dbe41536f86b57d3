import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from lingua.checkpoint import integrity
from lingua.errors import ConfigError
from lingua.eval.generation import generate, sample_next
from lingua.models.llama.model import LlamaArgs, Transformer

ROOT = Path(__file__).resolve().parents[1]
ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=32,
                 max_seq_len=64, init_std=0.3)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return Transformer(ARGS).eval()


def greedy_by_full_forward(model, prompt, n):
    """Reference without a cache: rerun the whole sequence for every new token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


PROMPT = [256, 72, 101, 108, 108, 111]


def test_cached_greedy_equals_full_forward():
    model = tiny_model()
    ref = greedy_by_full_forward(model, PROMPT, 30)
    assert len(set(ref)) > 5  # a non-degenerate sequence, so agreement means something
    assert generate(model, PROMPT, 30) == ref
    # A one-token prompt.
    assert generate(model, [256], 10) == greedy_by_full_forward(model, [256], 10)


def test_top_k_1_and_tiny_top_p_are_greedy():
    model = tiny_model()
    greedy = generate(model, PROMPT, 20)
    gen = torch.Generator().manual_seed(0)
    assert generate(model, PROMPT, 20, temperature=1.0, top_k=1, generator=gen) == greedy
    assert generate(model, PROMPT, 20, temperature=1.0, top_p=1e-6, generator=gen) == greedy
    hot = [generate(model, PROMPT, 20, temperature=2.0,
                    generator=torch.Generator().manual_seed(seed)) for seed in (1, 1, 2)]
    assert hot[0] == hot[1] and hot[0] != greedy and hot[0] != hot[2]  # seeded, and really sampling


def test_stops_at_eos():
    model = tiny_model()
    ref = greedy_by_full_forward(model, PROMPT, 30)
    eos = ref[4]
    out = generate(model, PROMPT, 30, eos_id=eos)
    assert out == ref[:ref.index(eos) + 1] and out[-1] == eos


def _frequencies(logits, n=20000, **kw):
    draws = sample_next(logits.expand(n, -1), generator=torch.Generator().manual_seed(0), **kw)
    return torch.bincount(draws, minlength=logits.shape[-1]).float() / n


def test_sampling_distributions():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0])
    f = _frequencies(logits, temperature=0.5)
    torch.testing.assert_close(f, (logits / 0.5).softmax(-1), atol=0.015, rtol=0)
    f = _frequencies(logits, temperature=1.0, top_k=3)
    expected = torch.cat([logits[:3].softmax(-1), torch.zeros(3)])
    assert (f[3:] == 0).all()
    torch.testing.assert_close(f, expected, atol=0.015, rtol=0)

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # top_p 0.7: {0.5, 0.3} reaches it; top_p 0.85 also needs the 0.15 token
    f = _frequencies(probs.log(), temperature=1.0, top_p=0.7)
    torch.testing.assert_close(f, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015, rtol=0)
    f = _frequencies(probs.log(), temperature=1.0, top_p=0.85)
    torch.testing.assert_close(f, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=0.015, rtol=0)
    assert (sample_next(logits.expand(4, -1)) == 0).all()  # temperature 0 = argmax


def test_bad_requests():
    model = tiny_model()
    with pytest.raises(ConfigError, match="max_seq_len=64"):
        generate(model, PROMPT, 60)
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, PROMPT, 5, temperature=1.0, top_p=0.0)
    with pytest.raises(ConfigError, match="empty"):
        generate(model, [], 5)


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    import lingua.data.tokenizer as tok_mod
    model = tiny_model()
    ckpt = tmp_path / "checkpoints" / "5"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt))
    cfg = {"model": asdict(ARGS), "data": {"tokenizer": {"kind": "bytes", "path": None}}}
    OmegaConf.save(OmegaConf.create(cfg), ckpt / "config.yaml")
    # What save() adds: export/generate refuse a checkpoint without one.
    integrity.write_manifest(ckpt)
    prompts = ["Hello", "Once upon a time", "abc"]
    (tmp_path / "prompts.txt").write_text("Once upon a time\n\nabc\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "apps.llama.generate", str(ckpt), "--prompt", "Hello",
           "--prompts-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "12",
           "--temperature", "0", "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr

    tok = tok_mod.build_tokenizer(tok_mod.TokenizerArgs(kind="bytes"))
    expected = ""
    for text in prompts:
        ids = greedy_by_full_forward(model, tok.encode(text, add_bos=True, add_eos=False), 12)
        if tok.eos_id in ids:
            ids = ids[:ids.index(tok.eos_id)]
        expected += f"prompt: {text}\ncompletion: {tok.decode(ids)}\n\n"
    assert proc.stdout == expected

    bad = subprocess.run(cmd[:4] + ["--prompts-file", "missing.txt"], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "missing.txt does not exist" in bad.stderr


# ---------------------------------------------------------------------------------------------
# What the commands take: a run directory (its newest complete checkpoint) or a checkpoint; a
# missing step or a directory that is neither is one paragraph naming what exists (exit 2).
# The resolver is lingua.checkpoint.resolve, shared with `python -m apps.<app>.eval`.

COMMANDS = ["apps.llama.generate", "apps.mtp.generate", "apps.llama.hf", "apps.mtp.hf"]


def _make_run(root: Path, app: str) -> dict:
    """A run directory as training leaves it: config.yaml and checkpoints 5 and 10 of different
    weights, beside an unfinished save (.tmp-) and a step 15 whose copy lost its files: neither is
    a complete checkpoint. Returns {step: model}."""
    import importlib

    model_module = importlib.import_module({"llama": "lingua.models.llama.model",
                                            "mtp": "apps.mtp.model"}[app])
    args_class = getattr(model_module, {"llama": "LlamaArgs", "mtp": "MTPArgs"}[app])
    shape = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
             "max_seq_len", "init_std")
    args = args_class(**{k: getattr(ARGS, k) for k in shape})
    cfg = OmegaConf.create({"model": asdict(args),
                            "data": {"tokenizer": {"kind": "bytes", "path": None}}})
    root.mkdir(parents=True)
    OmegaConf.save(cfg, root / "config.yaml")
    models = {}
    for step in (5, 10):
        torch.manual_seed(step)
        models[step] = model_module.Transformer(args).eval()
        ckpt = root / "checkpoints" / str(step)
        dcp.save({"model": models[step].state_dict()}, checkpoint_id=str(ckpt))
        OmegaConf.save(cfg, ckpt / "config.yaml")
        integrity.write_manifest(ckpt)
    (root / "checkpoints" / "15").mkdir()
    (root / "checkpoints" / "20.tmp-abc").mkdir()
    return models


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {app: (root / app, _make_run(root / app, app)) for app in ("llama", "mtp")}


def _command(name: str, target, out: Path) -> list:
    if name.endswith(".hf"):
        return ["export", str(target), str(out)]
    return [str(target), "--prompt", "Hello", "--max-new-tokens", "8", "--device", "cpu"]


def _run(name: str, target, out: Path, capsys):
    """(exit code, stdout, stderr) of the command run in this process."""
    import importlib

    code = 0
    try:
        importlib.import_module(name).main(_command(name, target, out))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("app", ["llama", "mtp"])
def test_generate_takes_a_run_directory_or_a_checkpoint(app, runs, tmp_path, capsys):
    run, models = runs[app]
    outputs = {}
    for target in (run, run / "checkpoints", run / "checkpoints" / "10", run / "checkpoints" / "5"):
        code, out, err = _run(f"apps.{app}.generate", target, tmp_path, capsys)
        assert code == 0, err
        outputs[target] = out
    from lingua.data.tokenizer import TokenizerArgs, build_tokenizer

    tok = build_tokenizer(TokenizerArgs(kind="bytes"))
    ids = greedy_by_full_forward(models[10], tok.encode("Hello", add_bos=True, add_eos=False), 8)
    ids = ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids
    assert outputs[run] == f"prompt: Hello\ncompletion: {tok.decode(ids)}\n\n"  # checkpoint 10's
    assert outputs[run] == outputs[run / "checkpoints"] == outputs[run / "checkpoints" / "10"]
    assert outputs[run / "checkpoints" / "5"] != outputs[run]  # the newest, not any checkpoint


@pytest.mark.parametrize("app", ["llama", "mtp"])
def test_export_takes_a_run_directory(app, runs, tmp_path, capsys):
    from lingua.models.llama.hf import load_hf  # both export LlamaForCausalLM (MTP: its main model)

    run, models = runs[app]
    code, out, err = _run(f"apps.{app}.hf", run, tmp_path / "hf", capsys)
    assert code == 0 and f"from {run / 'checkpoints' / '10'}" in out, err
    exported, _ = load_hf(tmp_path / "hf")
    newest = models[10].state_dict()
    for key, value in exported.state_dict().items():
        assert torch.equal(value, newest[key]), key


@pytest.mark.parametrize("name", COMMANDS)
def test_missing_step_and_wrong_directories_are_named(name, runs, tmp_path, capsys):
    run = runs["mtp" if ".mtp." in name else "llama"][0]
    fresh = tmp_path / "fresh"  # a run that has saved no checkpoint yet
    fresh.mkdir()
    (fresh / "config.yaml").write_text((run / "config.yaml").read_text())
    (tmp_path / "empty").mkdir()
    cases = [
        (run / "checkpoints" / "7",
         f"no checkpoint 7 in {run / 'checkpoints'}; the run has: 5, 10. "),
        (fresh / "checkpoints" / "7",
         f"no checkpoint 7 in {fresh / 'checkpoints'}; the run has: none. "),
        (fresh, f"{fresh} has no complete checkpoint"),
        (tmp_path / "empty", f"{tmp_path / 'empty'} is neither a run directory (dump_dir"),
        (tmp_path / "nowhere", f"{tmp_path / 'nowhere'} does not exist"),
    ]
    for target, message in cases:
        code, out, err = _run(name, target, tmp_path / "out", capsys)
        assert code == 2 and err.startswith("error: ") and message in err, (target, err)
        assert err.count("\n") == 1 and "manifest.json is missing" not in err and not out
    assert not (tmp_path / "out").exists()
