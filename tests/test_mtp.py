"""apps/mtp: multi-token prediction (DeepSeek-V3 style), a fork of apps/llama made by the recipe
of docs/forking.md with no edit under lingua/ (its objective goes through the trainer's loss seam).

Checked here: the targets and the loss against a hand-written reference (explicit shifts, no
shared code with apps/mtp/train.py), the main path against apps/llama's model with the same
weights (what generation and validation use), equivalence with one process under fsdp x tp, pp
and cp through tests/equivalence.py, exact resume, generation and HF export of the main model.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from apps.mtp import train
from apps.mtp.model import MTPArgs, Transformer
from lingua.models.llama.model import LlamaArgs
from lingua.models.llama.model import Transformer as Llama
from tests.conftest import run_python, run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows

SMALL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, multiple_of=16,
             max_seq_len=32)
STEPS = 4
MTP_KEYS = {"mtp/": 1e-5}       # every depth's cross-entropy, compared like the loss
FOUR_LAYERS = ["model.n_layers=4", "model.mtp_depth=2"]


def test_targets_look_ahead_and_pad_past_the_end():
    labels = torch.tensor([[1, 2, 3, 4, 5]])
    inputs, target = train.batch_inputs(torch.zeros_like(labels), labels, depth=2)
    assert target.tolist() == [[[1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, -100], [5, -100, -100]]]
    # module k (1-based) embeds t_{i+k} = labels[i + k - 1]; padding (target ignored) is token 0
    assert inputs["future_tokens"].tolist() == [[[1, 2], [2, 3], [3, 4], [4, 5], [5, 0]]]


def test_loss_is_next_token_plus_weighted_mean_of_the_depths():
    torch.manual_seed(0)
    args = MTPArgs(**SMALL, mtp_depth=2, mtp_loss_weight=0.5)
    model = Transformer(args)
    tokens = torch.randint(0, 40, (2, 12))
    labels = torch.randint(0, 40, (2, 12))
    inputs, target = train.batch_inputs(tokens, labels, depth=2)
    out = train.mtp_loss(model(tokens, **inputs), target, weight=0.5)

    # Reference, written out: the main model, then each depth k on positions 0..S-1-k
    # with the embedding of t_{i+k} = labels[:, i+k-1], predicting labels[:, i+k].
    h = model.tok_embeddings(tokens)
    rope, mask = model.rope_and_mask(12, None, None, None, h.device)
    for layer in model.layers.values():
        h = layer(h, rope, mask)
    want = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), labels.flatten(),
                           reduction="sum")
    depth_ce = []
    for k, module in enumerate(model.mtp.values(), start=1):
        future = torch.zeros_like(labels)
        future[:, :12 - k + 1] = labels[:, k - 1:]
        h = module(h, model.mtp_embeddings(future), rope, mask)
        logits = model.output(model.norm(h))[:, :12 - k]
        depth_ce.append(F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten(),
                                        reduction="sum"))
    torch.testing.assert_close(out.loss_sum, want + 0.5 / 2 * (depth_ce[0] + depth_ce[1]))
    assert out.tokens == 24
    assert out.metrics["mtp/ce_2"][1] == 2 * (12 - 2)
    torch.testing.assert_close(out.metrics["mtp/ce_1"][0], depth_ce[0])


def test_main_path_is_llama_with_the_same_weights():
    """Without future tokens (generation, validation) the fork computes what apps/llama does."""
    torch.manual_seed(0)
    model = Transformer(MTPArgs(**SMALL, mtp_depth=1))
    llama = Llama(LlamaArgs(**SMALL))
    missing = llama.load_state_dict({k: v for k, v in model.state_dict().items()
                                     if not k.startswith("mtp")}, strict=True)
    assert not missing.missing_keys
    tokens = torch.randint(0, 40, (2, 10))
    torch.testing.assert_close(model(tokens), llama(tokens), rtol=0, atol=0)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("mtp_reference") / "run"
    train.main(tiny_args(corpus, dump, "data.batch_size=8", *FOUR_LAYERS, "checkpoint.every=2",
                         "checkpoint.keep=0", steps=STEPS))
    return dump


def test_trains_and_logs_each_depth(reference):
    rows = read_rows(reference)
    assert {"mtp/ce_0", "mtp/ce_1", "mtp/ce_2"} <= set(rows[0])
    first, last = rows[0], rows[-1]
    # `loss` is the next-token CE, as in every app; the objective adds 0.3 / 2 x the depths'
    # CEs (each a mean over its own targets: the identity holds up to the padded positions).
    assert last["loss"] == pytest.approx(last["mtp/ce_0"], rel=1e-6)
    assert last["mtp/objective"] == pytest.approx(
        last["mtp/ce_0"] + 0.15 * (last["mtp/ce_1"] + last["mtp/ce_2"]), rel=0.05)
    assert last["loss"] < first["loss"]
    assert "val_loss" in last


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, layout", [
    (4, ["distributed.dp_shard=2", "distributed.tp=2", "data.batch_size=4"]),
    (2, ["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=8",
         "distributed.pp_microbatches=4"]),
    (2, ["distributed.cp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
], ids=["fsdp2xtp2", "pp2", "cp2"])
def test_layout_matches_one_process(corpus, tmp_path, reference, nproc, layout):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.mtp.train", tiny_args(corpus, dump, *FOUR_LAYERS, *layout,
                                                    "checkpoint.every=2", "checkpoint.keep=0",
                                                    steps=STEPS))
    assert_equivalent(dump, reference, prefixes=MTP_KEYS)


def test_resume_is_exact(corpus, tmp_path, reference, capfd):
    dump = tmp_path / "run"
    shutil.copytree(reference, dump)
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    capfd.readouterr()
    train.main(tiny_args(corpus, dump, "data.batch_size=8", *FOUR_LAYERS, "checkpoint.every=2",
                         "checkpoint.keep=0", steps=STEPS))
    assert_resumed(dump, "".join(capfd.readouterr()), 2, first)
    assert_equivalent(dump, reference, rtol=0, prefixes={"mtp/": 0})


@pytest.mark.slow
def test_generate_and_export_use_the_main_model(reference, tmp_path):
    ckpt = reference / "checkpoints" / str(STEPS)
    out = run_python("apps.mtp.generate", [str(ckpt), "--prompt", "Once", "--max-new-tokens", "5"])
    assert "Once" in out.stdout
    run_python("apps.mtp.hf", ["export", str(ckpt), str(tmp_path / "hf")])
    header = (tmp_path / "hf" / "model.safetensors").read_bytes()
    names = set(json.loads(header[8:8 + int.from_bytes(header[:8], "little")])) - {"__metadata__"}
    assert "model.layers.3.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert not [n for n in names if "mtp" in n]


def test_probe_sees_the_mtp_modules(corpus, tmp_path):
    """The probe finds the MTP blocks' attention (lingua.model.layers.CoreAttention) and their
    projections like the main model's, with no MTP-specific code in lingua/observe/probe.py."""
    from lingua.observe import probe_report

    dump = tmp_path / "probed"
    train.main(tiny_args(corpus, dump, "probe.every=2", "data.batch_size=4", steps=2))
    modules = set(probe_report.read(dump)["module"])
    want = {"mtp.0.proj", "mtp.0.block.attention.core", "layers.1.attention.core"}
    assert want <= modules, sorted(modules)[:40]
