"""apps.sft's export (apps/sft/hf.py: the merged model, a PEFT adapter) and chat generation
(apps/sft/generate.py), against the Hugging Face clients: transformers reads the merged export,
PEFT the adapter, and both compute what our adapted model does; transformers' greedy decoding of
the export from the same chat prompt gives our tokens. One tiny LoRA run, trained a few steps so
the adapters are not zero, serves every test."""

import json
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaForCausalLM

from apps.sft import generate as sft_generate
from apps.sft import hf as sft_hf
from lingua.checkpoint import hf_files, integrity
from lingua.data.chat_template import BUILTIN_JINJA
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer
from lingua.model.lora import LoRAArgs, is_adapter
from lingua.models.llama.model import LlamaArgs
from tests.conftest import TINY_MODEL

pytestmark = pytest.mark.slow   # one training run (about 10 s) before the first test

RANK, ALPHA = 4, 8.0            # scale 2: alpha is not confused with rank
TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
HF_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle"]
CONVERSATIONS = [
    [{"role": "user", "content": "Spell tiger."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell é."},
     {"role": "assistant", "content": "é"}, {"role": "user", "content": "Again, twice."}],
]


def tiny_llama_args() -> LlamaArgs:
    kv = dict(item.removeprefix("model.").split("=") for item in TINY_MODEL)
    return LlamaArgs(**{k: int(v) for k, v in kv.items()}, vocab_size=258)


def write_sharp_base(path: Path) -> Path:
    """apps.sft.prepare's tiny Llama with large random weights: sharp logits make a wrong merge,
    scale or key name visible, and greedy decoding far from ties."""
    from apps.sft.prepare import write_base_model

    write_base_model(path, tiny_llama_args())
    weights = path / "model.safetensors"
    g = torch.Generator().manual_seed(0)
    tensors = {k: (1 + 0.1 * torch.randn(t.shape, generator=g)) if "norm" in k
               else 0.2 * torch.randn(t.shape, generator=g)
               for k, t in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return path


def write_chat(root: Path) -> Path:
    """Short conversations (the debug corpus's are longer than this model's rows)."""
    def conv(i):
        word = WORDS[i % len(WORDS)]
        messages = [{"role": "user", "content": f"Spell {word}."},
                    {"role": "assistant", "content": " ".join(word)}]
        if i % 2:
            messages.insert(0, {"role": "system", "content": "Be brief."})
        return json.dumps({"messages": messages})

    (root / "val").mkdir(parents=True)
    (root / "train.jsonl").write_text("\n".join(conv(i) for i in range(64)) + "\n")
    (root / "val" / "val.jsonl").write_text("\n".join(conv(i) for i in range(8)) + "\n")
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from apps.sft import train

    root = tmp_path_factory.mktemp("sft")
    base = write_sharp_base(root / "base")
    dump = root / "run"
    argv = [f"dump_dir={dump}", f"data.root={write_chat(root / 'chat')}", "data.format=chat",
            "data.prepare_embedded=false", f"checkpoint.init_from={base}", "steps=4",
            "data.seq_len=64", "data.batch_size=4", "data.val_sequences=8", "eval.every=0",
            "logging.every=1", "optim.lr=1e-2", "optim.warmup=1", *TINY_MODEL,
            f"lora.rank={RANK}", f"lora.alpha={ALPHA}", f"lora.targets=[{','.join(TARGETS)}]"]
    assert train.main(argv) == 0
    return {"root": root, "base": base, "dump": dump, "ckpt": dump / "checkpoints" / "4"}


@pytest.fixture(scope="module")
def ours(run):
    model, *_ = sft_hf.load_run(run["dump"])
    return model


@pytest.fixture(scope="module")
def merged(run):
    out = run["root"] / "merged"
    sft_hf.main(["export", str(run["dump"]), str(out)])
    return out


def tokens():
    return torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(3))


def logits_of(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.eval()(tokens()).logits


def test_adapters_trained(run, ours):
    """Not vacuous: the adapters moved, and the adapted model is not the base model."""
    b = [m.lora_b for m in ours.modules() if isinstance(m, sft_hf.LoRALinear)]
    assert len(b) == 2 * len(TARGETS) and all(t.abs().max() > 1e-3 for t in b)
    with torch.no_grad():
        base = LlamaForCausalLM.from_pretrained(run["base"])
        assert (logits_of(base) - ours(tokens())).abs().max() > 1e-2


def test_merged_export_matches_ours(merged, ours):
    hf = LlamaForCausalLM.from_pretrained(merged, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(logits_of(hf), ours(tokens()), atol=1e-4, rtol=0)
    names = load_file(str(merged / "model.safetensors"))
    assert not [k for k in names if "lora" in k]
    ids = {"bos_token_id": 256, "eos_token_id": 257}   # the byte tokenizer's, not Llama's 1, 2
    assert json.loads((merged / "generation_config.json").read_text()) == {
        **ids, "pad_token_id": 257}
    config = json.loads((merged / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids


def test_merged_export_renders_chats_as_we_do(run, merged):
    """tokenizer_config.json's chat_template (the built-in template in Jinja): transformers'
    apply_chat_template gives our ChatTemplate's ids, with and without the generation prompt."""
    from apps.sft.generate import load

    _, tok, template = load(run["dump"])
    hf_tok = AutoTokenizer.from_pretrained(merged)
    assert json.loads((merged / "tokenizer_config.json").read_text())["chat_template"] == \
        BUILTIN_JINJA
    for messages in CONVERSATIONS + [CONVERSATIONS[1][:3]]:
        for prompt in (False, True):
            theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=prompt,
                                                tokenize=True, return_dict=True)["input_ids"]
            assert list(theirs) == template.encode(messages, tok, prompt)[0]


def test_merged_export_bf16(run, tmp_path):
    sft_hf.main(["export", str(run["ckpt"]), str(tmp_path), "--dtype", "bf16"])
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(tmp_path / "model.safetensors")).values()} == \
        {torch.bfloat16}


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")   # inside peft
def test_peft_adapter(run, ours, tmp_path, capsys):
    from peft import PeftModel

    sft_hf.main(["export", str(run["dump"]), str(tmp_path), "--adapter-only"])
    assert "wrote a PEFT LoRA adapter" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [sft_hf.ADAPTER_CONFIG,
                                                         sft_hf.ADAPTER_WEIGHTS]
    config = json.loads((tmp_path / sft_hf.ADAPTER_CONFIG).read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout",
                                   "bias", "target_modules", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 8,
        "lora_dropout": 0.0, "bias": "none", "target_modules": HF_TARGETS,
        "base_model_name_or_path": str(run["base"])}
    tensors = load_file(str(tmp_path / sft_hf.ADAPTER_WEIGHTS))
    modules = [f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
        [f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
    expected = {f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight"
                for i in range(2) for m in modules for ab in "AB"}
    assert set(tensors) == expected
    a = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert a.shape == (RANK, ours.layers["1"].feed_forward.w2.in_features) and b.shape == (64, 4)
    torch.testing.assert_close(b, ours.layers["1"].feed_forward.w2.lora_b.detach(), atol=0, rtol=0)

    peft_model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(run["base"]),
                                           tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(peft_model), ours(tokens()), atol=1e-4, rtol=0)


def test_generate_matches_transformers_greedy(run, merged, ours, capsys):
    """Our reply's ids (the CLI's text) = transformers' greedy decoding of the merged export from
    the same prompt ids, stopping alike (the export names our EOS)."""
    n = 24
    _, tok, template = sft_generate.load(run["dump"])
    hf = LlamaForCausalLM.from_pretrained(merged).eval()
    for messages in CONVERSATIONS:
        prompt, new = sft_generate.reply(ours, tok, template, messages, n)
        theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
        assert theirs[0, len(prompt):].tolist() == new
    assert sft_generate.turn_end_id(template, tok) == tok.eos_id   # the built-in closes with EOS

    conv = run["root"] / "conv.json"
    conv.write_text(json.dumps({"messages": CONVERSATIONS[1][1:3]}))
    sft_generate.main([str(run["dump"]), "--system", "Be brief.", "--messages-file", str(conv),
                       "--message", "Again, twice.", "--max-new-tokens", str(n),
                       "--device", "cpu"])
    _, new = sft_generate.reply(ours, tok, template, CONVERSATIONS[1], n)
    new = new[:-1] if new[-1] == tok.eos_id else new
    assert capsys.readouterr().out == tok.decode(new) + "\n"


# ---------------------------------------------------------------------------------------------
# Other runs: a full fine-tuning checkpoint (lora.rank=0) and one of apps.llama (no lora section),
# written as training writes them.


def fake_run(run, ours, root: Path, lora) -> Path:
    """A run directory with one checkpoint of the merged weights under `run`'s config, its lora
    section replaced by `lora` (None: dropped)."""
    cfg = OmegaConf.load(run["dump"] / "config.yaml")
    if lora is None:
        cfg.pop("lora")
    else:
        cfg.lora = lora
    cfg.dump_dir = str(root)
    ckpt = root / "checkpoints" / "1"
    trained = OmegaConf.load(run["dump"] / "config.yaml").lora
    merged = sft_hf.Merged(ours.state_dict(), LoRAArgs(**OmegaConf.to_container(trained)))
    plain = {k: merged[k] for k in ours.state_dict() if not is_adapter(k)}
    with warnings.catch_warnings():   # a single-process save is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": plain}, checkpoint_id=str(ckpt))
    for where in (root, ckpt):
        OmegaConf.save(cfg, where / "config.yaml")
    integrity.write_manifest(ckpt)
    return root


def cli(module, argv, capsys):
    """(exit code, stdout, stderr) of the command run in this process."""
    capsys.readouterr()   # what earlier calls printed (transformers' progress bars) is not its
    code = 0
    try:
        module.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_full_finetuning_export(run, ours, tmp_path, capsys):
    full = fake_run(run, ours, tmp_path / "full", {**asdict(sft_hf.LoRAArgs()), "rank": 0})
    code, out, err = cli(sft_hf, ["export", str(full), str(tmp_path / "hf")], capsys)
    assert code == 0, err
    model, *_ = sft_hf.load_run(full)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(logits_of(hf), model(tokens()), atol=1e-4, rtol=0)
        torch.testing.assert_close(model(tokens()), ours(tokens()), atol=1e-4, rtol=0)

    code, out, err = cli(sft_hf, ["export", str(full), str(tmp_path / "a"), "--adapter-only"],
                         capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and not out
    assert "full fine-tuning run (lora.rank=0)" in err and "drop --adapter-only" in err
    assert not (tmp_path / "a").exists()


def test_errors_say_what_and_how(run, ours, tmp_path, capsys):
    llama = fake_run(run, ours, tmp_path / "llama", None)
    missing = run["dump"] / "checkpoints" / "99"
    cases = [
        (sft_hf, ["export", str(llama), str(tmp_path / "out")],
         "has no lora section", "python -m apps.llama.hf export"),
        (sft_hf, ["export", str(llama), str(tmp_path / "out"), "--adapter-only"],
         "is not a fine-tuning run of apps.sft", "apps.llama.hf"),
        (sft_generate, [str(llama), "--message", "hi"], "has no lora section",
         "python -m apps.llama.generate"),
        (sft_hf, ["export", str(missing), str(tmp_path / "out")],
         f"no checkpoint 99 in {missing.parent}; the run has: 4.", "Give one of those"),
        (sft_generate, [str(missing), "--message", "hi"], "no checkpoint 99", "the run has: 4"),
        (sft_generate, [str(run["dump"])], "no conversation given", "--message TEXT"),
        (sft_generate, [str(run["dump"]), "--messages-file", str(tmp_path / "none.json")],
         "none.json does not exist", "--messages-file"),
        (sft_generate, [str(run["dump"]), "--message", "hi", "--max-new-tokens", "500"],
         "exceeds model.max_seq_len=128", "shorten"),
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "robot", "content": "x"}]))
    cases.append((sft_generate, [str(run["dump"]), "--messages-file", str(bad)],
                  "non-empty list of messages", "Fix --messages-file"))
    for module, argv, what, how in cases:
        code, out, err = cli(module, argv, capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert what in err and how in err and not out, (argv, err)
    assert not (tmp_path / "out").exists()


def test_jinja_template_run_exports_its_template(tmp_path):
    """A run trained with a Jinja template (data.chat.template) exports that template's text, and
    a one-token turn end that is not EOS ("\\n" here) stops generation beside EOS."""
    jinja = tmp_path / "chat.jinja"
    jinja.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant: {% endif %}")
    run_config = OmegaConf.create({"data": {"format": "chat", "chat": {"template": str(jinja)},
                                            "tokenizer": {"kind": "bytes"}}})
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    hf_files.write_tokenizer(run_config, out)
    sft_hf.write_chat_files(run_config, out)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == \
        jinja.read_text()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [10, 257]
    template = sft_generate.chat_template(run_config)
    tok = build_tokenizer(TokenizerArgs(kind="bytes"))
    hf_tok = AutoTokenizer.from_pretrained(out)
    for messages in CONVERSATIONS:
        theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        assert list(theirs) == template.encode(messages, tok, True)[0]


def test_generate_names_a_conversation_the_template_refuses(run, tmp_path, capsys):
    jinja = tmp_path / "strict.jinja"
    jinja.write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                     "{% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    ckpt = tmp_path / "run" / "checkpoints" / "4"
    shutil.copytree(run["ckpt"], ckpt)
    cfg = OmegaConf.load(ckpt / "config.yaml")
    cfg.data.chat.template = str(jinja)
    OmegaConf.save(cfg, ckpt / "config.yaml")
    integrity.write_manifest(ckpt)
    code, out, err = cli(sft_generate, [str(ckpt), "--system", "s", "--message", "hi"], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and not out, err
    assert "user first" in err and "Give a conversation that template accepts" in err
