"""Tensor + sequence parallelism (Megatron style) for the decoder shell: its own modules' plan,
the checks independent of an app's blocks, and pieces block plans share (each app's parallelize.py).
Between blocks the residual stream is a Shard(1) DTensor, so `h.shape[1]` gives the decoder the
global length for RoPE and the mask; each block half all-gathers its input, column-shards its input
projections (whole heads per rank) and row-shards its output projection back to Shard(1)."""

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from lingua.errors import ConfigError


def validate_decoder_tp(model_args, tp: int, seq_len: int | None = None) -> None:
    """The shell's checks before any process group exists; raises ConfigError naming the fix."""
    if tp < 1:
        raise ConfigError(f"distributed.tp={tp} must be at least 1.")
    if tp == 1:
        return
    if model_args.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings=true with distributed.tp={tp} is not supported: the tied output "
            "projection reuses the vocabulary-sharded embedding matrix outside any TP plan. Set "
            "model.tie_embeddings=false, or distributed.tp=1.")
    if seq_len is not None and seq_len % tp:
        raise ConfigError(
            f"data.seq_len={seq_len} is not divisible by distributed.tp={tp}: sequence parallelism "
            f"splits every sequence into tp equal parts. Use a multiple of {tp}, e.g. "
            f"data.seq_len={seq_len - seq_len % tp or tp}.")


def validate_whole_heads(model_args, tp: int, seq_len: int | None = None) -> None:
    """validate_decoder_tp plus whole query and key/value heads on every rank."""
    n_heads = model_args.n_heads
    n_kv = model_args.n_kv_heads or n_heads
    if tp > 1 and n_heads % tp:
        raise ConfigError(
            f"model.n_heads={n_heads} is not divisible by distributed.tp={tp}: tensor parallelism "
            f"gives each rank whole attention heads. Use a tp that divides {n_heads}, or change "
            "model.n_heads.")
    if tp > 1 and n_kv % tp:
        raise ConfigError(
            f"model.n_kv_heads={n_kv} is not divisible by distributed.tp={tp}: each rank holds "
            f"n_kv_heads / tp key/value heads (grouped-query attention). Use a tp that divides "
            f"{n_kv}, or raise model.n_kv_heads to a multiple of {tp} that divides "
            f"model.n_heads={n_heads}.")
    validate_decoder_tp(model_args, tp, seq_len)


def gathered_input() -> PrepareModuleInput:
    """A block half's input: the residual stream's Shard(1) shard, all-gathered to the whole
    sequence as a plain tensor (only the first positional input; keyword ones are whole)."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                              use_local_output=True)


def _local_first_output(module, args, out):
    # A stage may return more than the hidden states (a tuple whose first element they are).
    if isinstance(out, tuple):
        return (out[0].to_local() if isinstance(out[0], DTensor) else out[0], *out[1:])
    return out.to_local() if isinstance(out, DTensor) else out


class StageBoundary(ParallelStyle):
    """A pipeline part's own input / output, exchanged as plain local shards [mb, S/tp, dim]: a
    part without the embeddings wraps its first positional input (whatever follows it) into a
    Shard(1) DTensor, one without the output projection returns the local shard."""

    def __init__(self, wrap_input: bool, unwrap_output: bool):
        super().__init__()
        self.wrap_input, self.unwrap_output = wrap_input, unwrap_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.wrap_input:
            def wrap(_, args):
                h = args[0]
                if not isinstance(h, DTensor):
                    h = DTensor.from_local(h, device_mesh, (Shard(1),), run_check=False)
                return (h, *args[1:])
            module.register_forward_pre_hook(wrap)
        if self.unwrap_output:
            module.register_forward_hook(_local_first_output)
        return module


def decoder_root_plan(model: nn.Module, loss_parallel: bool) -> dict:
    """apply_tp's root plan for the shell modules `model` (decoder or pipeline part) holds; with
    `loss_parallel` the logits stay vocab-sharded (Shard(-1)), else gathered to a plain tensor."""
    if getattr(getattr(model, "args", None), "tie_embeddings", False):
        raise ConfigError("model.tie_embeddings=true is not supported with distributed.tp>1: "
                          "set model.tie_embeddings=false (see "
                          "lingua.parallel.tp_plan.validate_decoder_tp).")
    root: dict = {}
    first, last = model.tok_embeddings is not None, model.output is not None
    if first:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                 use_local_output=False)
    if model.norm is not None:
        root["norm"] = SequenceParallel()
    if last:
        root["output"] = ColwiseParallel(input_layouts=Shard(1),
                                         output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    if not (first and last):
        root[""] = StageBoundary(wrap_input=not first, unwrap_output=not last)
    return root
