"""apps/sft as a user meets it: the debug preset makes its inputs on first use and trains on chat
data (answer-only loss), and bad input (issue 34 point 7: the base model) is refused by the
config, before any process or file of the run exists. LoRA itself: tests/test_lora.py; chat data:
tests/test_chat_data.py; export and generation: tests/test_sft_hf.py."""

import json
import math
import os
import subprocess
import sys

import pytest

from apps.sft import train
from apps.sft.hf import llama_hf_config
from lingua.errors import ConfigError
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


def test_the_debug_preset_makes_its_inputs_and_trains_on_answers_only(tmp_path):
    """`python -m apps.sft.train` in a fresh directory: the base model and chat corpus appear
    under data/sft_debug, and step 1's logged loss (B = 0: the base model's) is transformers'
    cross-entropy of the base over the answer tokens of that step's conversations, not over all
    of their tokens. Padded rows and causal attention, so transformers sees what we do."""
    import torch
    from transformers import LlamaForCausalLM

    from lingua.model.loss import IGNORE_INDEX
    from lingua.train.chat_data import ChatLoader

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "apps.sft.train", "steps=2", "logging.every=1",
                           "eval.every=2", "dump_dir=run", "checkpoint.every=0",
                           "data.chat.pack=false", "model.attn_mask=causal"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    base = tmp_path / "data/sft_debug/base"
    assert (base / "model.safetensors").is_file()
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
    config = json.loads((debug_config_json / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="holds a MistralForCausalLM .model_type=mistral.; "
                                          "apps.sft fine-tunes LlamaForCausalLM only"):
        validate(tmp_path)


def test_a_base_of_another_shape_names_the_keys_to_set(debug_config_json):
    with pytest.raises(ConfigError, match=r"differs from model.\* in .*'n_layers': \(2, 4\).*"
                                          r"Add `model.n_layers=4`"):
        validate(debug_config_json, "model.n_layers=2")


def test_float8_with_lora_is_refused(debug_config_json):
    with pytest.raises(ConfigError, match="float8 training would replace the adapted layers"):
        validate(debug_config_json, "distributed.float8=tensorwise")


def test_packing_without_document_masks_is_refused(debug_config_json):
    with pytest.raises(ConfigError, match="Set model.attn_mask=block_causal, or "
                                          "data.chat.pack=false"):
        validate(debug_config_json, "model.attn_mask=causal")
    validate(debug_config_json, "model.attn_mask=causal", "data.chat.pack=false")
