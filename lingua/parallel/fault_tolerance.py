"""Replica groups with torchft (fault_tolerance.*): ordinary jobs (each FSDP2 x TP x EP, its own
launch) train one model. torchft's Manager, one per rank, joins the live groups' quorum on the
lighthouse every step and sums the gradients across them where HSDP's replicate dimension would:
FSDP2's all-reduce hook on each reduce-scattered shard (no FSDP: after_backward, every gradient).
A step is applied only if manager.should_commit() (else a SKIP vote). Group g's dp rank r reads
data rank g x dp + r of replica_groups x dp (DistEnv.data_group): the groups read one process's
global batch, the loss is divided by its tokens, and the sum is the one-process gradient. It is
scaled by replica_groups / live groups: when a group is lost, the batch shrinks to the live
parts and the gradient is their mean (lr unchanged). Each group logs its part's loss (the run's:
the groups' mean). Refused or absent: pipeline parallel across groups; HSDP in a group; the
async quorum (no option: a reconfiguration during the forward can crash FSDP2, torchtitan
#4754); spikes.policy=rollback (a group's checkpoints need not be its peers'). A group found
behind the live ones in a quorum (restarted, or dropped by the lighthouse) heals from a live
peer (Run.snapshot: its shards, optimizer, train state, RNG) through torchft's checkpoint
transport. torchft is imported only when enabled.
"""

import dataclasses
import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import torch
from torch.distributed import ReduceOp

from lingua.errors import ConfigError
from lingua.hooks import SKIP, UPDATE, Hook, Request

logger = logging.getLogger("train")


@dataclass
class FaultToleranceArgs:
    enabled: bool = False
    replica_groups: int = 1         # groups training together (each one launch of the job)
    group_id: int = 0               # this group's id, 0 .. replica_groups-1
    lighthouse: str = field(default_factory=lambda: os.environ.get("TORCHFT_LIGHTHOUSE", ""))
    min_replicas: int = 1           # fewest live groups a step may commit with
    quorum_timeout_s: int = 60      # wait for the lighthouse's quorum, and torchft's collectives


def validate_args(args) -> None:
    """All of fault_tolerance's problems with the run's config `args`, in one ConfigError."""
    ft, dist_args = args.fault_tolerance, args.distributed
    if not ft.enabled:
        return
    problems = []
    if not 0 <= ft.group_id < ft.replica_groups:
        problems.append(f"fault_tolerance.group_id={ft.group_id} must be in 0 .. replica_groups-1 "
                        f"(replica_groups={ft.replica_groups}).")
    if not 1 <= ft.min_replicas <= ft.replica_groups or ft.quorum_timeout_s <= 0:
        problems.append("fault_tolerance.min_replicas must be in 1 .. replica_groups and "
                        "fault_tolerance.quorum_timeout_s positive.")
    if dist_args.pp > 1:
        problems.append(f"distributed.pp={dist_args.pp}: pipeline parallel across replica "
                        f"groups is not supported; use distributed.pp=1 with fault_tolerance.")
    if dist_args.dp_replicate > 1:
        problems.append(f"distributed.dp_replicate={dist_args.dp_replicate}: the replica groups "
                        f"take the replicate dimension's place; set "
                        f"fault_tolerance.replica_groups instead.")
    if args.spikes.policy == "rollback":
        problems.append("spikes.policy=rollback loads the group's own newest checkpoint, which a "
                        "group that healed from a peer may not have; use spikes.policy=skip with "
                        "fault_tolerance.")
    if problems:
        raise ConfigError(" ".join(problems))


def join(ft: FaultToleranceArgs, env):
    """`env` reading this group's part of the global batch; a lighthouse that does not answer is
    refused here, before anything is built or written."""
    if not ft.enabled:
        return env
    url = urlparse(ft.lighthouse if "://" in ft.lighthouse else f"http://{ft.lighthouse}")
    try:
        socket.create_connection((url.hostname, url.port or 80), timeout=5).close()
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"fault_tolerance.lighthouse={ft.lighthouse!r} cannot be reached ({err}), so this "
            f"replica group cannot join a quorum. Start a lighthouse first (`torchft_lighthouse "
            f"--min_replicas {ft.min_replicas} --quorum_tick_ms 100 --join_timeout_ms 10000`, "
            f"which prints its address, or torchft.coordination.LighthouseServer), and give its "
            f"address in fault_tolerance.lighthouse or TORCHFT_LIGHTHOUSE.") from None
    return dataclasses.replace(env, data_groups=ft.replica_groups, data_group=ft.group_id)


class FaultToleranceHook(Hook):
    """A torchft Manager per rank: the quorum before the step, gradients summed, the commit. A
    group behind the live ones is sent a live peer's Run.snapshot() in the quorum; the loop loads
    it (a Request's load) and runs the step after the peer's."""

    def __init__(self, ft: FaultToleranceArgs, env):
        self.ft, self.env, self.manager, self.store, self.received = ft, env, None, None, None
        self.uncommitted = 0   # steps every live group skipped: a group failed during them

    def start(self, view) -> None:
        if not self.ft.enabled:
            return
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(seconds=self.ft.quorum_timeout_s)
        pg = (ProcessGroupNCCL if self.env.device.type == "cuda" else ProcessGroupGloo)(timeout)
        store = {}
        if self.env.world_size == 1:   # no process group, so no store: the Manager's own
            self.store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)
            store = dict(store_addr="127.0.0.1", store_port=self.store.port)
        # torchft's quorum thread asks for the snapshot while the loop waits in start_quorum.
        self.manager = Manager(
            pg, self._receive, view.snapshot, min_replica_size=self.ft.min_replicas,
            use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=self.env.rank, world_size=self.env.world_size, **store,
            lighthouse_addr=self.ft.lighthouse, replica_id=f"group_{self.ft.group_id}",
            init_sync=False)
        units = [m for part in view.parts for m in part.modules()
                 if hasattr(m, "set_all_reduce_hook")]
        for unit in units:
            unit.set_all_reduce_hook(self._sum_across_groups)
        self.hook_grads = not units

    def before_step(self, view, step: int) -> Optional[Request]:
        if self.manager is None:
            return None
        # The Manager counts the run's steps (uncommitted ones too, which torchft's own count
        # leaves out): a quorum finds the group behind by the step it would resume from.
        self.manager.load_state_dict({"step": view.step,
                                      "batches_committed": self.manager.batches_committed()})
        self.manager.start_quorum(allow_heal=True)   # sync: a heal's state is received on return
        state, self.received = self.received, None
        if state is None:
            return None
        logger.info("group %d heals from a live group: step %d", self.ft.group_id,
                    state["train"]["step"])
        return Request(load=state)

    def _receive(self, state: dict) -> None:
        self.received = state

    def _sum_across_groups(self, grad: torch.Tensor) -> None:
        self.manager.allreduce(grad, reduce_op=ReduceOp.SUM).wait()
        live = self.manager.num_participants()
        if live != self.ft.replica_groups:
            grad.mul_(self.ft.replica_groups / live)

    def after_backward(self, view, step: int) -> dict:
        if self.manager is None:
            return {}
        if self.hook_grads:   # no FSDP unit reduced them: every gradient here
            for p in (p for part in view.parts for p in part.parameters() if p.grad is not None):
                self._sum_across_groups(getattr(p.grad, "_local_tensor", p.grad))   # DTensor: own
        # Every step asks (a non-finite gradient norm skips vote): the groups stay in step.
        self.committed = self.manager.should_commit()
        return {}

    def vote(self, view, step: int) -> str:
        if self.manager is None or self.committed:
            return UPDATE
        self.uncommitted += 1
        return SKIP

    def metrics(self, view, row: dict) -> None:
        if self.manager is not None:
            row.update(ft_live_groups=self.manager.num_participants(),
                       ft_uncommitted_steps=self.uncommitted)

    def state_dict(self) -> dict:
        return {"ft_uncommitted_steps": self.uncommitted} if self.ft.enabled else {}

    def load_state_dict(self, train_state: dict) -> None:
        self.uncommitted = train_state.get("ft_uncommitted_steps", 0)

    def close(self, view) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def serve_lighthouse(min_replicas: int, root, poll_s: float = 2) -> None:
    """stool's lighthouse job: its address goes to <root>/lighthouse (atomically: a group never
    reads half of it); it serves while a job of <root>/lighthouse_jobs (the groups' ids, which
    stool writes once it has submitted them) is in Slurm's queue."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=10000,
                              quorum_tick_ms=100)
    path, ids = Path(root) / "lighthouse", Path(root) / "lighthouse_jobs"
    tmp = path.with_name(f".lighthouse.tmp-{os.getpid()}")
    tmp.write_text(server.address())
    os.replace(tmp, path)
    print(f"lighthouse {server.address()} (min_replicas {min_replicas}) in {path}", flush=True)
    try:
        while not ids.is_file() or slurm_jobs_queued(ids.read_text().strip()):
            time.sleep(poll_s)
    finally:
        server.shutdown()


def slurm_jobs_queued(ids: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ids], capture_output=True, text=True)
    # Slurm forgets a finished job (MinJobAge): "Invalid job id" is gone, other errors are not.
    return bool(out.stdout.strip()) or (out.returncode != 0
                                         and "Invalid job id" not in out.stderr)


def read_address(path, wait_s: float) -> str:
    """What serve_lighthouse wrote to path, once there (it may start after a group); '' after
    wait_s."""
    deadline = time.monotonic() + wait_s
    while not Path(path).is_file() and time.monotonic() < deadline:
        time.sleep(1)
    return Path(path).read_text().strip() if Path(path).is_file() else ""
