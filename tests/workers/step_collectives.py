"""`python -m apps.llama.train` with one more hook, for tests/test_step_collectives.py: it counts
the collectives each step issues and writes {step: {collective: count}} to
<dump_dir>/collectives_rank<r>.json. Nothing but this launcher adds the hook: the project's code
is unchanged.

Step 2's asynchronous checkpoint write counts as running through step 3, however fast the disk
(held_write below): the test's step 3 is a plain step while a write is pending, and the write is
finished at step 4's boundary. Without the hold a write done before step 3's tally is
finished within step 3, adding its gathers there.

The count is CommDebugMode's (the same op lists: c10d's and the functional collectives') without
its module tracker, which fails when a window opens or closes inside a module's forward."""

import json
import os
import sys
from pathlib import Path

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
from torch.utils._python_dispatch import TorchDispatchMode

from apps.llama import train
from lingua import checkpoint
from lingua.hooks import Hook
from lingua.launch import run

COLLECTIVES = set(NATIVE_TO_PY_MAPPING) | c10d_collective_ops


class CommCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented   # DTensor runs the op; its collectives come back here
        packet = func._overloadpacket
        if packet in COLLECTIVES:
            name = str(packet).split(".")[-1]
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class CountCollectives(Hook):
    """Each step's window runs from its before_step (the first hook's) to the next step's (or
    the loop's end), so it holds the step's logging, checkpoint and stop check too."""

    current_step = 0

    def __init__(self):
        self.mode, self.step, self.per_step = None, None, {}

    def _close_window(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.per_step[self.step] = self.mode.counts
            self.mode = None

    def before_step(self, view, step: int) -> None:
        self._close_window()
        self.mode, self.step = CommCounter(), step
        CountCollectives.current_step = step
        self.mode.__enter__()

    def close(self, view) -> None:
        self._close_window()
        path = Path(view.args.dump_dir) / f"collectives_rank{os.environ.get('RANK', '0')}.json"
        path.write_text(json.dumps(self.per_step))


REAL_WRITTEN_HERE = checkpoint.PendingSave.written_here
WRITE_SEEN_DONE_FROM = 4


def held_write(pending) -> bool:
    return (CountCollectives.current_step >= WRITE_SEEN_DONE_FROM
            and REAL_WRITTEN_HERE(pending))


def with_counter(real):
    def hooks(args, env, app):
        made = real(args, env, app)
        made.hooks.insert(0, CountCollectives())
        return made
    return hooks


if __name__ == "__main__":
    run.hooks = with_counter(run.hooks)
    checkpoint.PendingSave.written_here = held_write
    run.exit_cli(lambda: train.main(sys.argv[1:]))
