"""profiling.* in the loop (ProfilerHook): the torch profiler's window of steps
(lingua.observe.profiling.StepProfiler) told where each step begins and ends."""

from typing import Optional

from lingua.observe import profiling
from lingua.train.hooks import Hook


class ProfilerHook(Hook):
    def __init__(self, args):
        self.args = args.profiling
        self.profiler: Optional[profiling.StepProfiler] = None

    def start(self, run) -> None:
        env = run.env
        self.profiler = profiling.StepProfiler(
            self.args, run.dump_dir, env.rank, env.device,
            run.flops_per_token * run.global_tokens / env.world_size, run.peak)

    def before_step(self, run, step: int) -> None:
        self.profiler.step_begin(step)

    def after_step(self, run, step: int) -> None:
        self.profiler.step_end(step)

    def close(self, run) -> None:
        if self.profiler is not None:
            self.profiler.close()
