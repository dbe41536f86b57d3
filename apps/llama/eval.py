"""Evaluate a checkpoint (a dump_dir or dump_dir/checkpoints/STEP) on downstream tasks, also under
torchrun: `python -m apps.llama.eval CHECKPOINT eval.tasks=[lingua_continuation]` (see eval_cli)."""

from apps.llama.train import APP, TrainArgs
from lingua.eval import eval_cli
from lingua.launch import run


def main(argv=None) -> int:
    return eval_cli.evaluate_checkpoint(APP, TrainArgs, argv)


if __name__ == "__main__":
    run.exit_cli(main)
