"""How features attach to the training loop (lingua/train/loop.py): a Hook's methods are called
at fixed points of every step, in the order of the run's hook list (lingua.launch.run.hooks: the
app's, then the core's); each does nothing here. docs/ARCHITECTURE.md has who uses which. Hooks
decide; the loop acts: a hook reads the run through `view` (a read-only RunView), returns what it
wants done, keeps its own state and never calls another hook. `step`: 1-based, as metrics.jsonl.

  start(view)                   once, resumed and the log open, before the first step
  before_step(view, step)       before the step's data is read; may return a Request, carried
                                out before the next hook is asked (view.probe_requested); after
                                a Request's load the later hooks are asked for view.step + 1
  after_backward(view, step)    gradients complete, not clipped; returns {name: count} this rank
                                adds to the step's tally (train/tally.py; same names everywhere)
  vote(view, step)              gradient norm finite: UPDATE, SKIP or ROLLBACK from view.tally,
                                the first objection wins. ROLLBACK: the loop runs the step's
                                batch again (before_step, after_backward with view.rerun set: the
                                checkpoint step), then loads the newest intact checkpoint before
                                it as resume does; with none, the step is skipped (SKIP)
  after_step(view, step)        view.step == step; view.decision: UPDATE (applied) or SKIP
  metrics(view, row)            a logged row (evaluation steps always log): add fields; all ranks
  after_save(view, step)        the checkpoint of `step` is complete on disk
  should_stop(view)             after the step's checkpoint: True ends the loop, which saves
                                first; every rank must answer alike, from view.tally
  close(view)                   always, however the loop ended, in reverse order
  state_dict() / load_state_dict(train_state)   its train-state keys (loaded at resume, rollback)"""

from dataclasses import dataclass
from typing import Iterable, Optional

UPDATE, SKIP, ROLLBACK = "update", "skip", "rollback"   # what vote() says about an update


@dataclass(frozen=True)
class Request:
    """What a hook asks of the step about to run (before_step)."""
    skip_batches: int = 0     # data batches the loop reads and throws away first
    probe: bool = False       # probe this step in full, whatever probe.every says
    load: Optional[dict] = None   # a peer's Run.snapshot() to load first (a replica group heals)


class Hook:
    """A feature around the loop; override the points it needs (the module docstring)."""

    def start(self, view) -> None: ...
    def before_step(self, view, step: int) -> Optional[Request]: return None
    def after_backward(self, view, step: int) -> dict: return {}
    def vote(self, view, step: int) -> str: return UPDATE
    def after_step(self, view, step: int) -> None: ...
    def metrics(self, view, row: dict) -> None: ...
    def after_save(self, view, step: int) -> None: ...
    def should_stop(self, view) -> bool: return False
    def close(self, view) -> None: ...
    def state_dict(self) -> dict: return {}
    def load_state_dict(self, train_state: dict) -> None: ...


class Hooks(Hook):
    """The run's hooks called as one, in order (before_step is the loop's: it acts on each
    hook's Request before asking the next)."""

    def __init__(self, hooks: Iterable[Hook] = ()):
        self.hooks = list(hooks)

    def __iter__(self):
        return iter(self.hooks)

    def _each(self, name: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, name)(*args)

    def start(self, view): self._each("start", view)
    def after_step(self, view, step): self._each("after_step", view, step)
    def metrics(self, view, row): self._each("metrics", view, row)
    def after_save(self, view, step): self._each("after_save", view, step)
    def load_state_dict(self, train_state): self._each("load_state_dict", train_state)

    def after_backward(self, view, step: int) -> dict:
        counts = {}
        for hook in self.hooks:
            counts.update(hook.after_backward(view, step) or {})
        return counts

    def vote(self, view, step: int) -> str:
        for hook in self.hooks:   # the first objection wins
            decision = hook.vote(view, step)
            if decision != UPDATE:
                return decision
        return UPDATE

    def should_stop(self, view) -> bool:   # every hook asked: each notes its own reason
        return any([hook.should_stop(view) for hook in self.hooks])

    def close(self, view) -> None:
        for hook in reversed(self.hooks):
            hook.close(view)

    def state_dict(self) -> dict:
        return {key: value for hook in self.hooks for key, value in hook.state_dict().items()}
