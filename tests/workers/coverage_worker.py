"""Two ranks (torchrun, gloo, tp=2) whose model parts differ, as two pipeline stages' would: on
rank 0 the TP plan leaves `1.weight` a plain tensor, on rank 1 it covers everything. Each rank
runs lingua.parallel.coverage's check and writes what it raised (or "passed") to <out>/rank<r>.txt;
both must refuse, naming rank 0's parameter. For tests/test_parallel_coverage.py."""

import sys
from pathlib import Path

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

from lingua.errors import ConfigError
from lingua.model.layers import RMSNorm
from lingua.parallel import distributed
from lingua.parallel.coverage import check_parallel_coverage
from lingua.parallel.distributed import DistributedArgs

if __name__ == "__main__":
    out = Path(sys.argv[1])
    env = distributed.init(DistributedArgs(tp=2, backend="gloo"))
    model = nn.Sequential(nn.Linear(8, 8), RMSNorm(8))
    plan = {"0": ColwiseParallel()} if env.rank == 0 else {"0": ColwiseParallel(),
                                                          "1": SequenceParallel()}
    parallelize_module(model, env.mesh["tp"], plan)
    try:
        check_parallel_coverage([model], env)
        result = "passed"
    except ConfigError as err:
        result = str(err)
    (out / f"rank{env.rank}.txt").write_text(result)
    distributed.destroy()
    distributed.exit_process(0)
