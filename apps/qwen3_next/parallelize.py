"""How the Qwen3-Next model is parallelized: tensor and expert parallelism here, then
lingua.parallel.parallelize's generic rest (AC, compile, FSDP with the experts inside each block's
unit) as apps/moe's. Pipeline parallelism needs nothing here: the decoder shell splits by layers
and each block keeps its kind (layer_id decides full or linear attention).

Tensor parallelism (Megatron style with sequence parallelism, lingua/parallel/tp_plan.py): each
block half all-gathers the sequence, its input projections are column-sharded by head and its
output projection row-sharded back to the rank's sequence shard. Two block plans, one per kind:
- gated full attention: q (each head's query rows and gate rows are adjacent, so a column shard
  holds whole heads with their gates), k and v by head, wo by rows; the QK-norm weight, shared
  by all heads, replicated with its gradient summed over tp (as LLaMA's attention_plan).
- Gated DeltaNet: q, k (key heads), v, z (value heads), b, a (one column per value head) by
  head, so rank r holds key heads r*hk/tp.. with exactly the value heads they serve; the q/k/v
  convolutions' channels, A_log and dt_bias split with their heads (HeadSharded); out_proj by
  rows. The recurrence runs per value head, so it needs no communication.
What stays whole: the gated output norm's weight (over head_v_dim, shared by all value heads:
replicated, its gradient summed over tp like the QK-norm's), the block and final norms (on the
sequence shard, summed likewise), and each MoE layer with its gated shared expert, which every tp
rank runs on the whole sequence (ReplicatedCompute, as apps/moe/parallelize.py says why).

Expert parallelism: the routed experts split over ep ranks taken from dp_shard
(lingua.parallel.expert_parallel); the shared expert stays with FSDP's block unit.

Context parallelism is refused (validate_layout): the Gated DeltaNet's recurrence and causal
convolution run along the whole sequence.
"""

from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from lingua.errors import ConfigError
from lingua.float8 import default_filter
from lingua.model.moe import moe_layers
from lingua.parallel import distributed
from lingua.parallel.distributed import DistEnv, DistributedArgs
from lingua.parallel.expert_parallel import apply_ep, apply_global_counts, ep_meshes, validate_ep
from lingua.parallel.parallelize import apply_cp_ac_compile_fsdp, uses_loss_parallel
from lingua.parallel.tensor_parallel import ReplicatedCompute, apply_tp
from lingua.parallel.tp_plan import decoder_root_plan, gathered_input, validate_whole_heads

__all__ = ["HeadSharded", "float8_filter", "parallelize_qwen3_next", "tp_plans",
           "validate_layout"]


def float8_filter(fqn: str, module: nn.Module) -> bool:
    """distributed.float8's choice of Linears: the default's, less the routers' and the gates'
    (tiny outputs that decide the routing, the shared expert's weight and the decay rates)."""
    return default_filter(fqn, module) and not fqn.endswith(
        ("router.gate", "shared_expert_gate", "linear_attention.wa", "linear_attention.wb"))


def refuse_cp(cp: int) -> None:
    if cp > 1:
        raise ConfigError(
            f"distributed.cp={cp}: apps.qwen3_next cannot run context parallelism: its Gated "
            "DeltaNet layers carry a recurrent state (and a causal convolution) from each token "
            "to the next across the whole sequence, so a rank holding one shard of it would need "
            "every earlier shard's final chunk state first. Set distributed.cp=1 and split the "
            "work with distributed.dp_shard, distributed.tp or distributed.pp instead (or "
            "shorten data.seq_len, or turn on activation checkpointing: distributed.ac).")


def validate_layout(args: DistributedArgs, model_args=None, seq_len: int | None = None) -> None:
    """Before any process group: cp refused, whole heads of both attention kinds per tp rank,
    experts dividing over ep; raises ConfigError naming the fix."""
    refuse_cp(args.cp)
    if model_args is None:
        return
    tp = args.tp
    for key in ("linear_key_heads", "linear_value_heads"):
        heads = getattr(model_args, key)
        if tp > 1 and heads % tp:
            raise ConfigError(
                f"model.{key}={heads} is not divisible by distributed.tp={tp}: tensor "
                "parallelism gives each rank whole Gated DeltaNet key heads with the value heads "
                f"they serve (linear_key_heads={model_args.linear_key_heads}, "
                f"linear_value_heads={model_args.linear_value_heads}). Use a tp that divides "
                f"both, or change model.{key}.")
    validate_whole_heads(model_args, tp, seq_len)
    dims = distributed.parallel_dims(args, distributed.world_size_from_env())
    validate_ep(model_args.n_experts, args.ep, dims.dp_shard, dims.cp)


class HeadSharded(ParallelStyle):
    """Parameters of a module that are not a Linear's but hold one slice per head along dim 0
    (a depthwise convolution's channels, A_log and dt_bias): Shard(0) over tp, cut as the columns
    of the projections that feed them, so rank r holds its own heads'. The module computes on the
    plain local parts (swapped in for its forward; a depthwise Conv1d also counts its local
    channels), and each gradient stays a shard: no other rank reads those heads."""

    def __init__(self, names=("weight",), input_style: ParallelStyle | None = None):
        super().__init__()
        self.names, self.input_style = tuple(names), input_style

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.input_style is not None:   # a plan has one entry per module: the input's too
            self.input_style._apply(module, device_mesh)
        for name in self.names:
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [Shard(0)]), param.requires_grad))
        if isinstance(module, nn.Conv1d):
            assert module.groups == module.in_channels == module.out_channels, "depthwise only"
            module.groups = module.in_channels = module.out_channels = (
                module.groups // device_mesh.size())
        forward, names = module.forward, self.names

        def local_forward(*args, **kwargs):
            # Read at call time: FSDP swaps in its unsharded parameters before the block runs.
            held = {n: module._parameters[n] for n in names}
            module._parameters.update({n: p.to_local() if isinstance(p, DTensor) else p
                                       for n, p in held.items()})
            try:
                return forward(*args, **kwargs)
            finally:
                module._parameters.update(held)

        module.forward = local_forward
        return module


def _per_head_norm() -> SequenceParallel:
    # A weight shared by all heads, on an input split by head (dim 2): replicated, grad summed.
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def _row_out() -> RowwiseParallel:
    return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)


def block_plans() -> tuple[dict, dict]:
    """(full-attention block plan, Gated DeltaNet block plan); module docstring."""
    common = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
              # ReplicatedCompute: Shard(1) in -> whole sequence, Replicate -> Shard(1) out.
              "moe": ReplicatedCompute()}
    full = {**common, "attention": gathered_input(),
            **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            "attention.wo": _row_out(),
            "attention.q_norm": _per_head_norm(), "attention.k_norm": _per_head_norm()}
    linear = {**common,
              "linear_attention": HeadSharded(("A_log", "dt_bias"), input_style=gathered_input()),
              **{f"linear_attention.{w}": ColwiseParallel()
                 for w in ("wq", "wk", "wv", "wz", "wb", "wa")},
              **{f"linear_attention.{c}": HeadSharded() for c in ("q_conv", "k_conv", "v_conv")},
              "linear_attention.norm": _per_head_norm(),
              "linear_attention.out_proj": _row_out()}
    return full, linear


def tp_plans(model: nn.Module, loss_parallel: bool) -> tuple:
    """(root_plan, full-attention block plan, Gated DeltaNet block plan) for apply_tp."""
    return (decoder_root_plan(model, loss_parallel), *block_plans())


def parallelize_qwen3_next(model: nn.Module, env: DistEnv, args: DistributedArgs) -> nn.Module:
    refuse_cp(args.cp)
    if args.tp > 1:
        root_plan, full_plan, linear_plan = tp_plans(model, uses_loss_parallel(args))
        blocks = list(model.layers.values())
        apply_tp(model, env.mesh["tp"], {}, full_plan, [b for b in blocks if b.is_full])
        apply_tp(model, env.mesh["tp"], root_plan, linear_plan,
                 [b for b in blocks if not b.is_full], args.async_tp)
    # Balancing sees the global micro-batch: router counts summed over the data-parallel ranks.
    apply_global_counts(model, env)
    expert_units = []
    if args.ep > 1:
        # Experts split over ep ranks taken from dp_shard; FSDP shards them over the rest.
        ep_mesh, expert_fsdp_mesh = ep_meshes(env.mesh, args.ep)
        apply_ep(model, ep_mesh)
        expert_units = [(moe.experts, expert_fsdp_mesh) for moe in moe_layers(model)]
    return apply_cp_ac_compile_fsdp(model, env, args, expert_units=expert_units)
