"""How features attach to the training loop (lingua/train/loop.py): a Hook's methods are called
at fixed points of every step, in the order of the run's hook list (lingua.launch.run.hooks:
the app's hooks, then the core's). Each method here does nothing, so a hook defines only the
points it needs. `run` is the loop's Run; `step` the 1-based number of the step being run, as
metrics.jsonl counts it. docs/ARCHITECTURE.md has the table of who uses which point.

  start(run)                  once, resumed and the log open, before the first step
  before_step(run, step)      before the step's data is read
  after_backward(run, step)   gradients complete, not clipped; returns {name: count} this rank
                              adds to the step's tally (train/tally.py; same names everywhere)
  vote(run, step)             gradient norm finite: UPDATE, SKIP or ROLLBACK, from run.tally
                              (the step's loss, grad_norm and counts summed over the ranks, host
                              floats); the first objection wins. A hook that votes ROLLBACK has
                              moved the run back (run.step is the checkpoint's)
  after_step(run, step)       run.step == step; run.decision: UPDATE (applied) or SKIP.
                              Evaluation runs here at eval.every, its fields in run.eval_fields
  metrics(run, row)           a logged step's metrics.jsonl row: add fields (every rank calls)
  after_save(run, step)       the checkpoint of `step` is complete on disk
  should_stop(run)            after the step's checkpoint: True ends the loop (saving through
                              run.save_now); every rank must answer alike, from run.tally
  close(run)                  always, however the loop ended, in reverse order, before the log
                              closes
  state_dict() / load_state_dict(train_state)   the hook's keys of the checkpoint's train state
A hook that needs a checkpoint kept from checkpoint.keep's pruning adds a predicate to
run.checkpoint_in_use; one that skips data batches reads them away with run.skip_batch().
"""

from typing import Iterable

UPDATE, SKIP, ROLLBACK = "update", "skip", "rollback"   # what vote() says about an update


class Hook:
    """A feature around the loop; override the points it needs (the module docstring)."""

    def start(self, run) -> None: ...
    def before_step(self, run, step: int) -> None: ...
    def after_backward(self, run, step: int) -> dict: return {}
    def vote(self, run, step: int) -> str: return UPDATE
    def after_step(self, run, step: int) -> None: ...
    def metrics(self, run, row: dict) -> None: ...
    def after_save(self, run, step: int) -> None: ...
    def should_stop(self, run) -> bool: return False
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
    def before_step(self, run, step): self._each("before_step", run, step)
    def after_step(self, run, step): self._each("after_step", run, step)
    def metrics(self, run, row): self._each("metrics", run, row)
    def after_save(self, run, step): self._each("after_save", run, step)
    def load_state_dict(self, train_state): self._each("load_state_dict", train_state)

    def after_backward(self, run, step: int) -> dict:
        counts = {}
        for hook in self.hooks:
            counts.update(hook.after_backward(run, step) or {})
        return counts

    def vote(self, run, step: int) -> str:
        # The first objection wins; a hook after a ROLLBACK is not asked (the run moved back).
        for hook in self.hooks:
            decision = hook.vote(run, step)
            if decision != UPDATE:
                return decision
        return UPDATE

    def should_stop(self, run) -> bool:
        # Not short-circuited: a hook may save or log before it answers.
        return any([hook.should_stop(run) for hook in self.hooks])

    def close(self, run) -> None:
        for hook in reversed(self.hooks):
            hook.close(run)

    def state_dict(self) -> dict:
        return {key: value for hook in self.hooks for key, value in hook.state_dict().items()}
