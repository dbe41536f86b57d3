"""apps/sft as a user meets it: the debug preset makes its inputs on first use and trains on chat
data (answer-only loss), and bad input (issue 34 point 7: the base model) is refused by the
config, before any process or file of the run exists. LoRA itself: tests/test_lora.py; chat data:
tests/test_chat_data.py; export and generation: tests/test_sft_hf.py."""

import json
import math
import os

import pytest

from apps.sft import train
from lingua.errors import ConfigError
from lingua.models.llama.hf import llama_hf_config
from lingua.models.llama.model import Transformer
from tests import launcher
from tests.conftest import REPO


@pytest.fixture(scope="module")
def debug_config_json(tmp_path_factory):
    """A Llama directory with the debug preset's config.json only: validation reads no weight."""
    args = train.load_config([], check=False)
    base = tmp_path_factory.mktemp("sft_base") / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(llama_hf_config(args.model, "float32")))
    return base


def validate(base, *overrides):
    args = train.load_config([f"checkpoint.init_from={base}", *overrides], check=False)
    train.validate_sft(args)
    train.check_init_from(args)
    return args


@pytest.mark.slow   # starts the trainer's process, pretrains 3 steps, loads transformers (20 s)
def test_the_debug_preset_makes_its_inputs_and_trains_on_answers_only(tmp_path):
    """`python -m apps.sft.train` in a fresh directory: the base model and chat corpus appear
    under data/sft_debug, and step 1's logged loss (B = 0: the base model's) is transformers'
    cross-entropy of the base over the answer tokens of that step's conversations, not over all
    of their tokens. Padded rows and causal attention, so transformers sees what we do."""
    import torch
    from transformers import LlamaForCausalLM

    from lingua.data.chat import ChatLoader
    from lingua.model.loss import IGNORE_INDEX

    # The base's pretraining, 3 steps instead of the preset's 200: the same path, quick.
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2", LINGUA_SFT_BASE_STEPS="3")
    env.pop("WORLD_SIZE", None)
    proc = launcher.launch("apps.sft.train", ["steps=2", "logging.every=1", "eval.every=2",
                                              "dump_dir=run", "checkpoint.every=0",
                                              "data.chat.pack=false", "model.attn_mask=causal"],
                           0, env, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    base = tmp_path / "data/sft_debug/base"
    assert (base / "model.safetensors").is_file()
    # Pretrained here, then exported: the pretraining's last checkpoint is the base's weights.
    pretraining = tmp_path / "data/sft_debug/base.pretrain/metrics.jsonl"
    pretrained = [json.loads(line) for line in pretraining.read_text().splitlines()]
    assert pretrained[-1]["step"] == 3
    assert list((tmp_path / "data/sft_debug/chat").glob("*.jsonl"))
    assert "lora: rank 8, alpha 16 on 16 layers" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and math.isfinite(rows[-1]["val_loss"])

    args = train.load_config([f"data.root={tmp_path / 'data/sft_debug/chat'}",
                              "data.chat.pack=false"], check=False)
    batch = ChatLoader(args.data, 0, 1, args.seed).next_step()[0]
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(base).eval()(batch.tokens).logits
    counted = batch.labels != IGNORE_INDEX
    answers = torch.nn.functional.cross_entropy(logits[counted], batch.labels[counted])
    assert rows[0]["loss"] == pytest.approx(answers.item(), rel=1e-4)
    real = batch.tokens != 257   # EOS pads the rows: every real next token of a row
    everything = torch.nn.functional.cross_entropy(logits[:, :-1][real[:, 1:]],
                                                   batch.tokens[:, 1:][real[:, 1:]])
    assert abs(everything.item() - answers.item()) > 1e-3


def test_a_matching_base_passes(debug_config_json):
    validate(debug_config_json)


def test_init_from_is_required():
    args = train.load_config(["checkpoint.init_from=null"], check=False)
    with pytest.raises(ConfigError, match="apps.sft fine-tunes a Hugging Face checkpoint, and "
                                          "checkpoint.init_from is not set"):
        train.check_init_from(args)


def test_a_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json: it is not a Hugging Face model"):
        validate(tmp_path)


def test_another_architecture_is_refused(debug_config_json, tmp_path):
    """Llama, Mistral, Qwen2 and Qwen3 are read (tests/test_hf_families.py); Gemma 3 is not."""
    config = json.loads((debug_config_json / "config.json").read_text())
    config.update(model_type="gemma3", architectures=["Gemma3ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_type='gemma3' is not a family this model reads; "
                                          "it reads llama, mistral, qwen2, qwen3"):
        validate(tmp_path)


def test_the_shape_comes_from_init_from_and_a_conflicting_override_is_refused(
        debug_config_json, tmp_path):
    """A base of a shape the preset does not know (multiple_of and ffn_dim_multiplier included):
    no model.* value to type; one given that differs is refused, naming it."""
    config = json.loads((debug_config_json / "config.json").read_text())
    config.update(hidden_size=320, intermediate_size=1000, num_hidden_layers=3,
                  num_attention_heads=5, num_key_value_heads=1, head_dim=64)
    config.pop("lingua_ffn", None)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    args = validate(other)
    m = args.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads) == (320, 3, 5, 1)
    assert Transformer(m).layers["0"].feed_forward.w1.weight.shape == (1000, 320)
    assert validate(other, "model.n_layers=3").model.n_layers == 3   # agreeing: fine
    with pytest.raises(ConfigError, match=r"differs from model.\* in .*'n_layers': \(2, 3\).*"
                                          r"remove `model.n_layers=2` from the command line"):
        validate(other, "model.n_layers=2")
    with pytest.raises(ConfigError, match=f"checkpoint.init_from={tmp_path / 'nowhere'} does "
                                          f"not exist"):
        validate(tmp_path / "nowhere")


def test_float8_with_lora_is_refused(debug_config_json):
    with pytest.raises(ConfigError, match="float8 training would replace the adapted layers"):
        validate(debug_config_json, "distributed.float8=tensorwise")


def test_packing_without_document_masks_is_refused_by_every_app(debug_config_json):
    """One rule in the core (lingua.launch.run.validate), for apps/sft and the llama app alike."""
    from apps.llama import train as llama_train
    from lingua.launch import run

    for app, base in ((train, [f"checkpoint.init_from={debug_config_json}"]),
                      (llama_train, ["data.format=chat"])):
        with pytest.raises(ConfigError, match="Set model.attn_mask=block_causal, or "
                                              "data.chat.pack=false"):
            run.validate(app.load_config([*base, "model.attn_mask=causal"], check=False),
                         app.APP, data_files=False)
        run.validate(app.load_config([*base, "model.attn_mask=causal", "data.chat.pack=false"],
                                     check=False), app.APP, data_files=False)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A tiny HF base, a small chat corpus, and one process's run on it (global batch 4)."""
    from apps.sft.prepare import write_base_model
    from lingua.data.chat import write_debug_chat
    from lingua.models.llama.model import LlamaArgs
    from tests.conftest import TINY_MODEL, run_python

    root = tmp_path_factory.mktemp("sft_chat")
    shape = {k.split("=")[0][len("model."):]: int(k.split("=")[1]) for k in TINY_MODEL}
    base = write_base_model(root / "base", LlamaArgs(**shape))
    chat = write_debug_chat(root / "chat", n_train=200, n_val=64)   # >= 8 packed rows

    def args(dump, *extra):
        return [f"dump_dir={dump}", f"data.root={chat}", f"checkpoint.init_from={base}",
                "data.prepare_embedded=false", "data.seq_len=256", "data.val_sequences=8",
                "steps=4", "optim.warmup=2", "optim.lr=3e-3", "logging.every=1", "eval.every=4",
                "checkpoint.every=0", *TINY_MODEL, "model.max_seq_len=256", "lora.rank=4",
                "lora.targets=[wq,wv,w2]", *extra]

    reference = root / "reference"
    run_python("apps.sft.train", args(reference, "data.batch_size=4"))
    return args, reference


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.dp_shard=2", "data.batch_size=2"]),
    (2, ["distributed.dp_shard=2", "data.batch_size=1", "data.grad_accum=2"]),
    (2, ["distributed.cp=2", "distributed.dp_shard=1", "data.batch_size=4"]),
], ids=["fsdp2", "fsdp2_accum2", "cp2"])
def test_chat_data_trains_alike_on_every_layout(chat_run, tmp_path, nproc, layout):
    """Packed conversations with answer-only targets: each step's loss is the mean over the
    global batch's counted targets, whichever rank and micro-batch holds them (a per-rank or
    per-micro-batch mean would move the gradient norm), and documents stay apart under cp."""
    from tests.conftest import run_torchrun
    from tests.equivalence import assert_equivalent, read_rows

    args, reference = chat_run
    run_torchrun(nproc, "apps.sft.train", args(tmp_path / "run", *layout))
    assert_equivalent(tmp_path / "run", reference)
    # Validation over the held-out answers, at the last step
    assert read_rows(tmp_path / "run")[-1]["val_loss"] == pytest.approx(
        read_rows(reference)[-1]["val_loss"], rel=1e-5)


@pytest.mark.slow   # two runs (its own and chat_run's reference): not the quick tier
def test_the_gradient_is_that_of_the_mean_over_answer_tokens(chat_run, tmp_path):
    """Full fine-tuning, one step: the logged gradient norm is the norm of the gradient of
    transformers' mean cross-entropy over the step's answer tokens (padded rows, causal), so the
    loss is divided by the global batch's counted targets, not by its tokens."""
    import torch
    from transformers import LlamaForCausalLM

    from lingua.data.chat import ChatLoader
    from lingua.model.loss import IGNORE_INDEX
    from tests.conftest import run_python
    from tests.equivalence import read_rows

    args, _ = chat_run
    overrides = ["data.batch_size=4", "lora.rank=0", "steps=1", "data.chat.pack=false",
                 "model.attn_mask=causal"]
    run_python("apps.sft.train", args(tmp_path / "run", *overrides))
    config = train.load_config(args(tmp_path / "run", *overrides), check=False)
    batch = ChatLoader(config.data, 0, 1, config.seed).next_step()[0]
    model = LlamaForCausalLM.from_pretrained(config.checkpoint.init_from)
    logits = model(batch.tokens).logits
    counted = batch.labels != IGNORE_INDEX
    torch.nn.functional.cross_entropy(logits[counted], batch.labels[counted]).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert read_rows(tmp_path / "run")[0]["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
