"""Train Qwen3-Next (Gated DeltaNet + gated attention on a sparse MoE):
`python -m apps.qwen3_next.train [config=PRESET] [key=value ...]`.

The same loop as every app (lingua/train/loop.py, run by lingua.launch.run.run); this file says
what is Qwen3-Next's: the model and its checks (model.linear_kernel=fla needs
flash-linear-attention and CUDA), the layouts it refuses (apps/qwen3_next/parallelize.py), FLOPs
over active parameters with the linear layers' own count, and the MoE apps' routing hook
(routing metrics; this router has no selection bias to update).
"""

import dataclasses
from dataclasses import dataclass, field

import torch

from apps.qwen3_next.hf import args_from_hf_config, export_problems, load_hf
from apps.qwen3_next.model import (
    CHUNK,
    Qwen3NextArgs,
    Transformer,
    layer_is_full,
    validate_model_args,
)
from apps.qwen3_next.parallelize import float8_filter, parallelize_qwen3_next, validate_layout
from lingua import config
from lingua.checkpoint import hf as lingua_hf
from lingua.errors import ConfigError
from lingua.launch import run
from lingua.model.layers import head_dim
from lingua.model.loss import LossOutput, cross_entropy
from lingua.model.moe import active_params_per_token
from lingua.parallel.expert_parallel import RoutingHook
from lingua.train.app import App, BlockShape, default_block_shape, device_type


@dataclass
class TrainArgs(run.BaseTrainArgs):
    model: Qwen3NextArgs = field(default_factory=Qwen3NextArgs)


config.register_schema("qwen3_next_schema", TrainArgs)


def check_linear_kernel(kernel: str, device: str, model_dtype: str) -> None:
    """model.linear_kernel=fla: flash-linear-attention's Triton kernel, on CUDA, in bf16."""
    if kernel != "fla":
        return
    if device != "cuda":
        raise ConfigError(f"model.linear_kernel=fla needs a CUDA device, but this run is on "
                          f"{device!r}: flash-linear-attention's kernels are Triton GPU code. Use "
                          "model.linear_kernel=torch (the chunked form in plain torch).")
    if model_dtype != "bf16":
        raise ConfigError(f"model.linear_kernel=fla with distributed.model_dtype={model_dtype}: "
                          "flash-linear-attention's chunked kernel takes bf16 / fp16 inputs, not "
                          "fp32. Set distributed.model_dtype=bf16, or use "
                          "model.linear_kernel=torch.")
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"model.linear_kernel=fla but flash-linear-attention cannot be imported "
                          f"({e}). Install it (`pip install flash-linear-attention`), or use "
                          "model.linear_kernel=torch.") from e


def validate_qwen3_next(args: TrainArgs) -> None:
    validate_model_args(args.model)
    validate_layout(args.distributed, args.model, args.data.seq_len)
    check_linear_kernel(args.model.linear_kernel, device_type(), args.distributed.model_dtype)


def flops_per_token(args: TrainArgs) -> float:
    """Training FLOPs per token, 3 x the forward's (backward twice it): 2 per active matmul
    parameter (top_k of the routed experts; a tied output once more), the full-attention
    layers' QK^T and AV over the sequence (2 x 2 x heads x head_dim x seq_len, the causal half
    not discounted, as for lingua's other models), the short convolutions (2 x kernel a
    channel), and each Gated DeltaNet layer's delta rule as model.chunk_gated_delta_rule
    computes it, per value head (q and k repeated to it) and chunk of C tokens:
        k.k^T and q.k^T: 2 x 2 C^2 dk;  the two triangular solves (C^2 a right-hand column):
        C^2 (dk + dv);  scores x u: 2 C^2 dv;  the state read for u and for q, and its
        update: 3 x 2 C dk dv,
    so 6 dk dv + C (5 dk + 3 dv) a token; norms, gates and decays (elementwise) not counted."""
    a = args.model
    with torch.device("meta"):
        model = Transformer(a)
    active = active_params_per_token(model)
    if a.tie_embeddings:
        active += model.tok_embeddings.weight.numel()
    n_full = sum(layer_is_full(a, i) for i in range(a.n_layers))
    dk, dv, c = a.linear_key_head_dim, a.linear_value_head_dim, CHUNK
    conv = 2 * a.linear_conv_kernel * (2 * a.linear_key_heads * dk + a.linear_value_heads * dv)
    rule = a.linear_value_heads * (6 * dk * dv + c * (5 * dk + 3 * dv))
    attention = 4 * a.n_heads * head_dim(a) * args.data.seq_len
    return 3.0 * (2 * active + n_full * attention + (a.n_layers - n_full) * (conv + rule))


def loss(output, target) -> LossOutput:
    """Cross-entropy plus the MoE balancing losses when the model returns them (apps/moe's)."""
    if not isinstance(output, tuple):
        return cross_entropy(output, target)
    logits, balance_loss = output
    ce = cross_entropy(logits, target)
    return LossOutput(ce.loss_sum + balance_loss.sum(), ce.tokens, logged_sum=ce.loss_sum)


def block_shape(a: Qwen3NextArgs) -> dict[int, BlockShape]:
    """Each block as the planner counts it (App.block_shape), by layer: the gated full attention
    or the Gated DeltaNet, the experts, and the shared expert in units of the routed experts'
    width, rounded up."""
    full = dataclasses.replace(
        default_block_shape(a), expert_hidden=a.expert_hidden_dim, experts=a.n_experts,
        experts_per_token=a.top_k, gated=True,
        shared_experts=-(-a.shared_expert_hidden_dim // a.expert_hidden_dim))
    linear = dataclasses.replace(
        full, linear_key_heads=a.linear_key_heads, linear_value_heads=a.linear_value_heads,
        linear_key_dim=a.linear_key_head_dim, linear_value_dim=a.linear_value_head_dim,
        chunk=CHUNK)
    return {i: full if layer_is_full(a, i) else linear for i in range(a.n_layers)}


APP = App(model_class=Transformer, parallelize=parallelize_qwen3_next,
          validate_model=validate_qwen3_next, load_hf=load_hf, flops_per_token=flops_per_token,
          hooks=lambda args, env: [RoutingHook(0.0, args.model.n_experts)], loss=loss,
          float8_filter=float8_filter, block_shape=block_shape)


def validate(args: TrainArgs) -> None:
    run.validate(args, APP)
    lingua_hf.warn_unexportable(export_problems(args.model), "python -m apps.qwen3_next.hf")


def load_config(argv=None, check: bool = True) -> TrainArgs:
    """Compose (and check) the config exactly as a run would; stool calls this before submitting."""
    args = config.load("qwen3_next", TrainArgs, argv)
    lingua_hf.shape_from_init_from(args, argv, args_from_hf_config)   # continued pretraining
    if check:
        validate(args)
    return args


def main(argv=None) -> int:
    """The config, then run.run: processes, model, optimizer, data, resume, loop."""
    return run.run(load_config(argv), APP)


if __name__ == "__main__":
    run.exit_cli(main)
