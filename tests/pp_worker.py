"""Worker for tests/test_pipeline.py: run under torchrun, one rank per pipeline rank.

`python -m torch.distributed.run --nproc-per-node 2 tests/pp_worker.py OUT_DIR CASES_JSON`
Each case (schedule, virtual stages, micro-batches, split, mask) builds the same tiny model on
every rank, computes a single-process reference loss and gradients, then runs the pipeline and
writes what it measured to OUT_DIR/rank<r>.json; the test compares.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lingua.model.layers import inferring_shapes
from lingua.model.loss import token_loss_sum
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.parallel.distributed import exit_process
from lingua.parallel.pipeline import (
    build_schedule,
    split_model,
    stage_ids_of_rank,
    stage_layer_ids,
)

BATCH, SEQ, VOCAB = 4, 16, 258


def make_model(attn_mask: str) -> Transformer:
    args = LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=32, vocab_size=VOCAB,
                     max_seq_len=32, attn_mask=attn_mask)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def make_batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    doc_ids = (torch.rand(BATCH, SEQ, generator=g) < 0.2).long().cumsum(1)
    return tokens, labels, doc_ids


def grad_errors(parts, ref_grads) -> dict:
    """Per parameter: max |grad - reference| and max |reference|."""
    out = {}
    for part in parts:
        for name, p in part.named_parameters():
            ref = ref_grads[name]
            got = p.grad if p.grad is not None else torch.zeros_like(ref)
            out[name] = [(got - ref).abs().max().item(), ref.abs().max().item()]
    return out


def run_case(case: dict, rank: int, pp: int) -> dict:
    block_causal = case.get("block_causal", False)
    model = make_model("block_causal" if block_causal else "causal")
    tokens, labels, doc_ids = make_batch()
    doc_ids = doc_ids if block_causal else None
    n_tokens = labels.numel()

    virtual = case["virtual"]
    n_stages = pp * virtual
    layers = stage_layer_ids(model.args.n_layers, n_stages, case.get("split", []))
    ids = stage_ids_of_rank(rank, pp, virtual, case["schedule"])
    parts = [split_model(model, layers[s], s == 0, s == n_stages - 1) for s in ids]

    # Single-process reference: the whole batch at once.
    ref_loss = token_loss_sum(model(tokens, doc_ids), labels) / n_tokens
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}

    recorded = []   # what a recording loss_fn (the trainer's logged loss) sees of a step

    def loss_fn(output, target):
        loss = token_loss_sum(output, target) / n_tokens
        if not inferring_shapes():
            recorded.append(loss.item())
        return loss

    pipe = build_schedule(parts, ids, n_stages, dist.group.WORLD, "cpu", case["schedule"],
                          case["microbatches"], loss_fn)
    result = {"ref_loss": ref_loss.item(), "stage_ids": ids,
              "fqns": [n for part in parts for n, _ in part.named_parameters()]}
    loss = pipe.step(tokens, labels, doc_ids)
    result["loss"] = None if loss is None else loss.item()
    result["recorded"] = recorded.copy()
    result["grads"] = grad_errors(parts, ref_grads)
    ev = pipe.eval_loss(tokens, labels, doc_ids)
    result["eval"] = None if ev is None else ev.item()
    # Another batch shape than training: the same sequences twice gives twice the loss.
    twice = [None if t is None else torch.cat([t, t]) for t in (tokens, labels, doc_ids)]
    ev = pipe.eval_loss(*twice)
    result["eval_twice"] = None if ev is None else ev.item()
    # A second step after evaluation: the schedule must switch back to training cleanly.
    for part in parts:
        part.zero_grad(set_to_none=True)
    loss = pipe.step(tokens, labels, doc_ids)
    result["loss2"] = None if loss is None else loss.item()
    result["grads2"] = grad_errors(parts, ref_grads)
    # Gradient accumulation: a third step without zeroing adds the same gradients again.
    pipe.step(tokens, labels, doc_ids)
    result["grads_accum"] = grad_errors(parts, {n: 2 * g for n, g in ref_grads.items()})
    return result


def main():
    out_dir, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {}
    for case in cases:
        results[case["name"]] = run_case(case, rank, pp)
        dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    exit_process(0)  # results are written; gloo can abort interpreter teardown (it says why)


if __name__ == "__main__":
    main()
