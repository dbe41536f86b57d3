"""`python -m apps.llama.train` with a TP plan that forgot the QK-norm (test_parallel_coverage).

With model.qk_norm=true (Qwen3's QK-norm, an option of the shared LLaMA model) every block has
`attention.q_norm.weight` and `attention.k_norm.weight` of size head_dim. Under tp > 1 the heads
are split over the tp ranks by the column-parallel wq / wk, so these weights multiply sharded
activations: left out of the TP plan they stay plain per-rank copies whose gradients are never
summed over tp. This worker is a fork whose plan leaves their lines out (made here, in the worker
process, so lingua/models/llama/parallelize.py stays unchanged): its attention_plan is the shipped
one less the q_norm / k_norm entries. apps.llama.train itself is the fork with the lines.
"""

import sys

from apps.llama import train
from lingua.launch import run
from lingua.models.llama import parallelize

QK_NORMS = ("attention.q_norm", "attention.k_norm")


def without_qk_norm_lines(attention_plan):
    """lingua/models/llama/parallelize.py's attention_plan less the entries the refusal asks for."""
    def plan(model):
        return {key: style for key, style in attention_plan(model).items()
                if key not in QK_NORMS}

    return plan


if __name__ == "__main__":
    parallelize.attention_plan = without_qk_norm_lines(parallelize.attention_plan)
    run.exit_cli(lambda: train.main(sys.argv[1:]))
