"""Where a step's time goes: per-phase timings for metrics.jsonl (`PhaseTimer`), and a
torch.profiler window (`StepProfiler`, `profiling.enabled=true`) writing `dump_dir/profiling/`."""

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import record_function

from lingua.errors import ConfigError
from lingua.hooks import Hook
from lingua.observe import metrics

logger = logging.getLogger(__name__)

# Our record_function labels, left out of the logged top operators (their self time is Python).
PHASE_LABELS = {"data": "data", "fwd": "forward", "bwd": "backward", "optim": "optimizer",
                "fwd_bwd": "forward_backward"}


@dataclass
class ProfilingArgs:
    enabled: bool = False       # off: no profiler object and no hooks, the loop runs as without it
    start_step: int = 5         # the window's first step (from 1; earlier ones compile, warm up)
    wait: int = 1               # torch.profiler.schedule, from start_step on: steps run unprofiled,
    warmup: int = 1             # then profiled and thrown away (the profiler's own start-up cost),
    active: int = 3             # then recorded into the trace and the summary
    memory: bool = True         # allocations per operator; on CUDA also a memory_viz snapshot
    record_shapes: bool = True  # input shapes per operator: tells which matmul is which
    with_stack: bool = False    # Python stacks per operator: very useful, but large traces and slow
    top_ops: int = 15           # rows of the operator table in summary_rank<r>.txt


def validate_args(args: ProfilingArgs, steps: Optional[int] = None) -> None:
    """Checked even when profiling is off (a typo shows early); the window must fit only when on."""
    def bad(key, value, why_and_fix):
        raise ConfigError(f"profiling.{key}={value} {why_and_fix}")

    if args.start_step < 1:
        bad("start_step", args.start_step, "is before the first step: steps are numbered from 1 "
            "as in metrics.jsonl. Set profiling.start_step=1 or later (after the first few steps "
            "is best, when caches and the allocator have settled).")
    for key in ("wait", "warmup"):
        if getattr(args, key) < 0:
            bad(key, getattr(args, key), "is negative: it counts steps of the profiler's "
                "schedule. Set it to 0 or more.")
    if args.active < 1:
        bad("active", args.active, "records no step, so the trace would be empty. Set "
            "profiling.active=1 or more (a few steps: 3 is typical).")
    if args.top_ops < 1:
        bad("top_ops", args.top_ops, "lists no operator in the summary. Set profiling.top_ops=1 "
            "or more.")
    if args.enabled and steps is not None:
        last = last_active_step(args)
        if last > steps:
            raise ConfigError(
                f"profiling.start_step={args.start_step} with wait={args.wait}, "
                f"warmup={args.warmup}, active={args.active} records steps "
                f"{last - args.active + 1}..{last}, but the run has steps={steps}. Lower "
                f"profiling.start_step (or wait/warmup/active) so the window ends by step {steps}, "
                f"or raise steps.")


def first_active_step(args: ProfilingArgs) -> int:
    return args.start_step + args.wait + args.warmup


def last_active_step(args: ProfilingArgs) -> int:
    return first_active_step(args) + args.active - 1


class PhaseTimer:
    """Seconds per phase of the step. CUDA syncs (else only launches are timed) on `timed` steps
    only, the logged ones, so other steps keep their overlap."""

    def __init__(self, device: torch.device):
        self.synchronize = torch.cuda.synchronize if device.type == "cuda" else None
        self.timed = True
        self.seconds = {}

    def start_step(self, timed: bool) -> None:
        self.timed = timed or self.synchronize is None
        self.seconds = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        with record_function(PHASE_LABELS[name]):
            if not self.timed:
                yield
                return
            if self.synchronize is not None:
                self.synchronize()
            t0 = time.perf_counter()
            try:
                yield
            finally:
                if self.synchronize is not None:
                    self.synchronize()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def step_seconds(self) -> dict:
        """{phase: seconds} of the step just run, or {} when it was not timed."""
        return dict(self.seconds) if self.timed else {}


class StepProfiler:
    """torch.profiler over one window of steps: per rank a Chrome trace, the top operators and
    (CUDA, memory=true) a memory snapshot; with `flops_per_step` and `peak_flops`, the MFU."""

    def __init__(self, args: ProfilingArgs, dump_dir, rank: int, device: torch.device,
                 flops_per_step: Optional[float] = None, peak_flops=None):
        self.args, self.rank, self.device = args, rank, device
        self.cuda = device.type == "cuda"
        self.out_dir = Path(dump_dir) / "profiling"
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self.first, self.last = first_active_step(args), last_active_step(args)
        self.prof = None
        self.done = not args.enabled
        self.trace_path = None
        self.t_active = None

    def step_begin(self, step: int) -> None:
        if self.done:
            return
        if self.prof is None:
            if step < self.args.start_step:
                return
            if step > self.args.start_step:   # a resumed run that starts past the window
                logger.warning("profiling: the run starts at step %d, after "
                               "profiling.start_step=%d: nothing is profiled. Set "
                               "profiling.start_step=%d or later.",
                               step, self.args.start_step, step + 1)
                self.done = True
                return
            self._start()
        if step == self.first:
            self._sync()
            self.t_active = time.perf_counter()

    def step_end(self, step: int) -> None:
        if self.prof is None:
            return
        self.prof.step()
        if step == self.last:
            self._sync()
            self._finish(time.perf_counter() - self.t_active)

    def close(self) -> None:
        """Stop a window the run left early (stopped by a signal): nothing complete to write."""
        if self.prof is not None:
            logger.warning("profiling: the run stopped inside the profiled window; no trace "
                           "written")
            self.prof.stop()
            self._stop_memory_history()
            self.prof = None
        self.done = True

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _start(self) -> None:
        a = self.args
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if a.memory:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = torch.profiler.profile(
            activities=activities, on_trace_ready=self._write_trace,
            schedule=torch.profiler.schedule(wait=a.wait, warmup=a.warmup, active=a.active,
                                             repeat=1),
            record_shapes=a.record_shapes, profile_memory=a.memory, with_stack=a.with_stack)
        self.prof.start()
        logger.info("profiling: started at step %d, recording steps %d..%d", a.start_step,
                    self.first, self.last)

    def _write_trace(self, prof) -> None:
        self.trace_path = self.out_dir / f"trace_rank{self.rank}_step{self.last}.json"
        prof.export_chrome_trace(str(self.trace_path))

    def _stop_memory_history(self) -> None:
        if self.cuda and self.args.memory:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _finish(self, active_seconds: float) -> None:
        prof, self.prof, self.done = self.prof, None, True
        prof.stop()
        if self.cuda and self.args.memory:
            torch.cuda.memory._dump_snapshot(
                str(self.out_dir / f"memory_snapshot_rank{self.rank}.pickle"))
            self._stop_memory_history()
        averages = prof.key_averages()
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        sections = [f"steps {self.first}..{self.last} on rank {self.rank}, sorted by {sort_by}",
                    averages.table(sort_by=sort_by, row_limit=self.args.top_ops)]
        if self.args.memory and not self.cuda:
            sections += ["memory, sorted by self_cpu_memory_usage",
                         averages.table(sort_by="self_cpu_memory_usage",
                                        row_limit=self.args.top_ops)]
        summary_path = self.out_dir / f"summary_rank{self.rank}.txt"
        summary_path.write_text("\n\n".join(sections) + "\n")
        if self.rank != 0:
            return
        ops = sorted((e for e in averages if e.key not in PHASE_LABELS.values()
                      and not e.key.startswith("ProfilerStep")),
                     key=lambda e: getattr(e, sort_by), reverse=True)[:5]
        top = ", ".join(f"{e.key} {getattr(e, sort_by) / 1e3 / self.args.active:.1f}ms"
                        for e in ops)
        value = metrics.mfu(self.flops_per_step * self.args.active / active_seconds,
                            self.peak_flops) if self.flops_per_step else None
        mfu = ""
        if value is not None:  # None: no credible peak (see metrics.mfu)
            mfu = f"; MFU {100 * value:.1f}% over the recorded steps (profiler overhead included)"
        logger.info("profiling: trace %s, summary %s; top ops per step (self time): %s%s",
                    self.trace_path, summary_path, top, mfu)


class ProfilerHook(Hook):
    """profiling.* in the loop: the window of steps told where each step begins and ends."""

    def __init__(self, args):
        self.args = args.profiling
        self.profiler: Optional[StepProfiler] = None

    def start(self, view) -> None:
        env = view.env
        self.profiler = StepProfiler(self.args, view.args.dump_dir, env.rank, env.device,
                                     *view.mfu_basis)

    def before_step(self, view, step: int) -> None:
        if view.rerun is None:   # a rolled-back batch run again is no step of the window
            self.profiler.step_begin(step)

    def after_step(self, view, step: int) -> None:
        self.profiler.step_end(step)

    def close(self, view) -> None:
        if self.profiler is not None:
            self.profiler.close()
