"""Train a LLaMA with multi-token prediction:
`python -m apps.mtp.train [config=PRESET] [key=value ...]`.

Several processes: `torchrun --nproc-per-node N -m apps.mtp.train distributed.dp_shard=N ...`.
Reads top to bottom: the config schema, its checks, the App (what lingua/train/app.py says the
trainer needs to know about a model), main. The run itself (processes, model, optimizer, data and
resume, loop) is lingua.launch.run.run, the same for every app; this file says what is MTP's: the
loss (through the trainer's loss seam, lingua/model/loss.py) and the shifted tokens it needs.
"""

from dataclasses import dataclass, field

import torch

from apps.mtp.hf import export_problems, load_hf
from apps.mtp.model import MTPArgs, Transformer, validate_model_args
from apps.mtp.parallelize import parallelize_mtp, validate_tp
from lingua import config
from lingua.checkpoint import hf as lingua_hf
from lingua.launch import run
from lingua.model.loss import IGNORE_INDEX, LossOutput, token_loss_sum
from lingua.train.app import App


@dataclass
class TrainArgs(run.BaseTrainArgs):
    model: MTPArgs = field(default_factory=MTPArgs)


config.register_schema("mtp_schema", TrainArgs)


def validate_mtp(args: TrainArgs) -> None:
    validate_model_args(args.model)
    validate_tp(args.model, args.distributed.tp, args.data.seq_len)
    config.require(args.distributed.ep == 1, f"distributed.ep={args.distributed.ep}: LLaMA has no "
                                             f"experts to shard. Remove distributed.ep.")


def batch_inputs(tokens: torch.Tensor, labels: torch.Tensor, depth: int):
    """From the whole sequence, before any sharding: targets [b, s, 1 + D], where [:, i, k] is
    t_{i+k+1} (the labels shifted k more, IGNORE_INDEX past the end), and the MTP modules' input
    tokens future_tokens [b, s, D], where [:, i, k-1] is t_{i+k} (0 where there is none: its
    targets are IGNORE_INDEX)."""
    b, s = labels.shape
    pad = labels.new_full((b, depth), IGNORE_INDEX)
    ahead = torch.cat([labels, pad], dim=1)
    target = torch.stack([ahead[:, k:k + s] for k in range(depth + 1)], dim=-1)
    return {"future_tokens": target[..., :depth].clamp(min=0)}, target


def mtp_loss(output: torch.Tensor, target: torch.Tensor, weight: float) -> LossOutput:
    """Next-token cross-entropy plus weight / D times the D depths' cross-entropies, summed over
    tokens. `loss` logs the next-token cross-entropy (as every app's does), mtp/ce_k each depth's
    (mtp/ce_0 is the next-token one again) and mtp/objective what is minimised."""
    depth = target.shape[-1] - 1
    terms = [token_loss_sum(output[k], target[..., k]) for k in range(depth + 1)]
    counts = [(target[..., k] != IGNORE_INDEX).sum() for k in range(depth + 1)]
    total = terms[0] + weight / depth * sum(terms[1:])
    metrics = {f"mtp/ce_{k}": (terms[k], counts[k]) for k in range(depth + 1)}
    metrics["mtp/objective"] = (total, counts[0])
    return LossOutput(total, counts[0], metrics, logged_sum=terms[0])


def make_app(model_args: MTPArgs) -> App:
    return App(
        model_class=Transformer, parallelize=parallelize_mtp, validate_model=validate_mtp,
        load_hf=load_hf,
        batch_inputs=lambda tokens, labels: batch_inputs(tokens, labels, model_args.mtp_depth),
        loss=lambda output, target: mtp_loss(output, target, model_args.mtp_loss_weight))


APP = make_app(MTPArgs())   # the defaults; main() makes the run's from its model args


def validate(args: TrainArgs) -> None:
    run.validate(args, make_app(args.model))
    # Said now (one line), not after training: the run's checkpoints will not export to HF.
    lingua_hf.warn_unexportable(export_problems(args.model), "python -m apps.mtp.hf")


def load_config(argv=None, check: bool = True) -> TrainArgs:
    """Compose (and check) the config exactly as a run would; stool calls this before submitting."""
    return config.load("mtp", TrainArgs, argv, validate if check else None)


def main(argv=None) -> int:
    """The config, then lingua.launch.run.run with the App of its model args."""
    args = load_config(argv)
    return run.run(args, make_app(args.model))


if __name__ == "__main__":
    run.exit_cli(main)
