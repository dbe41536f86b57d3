"""`python -m apps.llama.train` for a fork that adds QK-norm, for tests/test_parallel_coverage.py.

The fork (made here, in the worker process, so apps/llama stays unchanged): an RMSNorm over each
head's queries and keys before RoPE, new weights `attention.q_norm.weight` and
`attention.k_norm.weight` of size head_dim in every block. Under tp > 1 the heads are split
over the tp ranks by the column-parallel wq / wk, so these weights multiply sharded activations:
left out of the TP plan they stay plain per-rank copies whose gradients are never summed over tp.

With LINGUA_TEST_QK_PLAN=1 the fork's parallelize.py also has the plan lines the trainer's
refusal names, added to the block plan that lingua/models/llama/parallelize.py's tp_plans passes
to apply_tp.
"""

import os
import sys

from torch.distributed.tensor.parallel import SequenceParallel

from apps.llama import train
from lingua.launch import run
from lingua.model.layers import RMSNorm, apply_rope
from lingua.models.llama import model, parallelize
from lingua.models.llama.model import Attention

PLAN_VAR = "LINGUA_TEST_QK_PLAN"


class QKNormAttention(Attention):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, backend: str = "sdpa"):
        super().__init__(dim, n_heads, n_kv_heads, backend)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)

    def forward(self, x, rope, mask=None, cache=None, cache_key: str = ""):
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, -1, self.head_dim))   # [b, s, heads, head_dim]
        k = self.k_norm(self.wk(x).view(b, s, -1, self.head_dim))
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return self.wo(self.core(q, k, v, mask).reshape(b, s, -1))


def fork_model() -> None:
    model.Attention = QKNormAttention
    init_block = model.TransformerBlock.init_weights

    def init_weights(self, std, out_std):
        init_block(self, std, out_std)
        self.attention.q_norm.reset_parameters()
        self.attention.k_norm.reset_parameters()

    model.TransformerBlock.init_weights = init_weights


def with_qk_norm_plan(decoder_tp_plans):
    """lingua/models/llama/parallelize.py's plan function with the lines the refusal asks for added
    to the block plan it gives apply_tp."""
    def plans(part, loss_parallel):
        root_plan, block_plan = decoder_tp_plans(part, loss_parallel)
        block_plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        block_plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        return root_plan, block_plan

    return plans


if __name__ == "__main__":
    fork_model()
    if os.environ.get(PLAN_VAR) == "1":
        parallelize.tp_plans = with_qk_norm_plan(parallelize.tp_plans)
    run.exit_cli(lambda: train.main(sys.argv[1:]))
