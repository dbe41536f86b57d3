import copy
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from lingua.checkpoint import integrity
from lingua.errors import ConfigError
from lingua.models.llama.hf import args_from_hf_config, load_hf, save_hf
from lingua.models.llama.model import LlamaArgs, Transformer
from tests import launcher

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "plain": {},
    "llama3_rope": {"rope_scaling": LLAMA3_ROPE},
    "tied": {"tie_word_embeddings": True},
}


def hf_model(seed=0, eps=1e-5, **extra):
    # LlamaConfig writes rope_theta into the rope_scaling dict it is given
    extra = copy.deepcopy(extra)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      rope_theta=500000.0, max_position_embeddings=64, rms_norm_eps=eps,
                      attn_implementation="sdpa", **extra)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # large random weights: sharp attention makes layout mistakes visible
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def x_tokens():
    return torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_ours_and_back(case, tmp_path):
    hf = hf_model(**CASES[case])
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours, args = load_hf(tmp_path / "hf")
    assert args.rope_scaling == (case == "llama3_rope") and args.tie_embeddings == (case == "tied")
    shape = (args.dim, args.n_heads, args.n_kv_heads, args.n_layers, args.rope_theta)
    assert shape == (64, 4, 2, 2, 500000.0)
    x = x_tokens()
    with torch.no_grad():
        ref = hf(x).logits
        torch.testing.assert_close(ours(x), ref, atol=1e-4, rtol=0)

    save_hf(ours, args, tmp_path / "ours")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref, atol=1e-4, rtol=0)
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["intermediate_size"] == 160 and cfg["num_key_value_heads"] == 2
    assert cfg["torch_dtype"] == "float32" and cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"] == (dict(LLAMA3_ROPE) if case == "llama3_rope" else None)


def test_llama_app_trains_from_init_from_alone(corpus, tmp_path):
    """apps.llama.train checkpoint.init_from=<dir> with no model.* typed (issue 58): the run takes
    the directory's shape, none of it the debug preset's (width 64 whose 160-wide FFN needs
    ffn_dim_multiplier, eps 1e-6, Llama 3.1 RoPE at theta 5e5, vocabulary 300), and its first
    loss is transformers' on the same batch."""
    from apps.llama import train
    from lingua import data
    from lingua.model.loss import token_loss_sum
    from tests.conftest import read_metrics

    hf = hf_model(eps=1e-6, rope_scaling=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path / "hf")
    argv = [f"checkpoint.init_from={tmp_path / 'hf'}", f"dump_dir={tmp_path / 'run'}",
            f"data.root={corpus}", "data.prepare_embedded=false", "data.seq_len=32",
            "data.batch_size=2", "data.val_sequences=8", "steps=1", "checkpoint.every=0",
            "eval.every=0", "eval.at_end=false", "logging.every=1"]
    cfg = train.load_config(argv)
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_kv_heads, m.vocab_size, m.norm_eps) == (64, 2, 2, 300, 1e-6)
    assert (m.rope_theta, m.rope_scaling, m.multiple_of) == (500000.0, True, 160)
    assert m.ffn_dim_multiplier == pytest.approx(160 / 170)
    assert train.main(argv) == 0
    (batch,) = data.build_train_loader(cfg.data, 0, 1, cfg.seed).next_step()
    with torch.no_grad():
        want = token_loss_sum(hf(batch.tokens).logits, batch.labels).item() / batch.labels.numel()
    loss = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r][0]
    assert loss == pytest.approx(want, rel=1e-5)


def test_scaling_and_layout_matter(tmp_path):
    """The parity above would catch a wrong RoPE layout or ignored scaling (not a vacuous 1e-4)."""
    x = x_tokens()
    hf = hf_model(rope_scaling=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours, args = load_hf(tmp_path)
    with torch.no_grad():
        ref = hf(x).logits
        unscaled = Transformer(replace(args, rope_scaling=False))
        unscaled.load_state_dict(ours.state_dict())
        assert (unscaled(x) - ref).abs().max() > 1e-2
        # Meta's interleaved layout = HF rows permuted within each head: (0, d/2, 1, d/2+1, ...)
        hd = args.dim // args.n_heads
        perm = torch.arange(hd).view(2, hd // 2).t().flatten()
        for attn in (blk.attention for blk in ours.layers.values()):
            for lin in (attn.wq, attn.wk):
                w = lin.weight.view(-1, hd, args.dim)
                lin.weight.copy_(w[:, perm].reshape(-1, args.dim))
        assert (ours(x) - ref).abs().max() > 1e-2


def test_sharded_checkpoint_and_dtype(tmp_path):
    hf = hf_model()
    hf.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ours, _ = load_hf(tmp_path, dtype=None)
    assert ours.tok_embeddings.weight.dtype == torch.bfloat16
    assert ours.rope_cos.dtype == torch.float32  # positions stay exact in bf16 models
    fp32, _ = load_hf(tmp_path)
    assert fp32.tok_embeddings.weight.dtype == torch.float32
    torch.testing.assert_close(fp32.tok_embeddings.weight, hf.model.embed_tokens.weight.float(),
                               atol=0, rtol=0)
    ref = hf_model()  # fresh: hf.float() would keep its RoPE inv_freq rounded to bf16
    x = x_tokens()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
        torch.testing.assert_close(fp32(x), ref(x).logits, atol=1e-4, rtol=0)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_hf(tmp_path)
    hf_model().save_pretrained(tmp_path, safe_serialization=True)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())

    cfg_path.write_text(json.dumps({**cfg, "vocab_size": 301}))
    with pytest.raises(ConfigError,
                       match=r"model.safetensors: model.embed_tokens.weight gives "
                             r"tok_embeddings.weight of shape \(300, 64\)"):
        load_hf(tmp_path)
    cfg_path.write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(ConfigError, match="'yarn' is not supported"):
        load_hf(tmp_path)
    cfg_path.write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match="model.layers.2.self_attn.q_proj.weight is missing"):
        load_hf(tmp_path)
    cfg_path.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        load_hf(tmp_path)
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="No weights in"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "part-1.safetensors"}})
    )
    with pytest.raises(ConfigError, match="part-1.safetensors is listed"):
        load_hf(tmp_path)


def training_checkpoint(tmp_path, n_layers=2):
    """(model, its args, a training checkpoint of it) as save() writes one."""
    args = LlamaArgs(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=258,
                     multiple_of=32, max_seq_len=64, init_std=0.2, tie_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(args)
    ckpt = tmp_path / "checkpoints" / "10"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt))
    run_config = {"model": asdict(args), "data": {"tokenizer": {"kind": "bytes"}}}
    OmegaConf.save(OmegaConf.create(run_config), ckpt / "config.yaml")
    # what save() adds: export/generate refuse a checkpoint without one
    integrity.write_manifest(ckpt)
    return model, args, ckpt


def test_export_reads_and_writes_one_file_at_a_time(tmp_path, monkeypatch):
    from lingua.checkpoint import hf as lingua_hf
    from lingua.checkpoint import hf_files
    from lingua.models.llama import hf as llama_hf

    model, args, ckpt = training_checkpoint(tmp_path, n_layers=4)
    layer_bytes = sum(t.nbytes for k, t in model.state_dict().items() if k.startswith("layers.1."))
    monkeypatch.setattr(hf_files, "SHARD_BYTES", 2 * layer_bytes)
    reads, checkpoint_reader = [], lingua_hf.checkpoint_reader

    def recording(*a):
        read = checkpoint_reader(*a)
        return lambda keys: reads.append(len(keys)) or read(keys)

    monkeypatch.setattr(lingua_hf, "checkpoint_reader", recording)
    out = tmp_path / "hf"
    llama_hf.export(ckpt, out)
    # Each read is one file's worth (at most two of the nine-tensor layers), never the model.
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == len(reads) >= 3 and max(reads) <= 18, (files, reads)
    assert sum(reads) == len(model.state_dict())
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                     for i in range(1, len(files) + 1)], files
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(files) and len(index) == len(model.state_dict())
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 258, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=0)
    assert load_hf(out)[1] == args


@pytest.mark.slow
def test_export_cli_from_training_checkpoint(tmp_path):
    model, args, ckpt = training_checkpoint(tmp_path)
    out = tmp_path / "hf"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = launcher.launch("apps.llama.hf", ["export", str(ckpt), str(out)], 0, env, tmp_path,
                           timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert load_hf(out)[1] == args  # the export records enough to give back the same LlamaArgs
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 258, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=0)
    # generate() stops at our EOS, not at Llama's default id 2 (a byte of the corpus here).
    from lingua.data.tokenizer import ByteTokenizer

    ours = ByteTokenizer()
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert hf.generation_config.eos_token_id == ours.eos_id != 2
    assert hf.generation_config.pad_token_id == ours.eos_id

    # The HF directory is not a checkpoint (run directories and missing steps:
    # tests/test_generate.py).
    bad = launcher.launch("apps.llama.hf", ["export", str(out), str(tmp_path / "x")], 0, env,
                          tmp_path, timeout=240)
    assert bad.returncode == 2 and "is neither a run directory" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_fork_export_problems_warn_at_start_and_refuse(
    corpus, tmp_path, monkeypatch, caplog, capsys
):
    """Every LlamaArgs option exports; a fork's export_problems (apps/<fork>/hf.py) is said at the
    start of training (one warning line) and refused by the export with the same reason."""
    import logging

    from apps.llama import train
    from lingua.models.llama import hf as llama_hf
    from tests.conftest import tiny_args

    with caplog.at_level(logging.WARNING):
        args = train.load_config(tiny_args(corpus, tmp_path / "run"))
    def said():
        return [r.getMessage() for r in caplog.records if r.name == "lingua.checkpoint.hf"]

    assert llama_hf.export_problems(args.model) == [] and not said()
    reason = "model.qk_norm=true (LlamaForCausalLM has no QK-norm): train without it"
    for module in (llama_hf, train):
        monkeypatch.setattr(module, "export_problems", lambda model_args: [reason])
    with caplog.at_level(logging.WARNING):
        train.load_config(tiny_args(corpus, tmp_path / "run"))
    assert [message.count(reason) for message in said()] == [1]
    ckpt = tmp_path / "checkpoints" / "10"
    dcp.save({"model": Transformer(SMALL).state_dict()}, checkpoint_id=str(ckpt))
    OmegaConf.save(OmegaConf.create({"model": asdict(SMALL)}), ckpt / "config.yaml")
    integrity.write_manifest(ckpt)
    with pytest.raises(SystemExit) as e:
        llama_hf.main(["export", str(ckpt), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and reason in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("dim, hidden, multiple_of, mult", [
    (4096, 14336, 1024, 1.3),   # Llama 3 8B
    (2048, 8192, 256, 1.5),     # Llama 3.2 1B
    (4096, 11008, 256, None),   # Llama 2 7B
    (64, 100, 100, 100 / 170),  # anything else still reproduces the width exactly
])
def test_ffn_recipe_recovered_from_hf_config(tmp_path, dim, hidden, multiple_of, mult):
    cfg = {"model_type": "llama", "hidden_size": dim, "intermediate_size": hidden,
           "num_hidden_layers": 1,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = args_from_hf_config(tmp_path / "config.json")
    assert (args.multiple_of, args.ffn_dim_multiplier) == (multiple_of, mult)


# ---------------------------------------------------------------------------------------------
# Nothing dropped silently: a fork's new weight (QK-norm) or an HF file's extra tensor is refused.

SMALL = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                  max_seq_len=32)


class QKNormTransformer(Transformer):
    """What a fork that adds QK-norm builds: two weights per layer that key_map does not know."""

    def __init__(self, args):
        super().__init__(args)
        from lingua.model.layers import RMSNorm
        for blk in self.layers.values():
            blk.attention.q_norm = RMSNorm(args.dim // args.n_heads)
            blk.attention.k_norm = RMSNorm(args.dim // args.n_heads)


def test_export_refuses_unmapped_weights(tmp_path):
    args = replace(SMALL, n_layers=6)
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as e:
        save_hf(QKNormTransformer(args), args, out)
    msg = str(e.value)
    assert "12 tensor(s)" in msg and "\n" not in msg
    # every name up to ten, in layer order, then a count; the file to edit
    assert ("layers.0.attention.k_norm.weight, layers.0.attention.q_norm.weight, "
            "layers.1.attention.k_norm.weight" in msg
            and "layers.4.attention.q_norm.weight and 2 more" in msg)
    assert "key_map in lingua/models/llama/hf.py" in msg and "NOT_EXPORTED" in msg
    assert not out.exists()

    # A parameter registered on one block of a built model: named, and an existing out_dir left
    # as it was.
    model = Transformer(SMALL)
    model.layers["1"].feed_forward.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConfigError,
                       match=r"1 tensor\(s\) .*: layers\.1\.feed_forward\.scale\. Map"):
        save_hf(model, SMALL, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_cli_refuses_unmapped_weights(tmp_path, monkeypatch, capsys):
    """The fork's CLI: exit 2, one paragraph naming the weights and the file, no out_dir."""
    import apps.llama.hf as llama_hf
    monkeypatch.setattr("lingua.models.llama.hf.Transformer", QKNormTransformer)
    ckpt = tmp_path / "checkpoints" / "10"
    dcp.save({"model": QKNormTransformer(SMALL).state_dict()}, checkpoint_id=str(ckpt))
    OmegaConf.save(OmegaConf.create({"model": asdict(SMALL)}), ckpt / "config.yaml")
    integrity.write_manifest(ckpt)
    out = tmp_path / "hf"
    with pytest.raises(SystemExit) as e:
        llama_hf.main(["export", str(ckpt), str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: save_hf: 4 tensor(s)")
    assert err.count("\n") == 1
    assert "layers.1.attention.q_norm.weight" in err and "lingua/models/llama/hf.py" in err
    assert not out.exists()


def _add_tensors(file: Path, extra: dict) -> None:
    from safetensors.torch import load_file, save_file
    save_file({**load_file(str(file)), **extra}, str(file), metadata={"format": "pt"})


def test_import_refuses_tensors_it_would_drop(tmp_path, monkeypatch):
    hf_model().save_pretrained(tmp_path, safe_serialization=True)
    weights = tmp_path / "model.safetensors"
    _add_tensors(weights, {"model.layers.1.self_attn.q_norm.weight": torch.ones(16),
                           "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(ConfigError) as e:
        load_hf(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "2 tensor(s) in model.safetensors" in msg
    assert ("drop them: model.layers.0.self_attn.q_proj.bias, "
            "model.layers.1.self_attn.q_norm.weight." in msg)
    assert "key_map in lingua/models/llama/hf.py" in msg and "NOT_IMPORTED" in msg

    # What NOT_IMPORTED lists (RoPE inverse frequencies, recomputed) loads without complaint.
    hf = hf_model(tie_word_embeddings=True)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _add_tensors(weights, {"model.rotary_emb.inv_freq": torch.ones(8),
                           "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
                           # tied: transformers ignores a stored lm_head too
                           "lm_head.weight": hf.model.embed_tokens.weight.detach().clone()})
    ours, _ = load_hf(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(x_tokens()), hf(x_tokens()).logits, atol=1e-4, rtol=0)

    # A fork's model with weights the map does not fill: named, with the file to edit.
    monkeypatch.setattr("lingua.models.llama.hf.Transformer", QKNormTransformer)
    with pytest.raises(ConfigError,
                       match=r"load_hf: 4 tensor\(s\) .*: layers\.0\.attention\.k_norm\.weight, "
                             r".* key_map in lingua/models/llama/hf\.py"):
        load_hf(tmp_path)
