"""Validation loss and perplexity on a fixed held-out set, same in any layout (ValidationHook)."""

import logging
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from lingua.data import build_val_batches
from lingua.errors import ConfigError
from lingua.hooks import Hook
from lingua.model.loss import IGNORE_INDEX
from lingua.parallel.distributed import DistEnv, all_reduce_sum
from lingua.train.loop import evaluates_at

EVAL_MODES = ("inline", "async")
logger = logging.getLogger("eval")


@dataclass
class EvalArgs:
    """Validation loss and downstream tasks at the same steps: inline or a Slurm job (async)."""
    every: int = 0                  # validation every N steps (0: only at the end)
    at_end: bool = True             # validation after the last step
    tasks: List[str] = field(default_factory=list)  # lm-eval task names; [] = validation loss only
    include_path: Optional[str] = None  # a directory of your own lm-eval task YAMLs
    limit: Optional[float] = None   # examples per task: a count, or a fraction below 1
    batch_size: int = 8             # sequences per forward on each data-parallel rank
    num_fewshot: Optional[int] = None   # None: each task's own default
    max_gen_tokens: int = 256       # cap on generated tokens (generate_until tasks)
    add_bos: bool = True            # contexts start with BOS, as the training documents did
    log_samples: bool = False       # also write each example's prompt, responses and metrics
    mode: str = "inline"            # inline | async (a Slurm job per checkpoint, eval.slurm.*)


def validate_args(args: EvalArgs) -> None:
    if args.every < 0:
        raise ConfigError(f"eval.every={args.every} must be 0 (only at the end) or positive.")
    if args.mode not in EVAL_MODES:
        raise ConfigError(f"eval.mode={args.mode!r} is not one of {', '.join(EVAL_MODES)}: inline "
                          f"runs eval.tasks on the training ranks, async in a job per checkpoint.")
    if args.batch_size < 1 or args.max_gen_tokens < 1:
        raise ConfigError(f"eval.batch_size={args.batch_size} and eval.max_gen_tokens="
                          f"{args.max_gen_tokens} must be positive.")
    if args.limit is not None and not (
            args.limit > 0 and (args.limit < 1 or args.limit == int(args.limit))):
        raise ConfigError(f"eval.limit={args.limit} must be a number of examples (1, 2, ...) or a "
                          f"fraction between 0 and 1; leave it unset for every example.")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"eval.num_fewshot={args.num_fewshot} must be 0 or more (unset: each "
                          f"task's default).")


@torch.no_grad()
def evaluate(parts, batches, env: DistEnv, batch_loss) -> dict:
    """Mean validation loss over the global validation set. `batch_loss(batch)` is the summed
    token loss of this rank's share of the batch, or None on pipeline stages before the last;
    tokens are counted over the data-parallel ranks only (their peers share a batch)."""
    was_training = [part.training for part in parts]
    for part in parts:
        part.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    tokens = torch.zeros((), dtype=torch.float64, device=env.device)
    for batch in batches:
        loss = batch_loss(batch)
        if loss is not None:
            loss_sum += loss.double()
        tokens += (batch.labels != IGNORE_INDEX).sum()   # chat data ignores non-answer targets
    all_reduce_sum(loss_sum, env)
    all_reduce_sum(tokens, env, dims=("dp",))
    for part, mode in zip(parts, was_training):
        part.train(mode)
    loss = (loss_sum / tokens).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}


class ValidationHook(Hook):
    """val_loss / val_ppl at evaluation steps; none with data.val_sequences=0 (said once)."""

    def __init__(self, args, env: DistEnv):
        self.batches = build_val_batches(args.data, env.dp_rank, env.dp_size)
        self.fields: dict = {}   # the evaluation step's results, for its row

    def start(self, view) -> None:
        e = view.args.eval
        if not self.batches and (e.every or e.at_end) and view.env.is_main:
            logger.info("no validation loss: data.val_sequences=0%s",
                        " (eval.tasks still run at evaluation steps)" if e.tasks else "")

    def after_step(self, view, step: int) -> None:
        if self.batches and evaluates_at(view.args, step):
            self.fields = evaluate(view.parts, self.batches, view.env, view.eval_loss)

    def metrics(self, view, row: dict) -> None:
        row.update(self.fields)
        self.fields = {}
