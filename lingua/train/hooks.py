"""How features attach to the training loop (lingua/train/loop.py): a Hook's methods are called
at fixed points of every step, in the order of the run's hook list (lingua.launch.run builds
it). Each method here does nothing, so a hook defines only the points it needs. `run` is the
loop's Run (model parts, optimizers, data, log, step); `step` is the 1-based number of the step
being run, as metrics.jsonl counts it.

  resumed(run)                 after resume (a checkpoint loaded or none), before the loop
  start(run)                   once, the loop's logger and timers open, before the first step
  before_step(run, step)       before the step's data is fetched
  skip_batch(run, batch)       True throws away the data batch just read (1-based count)
  before_forward(run, step)    the step's micro-batches are read; its forwards come next
  after_backward(run, step)    the gradients are complete, not yet clipped
  share(run, step)             {name: number} this rank adds to the step's agreement (one
                               all-reduce, lingua/train/agreement.py): same names on every rank
  decide(run, step, agreed)    the norm finite: UPDATE, SKIP or ROLLBACK. `agreed` (also
                               run.agreed, for every later point) holds the step's loss,
                               grad_norm and the shares summed over the ranks, host floats
  after_update(run, step)      the optimizer applied the update
  roll_back(run, step, batches)   after a ROLLBACK decision: True when the hook went back to a
                               checkpoint (run.step is then its step), False if it skipped
  after_step(run, step)        run.step == step, the update applied or skipped
  end_step(run, step)          the step is over, rolled back or not
  metrics(run, row)            a logged step's metrics.jsonl row: add fields (every rank calls)
  keeps_checkpoint(step)       checkpoint.keep must not prune this step's checkpoint yet
  after_save(run, step)        the checkpoint of `step` is complete on disk
  should_stop(run)             after the step's checkpoint: True ends the loop (saving first
                               through run.save_now); every rank must answer alike: decide
                               from run.agreed, not from this rank's own state
  end(run)                     the loop ended (finished or stopped), before the log closes
  close(run)                   always, however the loop ended (reverse order)
  state_dict() / load_state_dict(train_state)   the hook's keys of the checkpoint's train state
On SKIP the loop leaves the weights as they are and the lr schedule moves on (as for a
non-finite gradient norm, which the loop skips before asking any hook); on ROLLBACK nothing is
applied and roll_back follows.
"""

from typing import Iterable

UPDATE, SKIP, ROLLBACK = "update", "skip", "rollback"   # what decide() says about an update


class Hook:
    """A feature around the loop; override the points it needs (the module docstring)."""

    def start(self, run) -> None: ...
    def resumed(self, run) -> None: ...
    def before_step(self, run, step: int) -> None: ...
    def skip_batch(self, run, batch: int) -> bool: return False
    def before_forward(self, run, step: int) -> None: ...
    def after_backward(self, run, step: int) -> None: ...
    def share(self, run, step: int) -> dict: return {}
    def decide(self, run, step: int, agreed: dict) -> str: return UPDATE
    def after_update(self, run, step: int) -> None: ...
    def roll_back(self, run, step: int, micro_batches) -> bool: return False
    def after_step(self, run, step: int) -> None: ...
    def end_step(self, run, step: int) -> None: ...
    def metrics(self, run, row: dict) -> None: ...
    def keeps_checkpoint(self, step: int) -> bool: return False
    def after_save(self, run, step: int) -> None: ...
    def should_stop(self, run) -> bool: return False
    def end(self, run) -> None: ...
    def close(self, run) -> None: ...
    def state_dict(self) -> dict: return {}
    def load_state_dict(self, train_state: dict) -> None: ...


class Hooks(Hook):
    """The run's hooks called as one, in order."""

    def __init__(self, hooks: Iterable[Hook] = ()):
        self.hooks = list(hooks)

    def __iter__(self):
        return iter(self.hooks)

    def _each(self, name: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, name)(*args)

    def start(self, run): self._each("start", run)
    def resumed(self, run): self._each("resumed", run)
    def before_step(self, run, step): self._each("before_step", run, step)
    def before_forward(self, run, step): self._each("before_forward", run, step)
    def after_backward(self, run, step): self._each("after_backward", run, step)
    def after_update(self, run, step): self._each("after_update", run, step)
    def after_step(self, run, step): self._each("after_step", run, step)
    def end_step(self, run, step): self._each("end_step", run, step)
    def metrics(self, run, row): self._each("metrics", run, row)
    def after_save(self, run, step): self._each("after_save", run, step)
    def end(self, run): self._each("end", run)
    def load_state_dict(self, train_state): self._each("load_state_dict", train_state)

    def skip_batch(self, run, batch: int) -> bool:
        return any(hook.skip_batch(run, batch) for hook in self.hooks)

    def share(self, run, step: int) -> dict:
        return {key: value for hook in self.hooks for key, value in hook.share(run, step).items()}

    def decide(self, run, step: int, agreed: dict) -> str:
        # Every hook judges the step (each may hold statistics); the first objection wins.
        decisions = [hook.decide(run, step, agreed) for hook in self.hooks]
        return next((d for d in decisions if d != UPDATE), UPDATE)

    def roll_back(self, run, step: int, micro_batches) -> bool:
        return any([hook.roll_back(run, step, micro_batches) for hook in self.hooks])

    def keeps_checkpoint(self, step: int) -> bool:
        return any(hook.keeps_checkpoint(step) for hook in self.hooks)

    def should_stop(self, run) -> bool:
        # Not short-circuited: a hook may save or log before it answers.
        return any([hook.should_stop(run) for hook in self.hooks])

    def close(self, run) -> None:
        for hook in reversed(self.hooks):
            hook.close(run)

    def state_dict(self) -> dict:
        return {key: value for hook in self.hooks for key, value in hook.state_dict().items()}
