"""Train a LLaMA: `python -m apps.llama.train [config=PRESET] [key=value ...]`.

Several processes: `torchrun --nproc-per-node N -m apps.llama.train distributed.dp_shard=N ...`.
Reads top to bottom: the config schema, its checks, the App (what lingua/train/app.py says the
trainer needs to know about a model), main. The run itself (processes, model, optimizer, data and
resume, loop) is lingua.launch.run.run, the same for every app; this file says what is LLaMA's.
"""

from dataclasses import dataclass, field

from lingua import config
from lingua.checkpoint import hf as lingua_hf
from lingua.launch import run
from lingua.models.llama.hf import args_from_hf_config, export_problems, load_hf
from lingua.models.llama.model import LlamaArgs, Transformer, validate_model_args
from lingua.models.llama.parallelize import parallelize_llama, validate_tp
from lingua.train.app import App


@dataclass
class TrainArgs(run.BaseTrainArgs):
    model: LlamaArgs = field(default_factory=LlamaArgs)


config.register_schema("llama_schema", TrainArgs)


def validate_llama(args: TrainArgs) -> None:
    validate_model_args(args.model)
    validate_tp(args.model, args.distributed.tp, args.data.seq_len)
    config.require(args.distributed.ep == 1, f"distributed.ep={args.distributed.ep}: LLaMA has no "
                                             f"experts to shard. Remove distributed.ep.")


APP = App(model_class=Transformer, parallelize=parallelize_llama,
          validate_model=validate_llama, load_hf=load_hf)


def validate(args: TrainArgs) -> None:
    run.validate(args, APP)
    # Said now (one line), not after training: the run's checkpoints will not export to HF.
    lingua_hf.warn_unexportable(export_problems(args.model), "python -m apps.llama.hf")


def load_config(argv=None, check: bool = True) -> TrainArgs:
    """Compose (and check) the config exactly as a run would; stool calls this before submitting."""
    args = config.load("llama", TrainArgs, argv)
    lingua_hf.shape_from_init_from(args, argv, args_from_hf_config)   # continued pretraining
    if check:
        validate(args)
    return args


def main(argv=None) -> int:
    """The config, then run.run: processes, model, optimizer, data, resume, loop."""
    return run.run(load_config(argv), APP)


if __name__ == "__main__":
    run.exit_cli(main)
