"""Stop a run cleanly on a signal: every rank saves a checkpoint at the next step boundary, then,
on Slurm's time-limit warning, the job requeues itself.

Slurm sends SIGUSR2 `slurm.signal_delay_s` seconds before the time limit (stool asks for it with
`--signal=USR2@N`) and SIGTERM on preemption, `scontrol requeue` and `scancel`. A handler can run
in the middle of a step, even inside a collective, so it only records the signal; the loop looks at
it between steps. The ranks agree with one all-reduce (a signal reaches them at slightly different
moments), save one complete checkpoint together, and stop. submitit's own USR2 handler cannot be
used for this: it calls `checkpoint()` on rank 0 alone, and a sharded (FSDP/DCP) save needs every
rank; ours replaces it once the trainer starts.

After the save:
  - SIGUSR2 (time limit): rank 0 requeues the job (`scontrol requeue`, as submitit would) while
    `slurm.max_requeues` allows; the requeued job resumes from this checkpoint.
  - SIGTERM: nothing more. Slurm requeues a preempted or `scontrol requeue`d job itself, and a
    cancelled job should end; either way the work so far is on disk.
"""

import logging
import os
import signal
import subprocess

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

NONE, STOP, REQUEUE = 0, 1, 2   # ordered: when ranks disagree the larger (requeue) wins


class StopSignals:
    """Records SIGUSR2 / SIGTERM from `listen()` until `stop_listening()` (old handlers return)."""

    def __init__(self):
        self.received = NONE
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        wanted = REQUEUE if signum == signal.SIGUSR2 else STOP
        self.received = max(self.received, wanted)
        # logging is not safe inside a signal handler; a plain write is.
        os.write(2, f"lingua: got {signal.Signals(signum).name}; saving a checkpoint after this "
                    f"step, then stopping\n".encode())

    def listen(self) -> "StopSignals":
        if not self._previous:  # idempotent: stool's job listens early, the trainer again
            self.received = NONE
            for signum in (signal.SIGUSR2, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def stop_listening(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def agreed(self, world_size: int, device: torch.device) -> int:
        """What every rank should do now (NONE, STOP or REQUEUE): the strongest signal any got."""
        if world_size == 1:
            return self.received
        flag = torch.tensor([float(self.received)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


# One per process: signals are process-wide. Listening starts as early as possible (stool's job
# does it before importing the app) so a signal during start-up is not lost.
SIGNALS = StopSignals()


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
