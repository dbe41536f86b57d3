"""Stop a run cleanly on a signal: every rank saves a checkpoint at the next step boundary, then,
on Slurm's time-limit warning (SIGUSR2), the job requeues itself; on SIGTERM nothing more.

A handler can run inside a collective, so it only records the signal; the ranks agree at a step
boundary through the step's tally. (submitit's USR2 handler checkpoints on rank 0 alone.) Ctrl-C
is SIGTERM once the loop runs; as torchrun turns a second Ctrl-C into SIGTERM, any signal after a
SIGINT stops at once, without saving (exit code 130).
"""

import logging
import os
import shlex
import signal
import subprocess
import sys
from typing import Callable, Optional

# No torch here: stool's job listens for signals before it imports torch (seconds of start-up,
# during which Slurm's time-limit warning may already arrive).
from lingua.hooks import Hook

logger = logging.getLogger(__name__)
train_logger = logging.getLogger("train")   # the loop's lines

NONE, STOP, REQUEUE = 0, 1, 2   # ordered: when ranks disagree the larger (requeue) wins

# The exit code of a run the user interrupted (Ctrl-C), saved or not: a shell's 128 + SIGINT.
EXIT_INTERRUPTED = 128 + signal.SIGINT
# The exit code of a job a signal (time limit, preemption, scancel) stopped early, after saving:
# not 0, because the work is not finished; Slurm requeues or cancels the job.
EXIT_STOPPED = 3


def is_rank0() -> bool:
    """From the launcher's variables: a handler may run before any process group exists."""
    return os.environ.get("RANK", "0") == "0"


class StopSignals:
    """Records SIGUSR2 / SIGTERM from `listen()`, and SIGINT from `catch_interrupts()`."""

    def __init__(self):
        self.received = NONE
        self.interrupted = False        # a SIGINT is among the signals received
        # Rank 0 stopped on a time-limit warning and did not requeue: the job ends with its code
        self.job_ends = False
        self._previous = {}
        self._stop_now_line: Optional[Callable[[], str]] = None

    def _on_signal(self, signum, frame) -> None:
        if self.received != NONE and (signum == signal.SIGINT or self.interrupted):
            self._stop_now()
        self.received = max(self.received, REQUEUE if signum == signal.SIGUSR2 else STOP)
        self.interrupted = self.interrupted or signum == signal.SIGINT
        if not is_rank0():   # every rank got it (torchrun, Slurm): one line for the job
            return
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = " (Ctrl-C again: stop now, without saving)" if self.interrupted else ""
        # logging is not safe inside a signal handler; a plain write is.
        os.write(2, f"lingua: got {what}; saving a checkpoint after this step, then stopping"
                    f"{again}\n".encode())

    def _stop_now(self) -> None:
        """A second interrupt: leave at once. A checkpoint being written stays invisible (they
        are complete or absent), so the newest one on disk is intact."""
        if is_rank0():
            try:
                line = self._stop_now_line() if self._stop_now_line else ""
            except Exception:   # saying where the run is must not keep it from stopping
                line = ""
            line = line or "run the same command again to resume from the newest checkpoint"
            os.write(2, f"\nlingua: interrupted again: stopped at once without saving; "
                        f"{line}\n".encode())
        os._exit(EXIT_INTERRUPTED)

    def listen(self) -> "StopSignals":
        if not self._previous:  # idempotent: stool's job listens early, the trainer again
            self.received, self.interrupted, self.job_ends = NONE, False, False
            for signum in (signal.SIGUSR2, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def catch_interrupts(self, stop_now_line: Callable[[], str]) -> "StopSignals":
        """`stop_now_line()` says where the run is if a second SIGINT stops it without saving."""
        self.listen()
        self._stop_now_line = stop_now_line
        if signal.SIGINT not in self._previous:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def stop_listening(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        self._stop_now_line = None

    def counts(self) -> dict:
        """This rank's signal as counts for the step's tally (lingua/train/tally.py)."""
        return {"ranks_stopping": float(self.received == STOP),
                "ranks_requeueing": float(self.received == REQUEUE)}

    @staticmethod
    def outcome(tally: dict) -> int:
        """The strongest signal any rank got, from the sums of every rank's `counts`."""
        if tally.get("ranks_requeueing"):
            return REQUEUE
        return STOP if tally.get("ranks_stopping") else NONE


# One per process: signals are process-wide. Listening starts as early as possible (stool's job
# does it before importing the app) so a signal during start-up is not lost.
SIGNALS = StopSignals()


RESUME_COMMAND_VAR = "LINGUA_RESUME_COMMAND"


def resume_command() -> str:
    """LINGUA_RESUME_COMMAND (a wrapper script that knows its user's command sets it), else the
    python -m or torchrun command line, else "the same command"."""
    if os.environ.get(RESUME_COMMAND_VAR):
        return os.environ[RESUME_COMMAND_VAR]
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is None or not hasattr(main, "load_config"):   # not `python -m apps.<app>.train`
        return "the same command"
    tail = shlex.join(["-m", spec.name, *sys.argv[1:]])
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return f"python {tail}"
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return f"the same torchrun command on every node (torchrun ... {tail})"
    return f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '1')} {tail}"


def requeues_so_far() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def requeue_job(max_requeues: int) -> bool:
    """Requeue this Slurm job if the budget allows (call on one rank). Returns whether it did."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        logger.warning("time-limit signal outside Slurm: checkpoint saved; run the same command "
                       "again to resume")
        return False
    done = requeues_so_far()
    if done >= max_requeues:
        logger.warning("job %s was requeued %d times already (slurm.max_requeues=%d): not "
                       "requeueing. The checkpoint is saved; submit the same command again to go "
                       "on, with a larger slurm.max_requeues or slurm.time if needed.",
                       job_id, done, max_requeues)
        return False
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    logger.info("requeued job %s (requeue %d of at most %d)", job_id, done + 1, max_requeues)
    return True


class StopHook(Hook):
    """Signals in the loop; at close it says how to go on and requeues if asked."""

    def __init__(self, max_requeues: int, where_to_resume: Callable[[], str]):
        self.max_requeues, self.where_to_resume = max_requeues, where_to_resume
        self.signals = SIGNALS
        self.stopping = NONE   # the signal the run stopped for, acted on at close

    def start(self, view) -> None:
        self.signals = SIGNALS.catch_interrupts(self.where_to_resume)

    def after_backward(self, view, step: int) -> dict:
        return self.signals.counts()

    def should_stop(self, view) -> bool:
        # Ranks act on the step's tally (a signal caught since waits for the next step); one
        # process needs no tally and stops on the signal at once.
        action = (self.signals.received if view.env.world_size == 1
                  else self.signals.outcome(view.tally))
        if action == NONE or view.step == view.args.steps:
            return False
        self.stopping = action
        return True

    def close(self, view) -> None:
        SIGNALS.stop_listening()
        if self.stopping != NONE and view.env.is_main:   # saved by now: one line for the job
            how = "interrupted (Ctrl-C)" if self.signals.interrupted else "stopped by a signal"
            train_logger.warning("%s after step %d; %s", how, view.step, self.where_to_resume())
            if self.stopping == REQUEUE:
                self.signals.job_ends = not requeue_job(self.max_requeues)
