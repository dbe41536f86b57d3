"""The sliding-window fork's tensor-parallel plan: LLaMA's (forked from
lingua/models/llama/parallelize.py) plus the learned sinks, sharded by head. The window needs no
line: it is the model's mask, which every rank applies to the heads it holds.

lingua.parallel.parallelize applies the plan (torchtitan's order, one FSDP unit per block). A
weight left out of the plan is refused at start with the line to add (lingua/parallel/coverage.py).
"""

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from lingua.parallel.parallelize import parallelize_decoder, uses_loss_parallel
from lingua.parallel.tp_plan import decoder_root_plan, gathered_input, validate_whole_heads

__all__ = ["HeadSharded", "parallelize_swa", "tp_plans", "uses_loss_parallel", "validate_tp"]
validate_tp = validate_whole_heads   # q/k/v and the sinks are sharded by head


class HeadSharded(ParallelStyle):
    """A per-head vector [n_heads] (the sinks), cut like wq's output: Shard(0), so tp rank r holds
    the logits of the heads its attention computes. The module hands attention its plain local
    part; the gradient stays a shard, as no other rank reads those heads."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)]))
        module.register_forward_hook(lambda _module, _inputs, out: out.to_local())
        return module


def tp_plans(model: nn.Module, loss_parallel: bool) -> tuple[dict, dict]:
    """(the decoder shell's root plan, the block's): LLaMA's Megatron-style plan with sequence
    parallelism, and the sinks split by head like q."""
    block = {
        "attention_norm": SequenceParallel(),
        "attention": gathered_input(),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gathered_input(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    if model.args.sinks:
        block["attention.sinks"] = HeadSharded()
    return decoder_root_plan(model, loss_parallel), block


def parallelize_swa(model: nn.Module, env, args) -> nn.Module:
    return parallelize_decoder(model, env, args, tp_plans)
