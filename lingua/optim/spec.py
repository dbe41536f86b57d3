"""What lingua needs of an optimizer: a file with an OptimizerSpec and a line in OPTIMIZERS."""

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class OptimizerSpec:
    build: Callable         # (model part, OptimArgs, fused) -> its torch.optim.Optimizer
    # The planner's rule: (a rank's parts on meta, OptimArgs) -> (state, step's workspace) bytes
    state_bytes: Callable
    label: str                      # the planner's row; "{only}" takes ", trainable only"
    args: Optional[type] = None     # its own section optim.<name>.*, a dataclass
    validate: Callable = lambda optim_args: None   # raises ConfigError naming the key and a fix
    workspace_label: str = ""       # what the workspace is, for the planner's line on it
