"""Train DeepSeek-V3 (MLA + fine-grained MoE + optional MTP):
`python -m apps.deepseek.train [config=PRESET] [key=value ...]`.

The same loop as every app (lingua/train/loop.py, run by lingua.launch.run.run); this file says
what is DeepSeek's: the model and its checks, FLOPs over active parameters, the MoE apps' routing
hook (lingua.parallel.expert_parallel.RoutingHook: the aux-loss-free bias update after each
applied step, routing metrics) and, with model.mtp_depth > 0, apps/mtp's shifted targets and
loss.
"""

from dataclasses import dataclass, field

import torch

from apps.deepseek.hf import args_from_hf_dir, export_problems, load_hf
from apps.deepseek.model import DeepSeekArgs, Transformer, dense_hidden, validate_model_args
from apps.deepseek.model import flops_per_token as model_flops_per_token
from apps.deepseek.parallelize import float8_filter, parallelize_deepseek, validate_tp
from lingua import config
from lingua.checkpoint import hf as lingua_hf
from lingua.launch import run
from lingua.model.loss import IGNORE_INDEX, LossOutput, token_loss_sum
from lingua.parallel import distributed
from lingua.parallel.expert_parallel import RoutingHook, validate_ep
from lingua.train.app import App, BlockShape


@dataclass
class TrainArgs(run.BaseTrainArgs):
    model: DeepSeekArgs = field(default_factory=DeepSeekArgs)


config.register_schema("deepseek_schema", TrainArgs)


def validate_deepseek(args: TrainArgs) -> None:
    validate_model_args(args.model)
    d = args.distributed
    validate_tp(args.model, d.tp, args.data.seq_len)
    dims = distributed.parallel_dims(d, distributed.world_size_from_env())
    validate_ep(args.model.n_experts, d.ep, dims.dp_shard, dims.cp)


def batch_inputs(tokens: torch.Tensor, labels: torch.Tensor, depth: int):
    """From the whole sequence, before any sharding: targets [b, s, 1 + D], where [:, i, k] is
    t_{i+k+1} (IGNORE_INDEX past the end), and the MTP modules' inputs future_tokens [b, s, D],
    where [:, i, k-1] is t_{i+k} (0 where there is none: its targets are IGNORE_INDEX)."""
    b, s = labels.shape
    ahead = torch.cat([labels, labels.new_full((b, depth), IGNORE_INDEX)], dim=1)
    target = torch.stack([ahead[:, k:k + s] for k in range(depth + 1)], dim=-1)
    return {"future_tokens": target[..., :depth].clamp(min=0)}, target


def loss(output, target, mtp_weight: float) -> LossOutput:
    """Next-token cross-entropy, plus mtp_weight / D times the D MTP depths' (when the target
    has them), plus the MoE balancing losses (when the model returns them), all summed over
    tokens. `loss` logs the next-token cross-entropy; mtp/ce_k each depth's."""
    logits, balance = output if isinstance(output, tuple) else (output, None)
    if target.dim() == 2:   # no MTP: logits [b, s, vocab], target [b, s]
        logits, target = [logits], target[..., None]
    depth = target.shape[-1] - 1
    terms = [token_loss_sum(logits[k], target[..., k]) for k in range(depth + 1)]
    counts = [(target[..., k] != IGNORE_INDEX).sum() for k in range(depth + 1)]
    total = terms[0] + (mtp_weight / depth * sum(terms[1:]) if depth else 0)
    metrics = {f"mtp/ce_{k}": (terms[k], counts[k]) for k in range(1, depth + 1)}
    if balance is not None:
        total = total + balance.sum()
    return LossOutput(total, counts[0], metrics, logged_sum=terms[0])


def flops_per_token(args: TrainArgs) -> float:
    return model_flops_per_token(args.model, args.data.seq_len)


def block_shape(a: DeepSeekArgs) -> BlockShape:
    """A block as the planner counts it (App.block_shape): MLA's heads and latents, the dense
    FFN's width and the experts."""
    return BlockShape(a.dim, a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim,
                      a.n_heads, dense_hidden(a), a.expert_hidden_dim, a.n_experts, a.top_k,
                      a.n_shared_experts, q_latent=a.q_lora_rank or 0, kv_latent=a.kv_lora_rank,
                      rope_head_dim=a.qk_rope_head_dim)


def make_app(model_args: DeepSeekArgs) -> App:
    depth = model_args.mtp_depth
    mtp = {"batch_inputs": lambda tokens, labels: batch_inputs(tokens, labels, depth)}
    return App(
        model_class=Transformer, parallelize=parallelize_deepseek,
        validate_model=validate_deepseek, load_hf=load_hf, flops_per_token=flops_per_token,
        hooks=lambda args, env: [RoutingHook(args.model.bias_update_rate, args.model.n_experts)],
        float8_filter=float8_filter, block_shape=block_shape,
        loss=lambda output, target: loss(output, target, model_args.mtp_loss_weight),
        **(mtp if depth else {}))


APP = make_app(DeepSeekArgs())   # the defaults; main() makes the run's from its model args


def validate(args: TrainArgs) -> None:
    run.validate(args, make_app(args.model))
    lingua_hf.warn_unexportable(export_problems(args.model), "python -m apps.deepseek.hf")


def load_config(argv=None, check: bool = True) -> TrainArgs:
    """Compose (and check) the config exactly as a run would; stool calls this before submitting."""
    args = config.load("deepseek", TrainArgs, argv)
    lingua_hf.shape_from_init_from(args, argv, args_from_hf_dir)   # continued pretraining
    if check:
        validate(args)
    return args


def main(argv=None) -> int:
    args = load_config(argv)
    return run.run(args, make_app(args.model))


if __name__ == "__main__":
    run.exit_cli(main)
