"""Train a mixture-of-experts LLaMA: `python -m apps.moe.train [config=PRESET] [key=value ...]`.

The same loop as apps/llama (lingua/train/loop.py); what is MoE's: the model, its checks, FLOPs
counted over active parameters only, balancing over the global batch (router token counts summed
over the data- and context-parallel ranks), the aux-loss-free bias update after each step, and
per-layer routing metrics.
"""

import dataclasses
from dataclasses import dataclass, field

from apps.moe.hf import args_from_hf_config, export_problems, load_hf
from apps.moe.model import MoEArgs, Transformer, expert_hidden, validate_moe_args
from apps.moe.model import flops_per_token as model_flops_per_token
from apps.moe.parallelize import float8_filter, parallelize_moe, validate_tp
from lingua import config
from lingua.checkpoint import hf as lingua_hf
from lingua.launch import run
from lingua.model.loss import LossOutput, cross_entropy
from lingua.parallel import distributed
from lingua.parallel.expert_parallel import RoutingHook, validate_ep
from lingua.train.app import App, BlockShape, default_block_shape


@dataclass
class TrainArgs(run.BaseTrainArgs):
    model: MoEArgs = field(default_factory=MoEArgs)


config.register_schema("moe_schema", TrainArgs)


def validate_moe(args: TrainArgs) -> None:
    validate_moe_args(args.model)
    d = args.distributed
    validate_tp(args.model, d.tp, args.data.seq_len)
    dims = distributed.parallel_dims(d, distributed.world_size_from_env())
    validate_ep(args.model.n_experts, d.ep, dims.dp_shard, dims.cp)


def flops_per_token(args: TrainArgs) -> float:
    # Active parameters only: a token does not pay for the experts it was not routed to.
    return model_flops_per_token(args.model, args.data.seq_len)


def loss(output, target) -> LossOutput:
    """Cross-entropy plus the MoE layers' balancing losses (aux and z, summed over tokens: the
    trainer divides both by the global batch's token count), when the model returns them
    (training with aux_loss_coef or z_loss_coef > 0). `loss` logs the cross-entropy alone; the
    balancing losses are logged per layer (moe/<layer>/aux_loss, z_loss)."""
    if not isinstance(output, tuple):
        return cross_entropy(output, target)
    logits, balance_loss = output
    ce = cross_entropy(logits, target)
    return LossOutput(ce.loss_sum + balance_loss.sum(), ce.tokens, logged_sum=ce.loss_sum)


def block_shape(a: MoEArgs) -> BlockShape:
    """A block as the planner counts it (App.block_shape): LLaMA's attention and dense FFN, and
    the experts."""
    return dataclasses.replace(default_block_shape(a), expert_hidden=expert_hidden(a),
                               experts=a.n_experts, experts_per_token=a.top_k,
                               shared_experts=a.n_shared_experts)


def hooks(args: TrainArgs, env) -> list:
    return [RoutingHook(args.model.bias_update_rate, args.model.n_experts)]


APP = App(model_class=Transformer, parallelize=parallelize_moe,
          validate_model=validate_moe, load_hf=load_hf,
          flops_per_token=flops_per_token, hooks=hooks, loss=loss,
          float8_filter=float8_filter, block_shape=block_shape)


def validate(args: TrainArgs) -> None:
    run.validate(args, APP)
    # Said now (one line), not after training: the run's checkpoints will not export to HF.
    lingua_hf.warn_unexportable(export_problems(args.model), "python -m apps.moe.hf")


def load_config(argv=None, check: bool = True) -> TrainArgs:
    """Compose (and check) the config exactly as a run would; stool calls this before submitting."""
    args = config.load("moe", TrainArgs, argv)
    lingua_hf.shape_from_init_from(args, argv, args_from_hf_config)   # continued pretraining
    if check:
        validate(args)
    return args


def main(argv=None) -> int:
    """The config, then run.run: processes, model, optimizer, data, resume, loop."""
    return run.run(load_config(argv), APP)


if __name__ == "__main__":
    run.exit_cli(main)
