"""Qwen3, Qwen2/2.5 and Mistral in and out of Hugging Face (issue 55), against transformers itself:
tiny random models of shapes the project never made (Qwen3's head_dim != hidden / heads, Qwen2's
q/k/v biases and tied embeddings, Mistral's sliding window shorter than the sequence, norms away
from 1) read and written with equal logits; apps.sft fine-tunes each from nothing but
checkpoint.init_from (shape, tokenizer and chat template from the directory) exactly as a
transformers + torch AdamW loop does; its PEFT adapter loads in peft; its greedy generation is
transformers'; other families are refused before any work. Each family's directory is made
once, and each training run serves several checks."""

import json
import logging
import shutil

import pytest
import torch

from apps.llama import train as llama_train
from apps.sft import generate as sft_generate
from apps.sft import hf as sft_hf
from apps.sft import train as sft_train
from lingua.checkpoint import hf_files
from lingua.errors import ConfigError
from lingua.models.llama.hf import ARCHITECTURES, load_hf, save_hf
from tests.test_sft_hf import CONVERSATIONS, write_chat

# Qwen's ChatML, as its tokenizer_config.json writes it (without the tool-calling branches).
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
COMMON = {"num_hidden_layers": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
SHAPES = {   # shapes no preset has; the sequences below (12 and more tokens) pass mistral's window
    "qwen3": {"hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False},
    "qwen2": {"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4,
              "num_key_value_heads": 2, "tie_word_embeddings": True},
    "mistral": {"hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 6,
                "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 5,
                "tie_word_embeddings": False},
}
FAMILIES = list(SHAPES)
# eps 1e-6 (not 1e-8): Adam's step of a weight whose gradient is ~0 moves by up to lr / eps per
# unit of gradient, and float rounding differs between the two models (a 1e-5 gap at 1e-8).
LR, WD, EPS, STEPS = 3e-3, 0.1, 1e-6, 3
# The lr factor of each step under optim.warmup=1 and the cosine schedule to lr_min_ratio 0.1:
# (step + 1) / (warmup + 1), then 0.1 + 0.9 * (1 + cos(pi * (step - 1) / 2)) / 2.
FACTORS = [0.5, 1.0, 0.55]


def hf_model(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kw).eval()


def write_tokenizer(root):
    """A byte-level BPE learnt from the chat corpus, with Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([(root / "chat" / "train.jsonl").read_text()] * 5, trainer)
    tok.save(str(root / "tokenizer.json"))
    return tok.get_vocab_size()


def write_family(out, family: str, vocab: int, tokenizer_json, seed: int):
    """A transformers model of the family with random weights (norms 1 + 0.3 N, biases 0.2 N):
    its save_pretrained directory, the tokenizer beside it, and for Qwen a ChatML
    tokenizer_config.json (Mistral's directory has none: the built-in template)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=vocab, **COMMON, **SHAPES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    if family.startswith("qwen"):
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
             "eos_token": "<|im_end|>", "chat_template": CHATML}))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    write_chat(root / "chat")
    vocab = write_tokenizer(root)
    out = {"root": root, "chat": root / "chat", "vocab": vocab}
    for seed, family in enumerate(FAMILIES):
        out[family] = write_family(root / family, family, vocab, root / "tokenizer.json", seed)
    return out


def tokens(vocab, length=12):
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------------
# a. The weights, read and written


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_both_ways(dirs, family, tmp_path):
    x = tokens(dirs["vocab"])
    ours, args = load_hf(dirs[family])
    theirs = hf_model(dirs[family])
    assert args.family == family
    assert (args.qk_norm, args.qkv_bias, args.window, args.tie_embeddings) == {
        "qwen3": (True, False, None, False), "qwen2": (False, True, None, True),
        "mistral": (False, False, 5, False)}[family]
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, atol=1e-5, rtol=0)
        save_hf(ours, args, tmp_path)
        back = hf_model(tmp_path)
        assert type(back).__name__ == ARCHITECTURES[family]
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# e. Other families: refused by load_config, before anything is written


@pytest.mark.parametrize("model_type", ["gemma3", "qwen3_moe"])
def test_another_family_is_refused_before_any_work(dirs, tmp_path, model_type):
    config = json.loads((dirs["qwen3"] / "config.json").read_text())
    config.update(model_type=model_type, architectures=["SomethingForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    dump = tmp_path / "run"
    for app in (sft_train, llama_train):
        with pytest.raises(ConfigError, match=f"model_type='{model_type}' is not a family this "
                                              "model reads; it reads llama, mistral, qwen2, "
                                              r"qwen3 \(apps/moe reads .*qwen3_moe"):
            app.main([f"checkpoint.init_from={tmp_path}", f"dump_dir={dump}",
                      f"data.root={dirs['chat']}"])
        assert not dump.exists()


# ---------------------------------------------------------------------------------------------
# f. The tokenizer from the directory, unless the command line names one


def test_the_tokenizer_comes_from_init_from(dirs, tmp_path, caplog):
    base = dirs["qwen3"]
    for app in (sft_train, llama_train):
        args = app.load_config([f"checkpoint.init_from={base}"], check=False)
        assert (args.data.tokenizer.kind, args.data.tokenizer.path) == (
            "hf", str(base / "tokenizer.json"))
        assert (args.model.family, args.model.head_dim, args.model.qk_norm) == ("qwen3", 16, True)
    # Issue 58: its own tokenizer.json named, the preset's kind (bytes) left: still the directory's
    for app in (sft_train, llama_train):
        args = app.load_config([f"checkpoint.init_from={base}",
                                f"data.tokenizer.path={base / 'tokenizer.json'}"], check=False)
        assert (args.data.tokenizer.kind, args.data.tokenizer.path) == (
            "hf", str(base / "tokenizer.json"))
    given = ["data.tokenizer.kind=hf", f"data.tokenizer.path={dirs['root'] / 'tokenizer.json'}"]
    args = sft_train.load_config([f"checkpoint.init_from={base}", *given], check=False)
    assert args.data.tokenizer.path == str(dirs["root"] / "tokenizer.json")
    # Without tokenizer.json: the preset's, said in a warning
    shutil.copyfile(base / "config.json", tmp_path / "config.json")
    preset = ["config=llama_8b_lora"]   # kind hf
    with caplog.at_level(logging.WARNING):
        args = sft_train.load_config([f"checkpoint.init_from={tmp_path}"], check=False)
    assert args.data.tokenizer.kind == "bytes"
    assert f"{tmp_path} has no tokenizer.json: training reads data with data.tokenizer." \
           "kind=bytes" in caplog.text
    # The byte tokenizer's export (apps.llama's debug runs) reads back as the byte tokenizer
    hf_files.byte_tokenizer_json().save(str(tmp_path / "tokenizer.json"))
    for named in ([], [f"data.tokenizer.path={tmp_path / 'tokenizer.json'}"]):
        args = sft_train.load_config([f"checkpoint.init_from={tmp_path}", *preset, *named],
                                     check=False)
        assert (args.data.tokenizer.kind, args.data.tokenizer.path) == ("bytes", None)


def test_a_tokenizer_that_disagrees_or_outgrows_the_embedding_is_refused_before_any_work(
        dirs, tmp_path):
    """Issue 58: a kind that does not read data.tokenizer.path, and a vocabulary larger than
    init_from's embedding (also when its tokenizer.json is named), refused by main with nothing
    written."""
    base, tok, dump = dirs["qwen3"], dirs["qwen3"] / "tokenizer.json", tmp_path / "run"
    common = [f"dump_dir={dump}", f"data.root={dirs['chat']}", "data.prepare_embedded=false",
              "steps=1"]
    with pytest.raises(ConfigError, match=f"data.tokenizer.path={tok} is set, but data.tokenizer."
                                          "kind=bytes reads no file. Set data.tokenizer.kind=hf"):
        sft_train.main([f"checkpoint.init_from={base}", "data.tokenizer.kind=bytes",
                        f"data.tokenizer.path={tok}", *common])
    other = dirs["root"] / "tokenizer.json"   # another file: the preset's kind (bytes) is kept
    with pytest.raises(ConfigError, match=f"path={other} is set.*Set data.tokenizer.kind=hf"):
        sft_train.main([f"checkpoint.init_from={base}", f"data.tokenizer.path={other}", *common])
    small = tmp_path / "small"   # its config.json's embedding one row short of its tokenizer
    small.mkdir()
    config = json.loads((base / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": dirs["vocab"] - 1}))
    shutil.copyfile(tok, small / "tokenizer.json")
    for named in ([], [f"data.tokenizer.path={small / 'tokenizer.json'}"]):
        with pytest.raises(ConfigError, match=f"has {dirs['vocab']} tokens but model.vocab_size="
                                              f"{dirs['vocab'] - 1}: its ids would run past"):
            sft_train.main([f"checkpoint.init_from={small}", *named, *common])
    assert not dump.exists()


# ---------------------------------------------------------------------------------------------
# b, c, d, f. Fine-tuning runs


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def sft_argv(dirs, family, dump, *extra):
    return [f"dump_dir={dump}", f"data.root={dirs['chat']}", "data.format=chat",
            "data.prepare_embedded=false", f"checkpoint.init_from={dirs[family]}",
            f"steps={STEPS}", "data.seq_len=64", "data.batch_size=4", "data.val_sequences=8",
            "eval.every=0", "logging.every=1", f"optim.lr={LR}", "optim.warmup=1",
            "optim.scheduler=cosine", "optim.lr_min_ratio=0.1", f"optim.weight_decay={WD}",
            f"optim.eps={EPS}",
            "optim.clip=1.0", "distributed.model_dtype=fp32", "model.attn_mask=causal",
            "data.chat.pack=false", *extra]


@pytest.fixture(scope="module")
def sft_run(dirs):
    """sft_run(family, lora) -> (argv, run dir, the chat loader's log lines), each run once."""
    runs = {}

    def get(family, lora):
        if (family, lora) not in runs:
            dump = dirs["root"] / f"run_{family}_{lora}"
            extra = ([f"lora.rank={lora}", "lora.alpha=8", "lora.targets=[wq,wk,wv,wo,w1,w2,w3]"]
                     if lora else ["lora.rank=0"])
            if family == "qwen3" and not lora:   # issue 58's command: the kind left as bytes
                extra.append(f"data.tokenizer.path={dirs[family] / 'tokenizer.json'}")
            argv = sft_argv(dirs, family, dump, *extra)
            lines = Lines()
            logging.getLogger("lingua.data.chat").addHandler(lines)
            try:
                assert sft_train.main(argv) == 0
            finally:
                logging.getLogger("lingua.data.chat").removeHandler(lines)
            runs[family, lora] = argv, dump, lines.lines
        return runs[family, lora]
    return get


def reference_finetuning(argv):
    """transformers + torch AdamW on the run's batches: decay on matrices only, the lr factors
    above, clipping at norm 1; the loss is the mean over the batch's answer tokens. (losses,
    model)."""
    from lingua.data.chat import ChatLoader
    from lingua.model.loss import IGNORE_INDEX

    config = sft_train.load_config(argv, check=False)
    loader = ChatLoader(config.data, 0, 1, config.seed)
    model = hf_model(config.checkpoint.init_from).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    losses = []
    for factor in FACTORS:
        batch = loader.next_step()[0]
        counted = batch.labels != IGNORE_INDEX
        logits = model(batch.tokens).logits
        loss = torch.nn.functional.cross_entropy(logits[counted], batch.labels[counted])
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = LR * factor
        opt.step()
        opt.zero_grad()
    return losses, model


@pytest.mark.slow   # three trainer runs and their transformers references (about 4 s)
@pytest.mark.parametrize("family", FAMILIES)
def test_full_finetuning_equals_transformers_and_adamw(dirs, sft_run, family):
    """b: losses of each step and the exported weights equal the reference loop's; f: the run
    read the directory's tokenizer and its template (Mistral's directory has none: the built-in
    one), and its log says so."""
    argv, dump, lines = sft_run(family, 0)
    losses, reference = reference_finetuning(argv)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows if "loss" in r] == pytest.approx(losses, rel=0, abs=1e-5)
    out = dirs["root"] / f"merged_{family}"
    sft_hf.main(["export", str(dump), str(out)])
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        ARCHITECTURES[family]]
    exported = dict(hf_model(out).named_parameters())
    base = dict(hf_model(dirs[family]).named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(exported[name], p, atol=1e-5, rtol=0, msg=name)
    moved = max((p - base[n]).abs().max().item() for n, p in reference.named_parameters())
    assert moved > 1e-3   # the steps changed the weights: equal is not equal to the base

    tok = dirs[family] / "tokenizer.json"
    run_config = (dump / "config.yaml").read_text()
    assert f"kind: hf\n    path: {tok}" in run_config
    template = (f"{dirs[family] / 'tokenizer_config.json'}" if family.startswith("qwen")
                else "the built-in chat template")
    assert [line for line in lines if line.startswith("chat data:")][0].endswith(
        f"the hf tokenizer {tok} ({dirs['vocab']} tokens), template: {template}")


@pytest.mark.slow   # the full fine-tuning runs' exports (test above) plus transformers' generate
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers(dirs, sft_run, family):
    """d: our KV-cache decoding of the run = transformers' generate on its merged export, from the
    same chat prompt, well past Mistral's window of 5."""
    argv, dump, _ = sft_run(family, 0)
    out = dirs["root"] / f"merged_{family}"
    if not out.is_dir():
        sft_hf.main(["export", str(dump), str(out)])
    model, tok, template = sft_generate.load(dump)
    hf = hf_model(out)
    for messages in CONVERSATIONS:
        prompt, new = sft_generate.reply(model, tok, template, messages, 16)
        theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
        assert theirs[0, len(prompt):].tolist() == new
        assert len(prompt) + len(new) > 12


@pytest.mark.slow   # three LoRA trainer runs (about 5 s)
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")   # inside peft
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_gives_our_logits(dirs, sft_run, family, tmp_path):
    """c: the adapter (all seven Linears, Qwen2's biased ones included) on the base in peft
    computes what our adapted model does; the base's biases stay in the base."""
    from peft import PeftModel

    _, dump, _ = sft_run(family, 4)
    sft_hf.main(["export", str(dump), str(tmp_path), "--adapter-only"])
    config = json.loads((tmp_path / sft_hf.ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                        "up_proj", "v_proj"]
    ours = sft_hf.load_run(dump)[0]
    peft_model = PeftModel.from_pretrained(hf_model(dirs[family]), tmp_path).eval()
    x = tokens(dirs["vocab"], 16)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, ours(x), atol=1e-5, rtol=0)
        assert (hf_model(dirs[family])(x).logits - ours(x)).abs().max() > 1e-3   # adapters moved


# ---------------------------------------------------------------------------------------------
# Continued pretraining (apps.llama) from a family's directory, exported back as that family


@pytest.mark.slow   # a trainer run and an export (about 3 s)
def test_continued_pretraining_trains_and_exports_the_family(dirs, tmp_path):
    """apps.llama from the Qwen3 directory and a corpus of its tokenizer: nothing else typed. The
    first step's loss is transformers' mean cross-entropy on that batch; the export is a
    Qwen3ForCausalLM with the directory's tokenizer beside it and the trained weights."""
    from apps.llama import hf as llama_hf
    from lingua.data import build_train_loader, write_memmap_corpus
    from lingua.data.tokenizer import TokenizerArgs, build_tokenizer

    base = dirs["qwen3"]
    tok_args = TokenizerArgs("hf", str(base / "tokenizer.json"))
    texts = (dirs["chat"] / "train.jsonl").read_text().splitlines()
    corpus = tmp_path / "corpus"
    write_memmap_corpus(corpus, {"train": iter(texts), "val": iter(texts[:8])},
                        build_tokenizer(tok_args), tok_args, source="chat lines")
    argv = [f"dump_dir={tmp_path / 'run'}", f"data.root={corpus}", f"checkpoint.init_from={base}",
            "data.prepare_embedded=false", "steps=2", "data.seq_len=32", "data.batch_size=4",
            "eval.every=0", "logging.every=1", "optim.lr=1e-2", "optim.warmup=0",
            "distributed.model_dtype=fp32"]
    assert llama_train.main(argv) == 0
    config = llama_train.load_config(argv)
    batch = build_train_loader(config.data, 0, 1, config.seed).next_step()[0]
    with torch.no_grad():
        logits = hf_model(base)(batch.tokens).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(expected.item(), abs=1e-5)

    out = tmp_path / "export"
    llama_hf.main(["export", str(tmp_path / "run"), str(out)])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    trained, before = hf_model(out).state_dict(), hf_model(base).state_dict()
    assert trained.keys() == before.keys()
    assert max((trained[k] - before[k]).abs().max().item() for k in before) > 1e-3
