"""Worker for tests/test_context_parallel.py: run under torchrun with N ranks (the cp group).

Every rank builds the same tiny model and full batch (same seeds), runs a single-process
reference, then the context-parallel forward/backward of its shard, sums loss and gradients over
the cp group (as FSDP over dp_shard x cp will), gathers the logits, and writes the relative errors
against the reference as JSON (rank 0). Usage: cp_worker.py OUT_JSON [ring]
"""

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.parallel.context_parallel import apply_cp, cp_batch
from lingua.parallel.distributed import apply_ac, exit_process

BATCH, SEQ = 2, 32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_batch(vocab: int, device):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(vocab, (BATCH, SEQ), generator=g)
    # Several documents per row, with boundaries that do not line up with the cp chunks.
    starts = torch.rand(BATCH, SEQ, generator=g) < 0.15
    starts[:, 0] = True
    doc_ids = starts.long().cumsum(1)
    return tokens.to(device), labels.to(device), doc_ids.to(device)


def loss_fn(logits, labels, n_tokens):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                           reduction="sum") / n_tokens


def grads(model):
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad
            for n, p in model.named_parameters()}


def reference(model, tokens, labels, doc_ids):
    logits = model(tokens, doc_ids)
    loss = loss_fn(logits, labels, labels.numel())
    loss.backward()
    return loss.detach(), logits.detach(), grads(model)


def cp_run(model, tokens, labels, doc_ids, group, explicit_positions):
    size = dist.get_world_size(group)
    with cp_batch(model, tokens, labels, doc_ids) as b:
        # explicit_positions=False exercises apply_cp's hook (how a later pipeline stage gets them).
        logits = model(b.tokens, positions=b.positions) if explicit_positions else model(b.tokens)
        loss = loss_fn(logits, b.labels, labels.numel())
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss, group=group)
    g = grads(model)
    for t in g.values():
        dist.all_reduce(t, group=group)
    pieces = [torch.empty_like(logits) for _ in range(size)]
    pos = [torch.empty_like(b.positions) for _ in range(size)]
    dist.all_gather(pieces, logits.detach().contiguous(), group=group)
    dist.all_gather(pos, b.positions, group=group)
    full = torch.cat(pieces, 1).index_select(1, torch.argsort(torch.cat(pos)))
    return loss, full, g


def compare(ref, got):
    (loss_r, logits_r, grads_r), (loss_c, logits_c, grads_c) = ref, got
    return {
        "loss_ref": loss_r.item(), "loss_cp": loss_c.item(),
        "loss_rel": abs(loss_c.item() - loss_r.item()) / abs(loss_r.item()),
        "logits_rel": rel(logits_c, logits_r),
        "grads_rel": max(rel(grads_c[n], grads_r[n]) for n in grads_r),
        "n_grads": len(grads_c),
    }


def main():
    out, ring = sys.argv[1], "ring" in sys.argv[2:]
    if ring:
        dist.init_process_group("nccl")
        device = torch.device("cuda", dist.get_rank())
        torch.cuda.set_device(device)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    group = mesh["cp"].get_group()
    torch.manual_seed(0)
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)
    base = Transformer(args).to(device)
    tokens, labels, doc_ids = make_batch(args.vocab_size, device)

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    # name: (doc masking, activation checkpointing, dtype, explicit positions)
    cases = {"causal": (False, "none", "fp32", True), "causal_bf16": (False, "none", "bf16", False)}
    if not ring:  # torch's ring attention has no document masking (validate_cp refuses it)
        cases.update({"doc": (True, "none", "fp32", False),
                      "doc_ac_full": (True, "full", "fp32", False),
                      "doc_ac_op": (True, "op", "fp32", True),
                      "doc_bf16": (True, "none", "bf16", True)})
    results = {}
    for name, (docs, ac, dtype, explicit) in cases.items():
        d = doc_ids if docs else None
        ref_model = copy.deepcopy(base).to(dtypes[dtype])
        cp_model = apply_cp(copy.deepcopy(ref_model), mesh["cp"], "ring" if ring else "allgather")
        apply_ac(cp_model.layers, ac)
        ref = reference(ref_model, tokens, labels, d)
        results[name] = compare(ref, cp_run(cp_model, tokens, labels, d, group, explicit))

    if not ring:
        try:
            cp_model(tokens)
            results["outside_error"] = ""
        except RuntimeError as e:
            results["outside_error"] = str(e)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # results are written; gloo can abort interpreter teardown (it says why)


if __name__ == "__main__":
    main()
