"""Tensor + sequence parallelism for lingua's decoder shell (lingua/model/decoder.py): the plan of
its own modules (embeddings, final norm, output, pipeline-stage boundaries), the checks that do
not depend on an app's blocks, and the pieces block plans share (whole heads per rank, a block
half's gathered input). Each app writes its blocks' plan against its own module names in its
parallelize.py (lingua/models/llama/parallelize.py: attention and SwiGLU), in the same style:
Megatron-style TP with sequence parallelism.

Between blocks the residual stream is a DTensor sharded over the sequence (Shard(1)): norms and
residual adds run on S/tp tokens per rank. Each attention / feed-forward input is all-gathered
to the full sequence (Replicate), the q/k/v and w1/w3 projections are column-sharded (each rank
owns whole heads and a slice of the hidden width), and wo / w2 are row-sharded and finish with a
reduce-scatter back to Shard(1).

Why the residual stream is a DTensor rather than a plain local tensor: Transformer.forward reads
the sequence length from the embeddings' output (`h.shape[1]`) to slice the RoPE tables and build
the attention mask. A DTensor reports the global length, so the RoPE tables (plain tensors,
indexed by absolute positions) and masks match the full sequence that attention sees after its
all-gather. Pipeline stages exchange plain local shards [mb, S/tp, dim], so a stage without the
embeddings wraps its input into a DTensor and a stage without the output projection returns
the local shard.
"""

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
    """The shell's checks before any process group exists (an app adds its blocks', such as
    heads divisible by tp); raises ConfigError naming the fix."""
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
    """validate_decoder_tp plus the check of a plan that shards attention by head (q/k/v
    column-wise): every rank holds whole query and key/value heads."""
    if tp <= 1:
        validate_decoder_tp(model_args, tp, seq_len)
        return
    n_heads = model_args.n_heads
    n_kv = model_args.n_kv_heads or n_heads
    if n_heads % tp:
        raise ConfigError(
            f"model.n_heads={n_heads} is not divisible by distributed.tp={tp}: tensor parallelism "
            f"gives each rank whole attention heads. Use a tp that divides {n_heads}, or change "
            "model.n_heads.")
    if n_kv % tp:
        raise ConfigError(
            f"model.n_kv_heads={n_kv} is not divisible by distributed.tp={tp}: each rank holds "
            f"n_kv_heads / tp key/value heads (grouped-query attention). Use a tp that divides "
            f"{n_kv}, or raise model.n_kv_heads to a multiple of {tp} that divides "
            f"model.n_heads={n_heads}.")
    validate_decoder_tp(model_args, tp, seq_len)


def gathered_input() -> PrepareModuleInput:
    """A block half's input (attention, feed-forward): this rank's Shard(1) sequence shard of the
    residual stream, all-gathered to the whole sequence as a plain tensor. Only the first
    positional input is laid out; keyword ones (rope, mask, cache) every rank holds whole."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                              use_local_output=True)


def _local_first_output(module, args, out):
    # A stage may return more than the hidden states (a tuple whose first element they are).
    if isinstance(out, tuple):
        return (out[0].to_local() if isinstance(out[0], DTensor) else out[0], *out[1:])
    return out.to_local() if isinstance(out, DTensor) else out


class StageBoundary(ParallelStyle):
    """A pipeline part's own input / output: pipeline stages exchange plain local sequence shards
    [mb, S/tp, dim]. A part without the embeddings turns its first positional input (hidden
    states) into a Shard(1) DTensor; a part without the output projection returns the local
    shard. (torch's PrepareModuleInput needs the exact number of positional inputs; this only
    touches the first, whatever else the caller passes.)"""

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
    """The plan of the shell's own modules, for lingua.parallel.tensor_parallel.apply_tp's root
    plan.

    `model` is the decoder or one pipeline part of it: the plan only names the modules the part
    holds. Between blocks the residual stream is a Shard(1) DTensor (sequence parallel): the
    embeddings reduce-scatter into it, the final norm runs on it, and the output projection
    gathers it. With `loss_parallel` the logits stay sharded over the vocabulary (a Shard(-1)
    DTensor for lingua.model.loss.token_loss_sum); otherwise they are all-gathered into a
    plain tensor.
    """
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
