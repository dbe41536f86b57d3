"""Train the sliding-window + attention-sink fork of LLaMA (apps/swa/model.py says what it
changes): `python -m apps.swa.train [config=PRESET] [key=value ...]`, e.g. `model.window=64
model.sinks=false`; `torchrun --nproc-per-node N -m apps.swa.train ...` for several processes.

The run is lingua.launch.run.run, as for every app; this file gives its schema, the checks only
this model needs, and its App. No Hugging Face map: the fork is trained and generated from here.
"""

from dataclasses import dataclass, field

import torch

from apps.swa.model import SWAArgs, Transformer, validate_model_args
from apps.swa.parallelize import parallelize_swa, validate_tp
from lingua import config
from lingua.launch import run
from lingua.model.layers import head_dim
from lingua.observe import metrics
from lingua.train.app import App


@dataclass
class TrainArgs(run.BaseTrainArgs):
    model: SWAArgs = field(default_factory=SWAArgs)


config.register_schema("swa_schema", TrainArgs)


def validate_swa(args: TrainArgs) -> None:
    m, d = args.model, args.distributed
    validate_model_args(m)
    validate_tp(m, d.tp, args.data.seq_len)
    config.require(d.ep == 1, f"distributed.ep={d.ep}: this model has no experts. Remove it.")
    masked = m.window is not None or m.sinks
    config.require(d.cp == 1 or d.cp_backend != "ring" or not masked,
                   f"distributed.cp_backend=ring with model.window={m.window}, model.sinks="
                   f"{m.sinks}: torch's ring attention applies plain causal masks only, so the "
                   "window and the sinks would be lost. Use distributed.cp_backend=allgather.")


def flops_per_token(args: TrainArgs) -> float:
    """lingua's count (6 x parameters, plus attention as if every query saw `seen` keys) with
    `seen` the window, not the row: MFU stays honest for a windowed model."""
    m = args.model
    with torch.device("meta"):
        model = Transformer(m)
    seen = min(m.window or args.data.seq_len, args.data.seq_len)
    return metrics.flops_per_token(model, m.n_layers, m.n_heads * head_dim(m), seen,
                                   m.tie_embeddings)


APP = App(model_class=Transformer, parallelize=parallelize_swa, validate_model=validate_swa,
          flops_per_token=flops_per_token)


def load_config(argv=None, check: bool = True) -> TrainArgs:
    """The run's config, checked as the run would check it (stool and lingua.plan call this)."""
    return config.load("swa", TrainArgs, argv, (lambda a: run.validate(a, APP)) if check else None)


def main(argv=None) -> int:
    return run.run(load_config(argv), APP)


if __name__ == "__main__":
    run.exit_cli(main)
