"""Evaluate a checkpoint of this app on downstream tasks (lm-evaluation-harness):

    python -m apps.qwen3_next.eval <dump_dir or dump_dir/checkpoints/STEP> \
        eval.tasks=[lingua_continuation]

also under torchrun with any layout the checkpoint reshards to (lingua/eval/eval_cli.py says how).
"""

from apps.qwen3_next.train import APP, TrainArgs
from lingua.eval import eval_cli
from lingua.launch import run


def main(argv=None) -> int:
    return eval_cli.evaluate_checkpoint(APP, TrainArgs, argv)


if __name__ == "__main__":
    run.exit_cli(main)
