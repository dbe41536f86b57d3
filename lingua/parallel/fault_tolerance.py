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
#4754). A group that joins behind the live ones heals from a live peer (weights, optimizer,
Run.train_state) through torchft's checkpoint transport. torchft is imported only when enabled.
"""

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import torch
from torch.distributed import ReduceOp
from torch.distributed.checkpoint import state_dict as dcp

from lingua.errors import ConfigError
from lingua.hooks import SKIP, UPDATE, Hook

logger = logging.getLogger("train")
_FLAT = dcp.StateDictOptions(flatten_optimizer_state_dict=True)   # keyed by parameter name


@dataclass
class FaultToleranceArgs:
    enabled: bool = False
    replica_groups: int = 1         # groups training together (each one launch of the job)
    group_id: int = 0               # this group's id, 0 .. replica_groups-1
    lighthouse: str = field(default_factory=lambda: os.environ.get("TORCHFT_LIGHTHOUSE", ""))
    min_replicas: int = 1           # fewest live groups a step may commit with
    quorum_timeout_s: int = 60      # wait for the lighthouse's quorum, and torchft's collectives


def validate_args(ft: FaultToleranceArgs, dist_args) -> None:
    """All of fault_tolerance's problems with this config, in one ConfigError."""
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
    """A torchft Manager per rank: the quorum before the step, gradients summed, the commit."""

    def __init__(self, ft: FaultToleranceArgs, env):
        # run: what a group behind the others heals (lingua/launch/run.py sets it)
        self.ft, self.env, self.manager, self.store, self.run = ft, env, None, None, None

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
        self.manager = Manager(
            pg, self._heal, self._state, min_replica_size=self.ft.min_replicas,
            use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=self.env.rank, world_size=self.env.world_size, **store,
            lighthouse_addr=self.ft.lighthouse, replica_id=f"group_{self.ft.group_id}",
            init_sync=False)
        # The groups start from the same seed or checkpoint: its step is the Manager's.
        self.manager.load_state_dict({"step": view.step, "batches_committed": 0})
        units = [m for part in view.parts for m in part.modules()
                 if hasattr(m, "set_all_reduce_hook")]
        for unit in units:
            unit.set_all_reduce_hook(self._sum_across_groups)
        self.hook_grads = not units
        # The first step's quorum: a group behind heals here, before the loop reads its step.
        self.manager.start_quorum(allow_heal=True)
        self.quorum_taken = True

    def before_step(self, view, step: int) -> None:
        if self.manager is not None and not self.quorum_taken:
            self.manager.start_quorum(allow_heal=True)   # sync: a heal is applied on return
        self.quorum_taken = False

    def _state(self) -> dict:
        """What a group behind this one loads (torchft's quorum thread calls it while the loop
        waits in the quorum): each rank's own shards, as the groups share one layout."""
        return {"model": [_local(dcp.get_model_state_dict(p)) for p in self.run.parts],
                "optim": [_local(dcp.get_optimizer_state_dict(p, o, options=_FLAT))
                          for p, o in zip(self.run.parts, self.run.optimizers.optimizers)],
                "train": self.run.train_state()}

    def _heal(self, state: dict) -> None:
        for part, optimizer, model, optim in zip(self.run.parts, self.run.optimizers.optimizers,
                                                 state["model"], state["optim"]):
            dcp.set_model_state_dict(part, _into(dcp.get_model_state_dict(part), model))
            own = dcp.get_optimizer_state_dict(part, optimizer, options=_FLAT)
            dcp.set_optimizer_state_dict(part, optimizer, _into(own, optim), options=_FLAT)
        self.run.restore_train_state(state["train"])   # jsonl's per-rank position: refused
        logger.info("group %d healed from a live group at step %d", self.ft.group_id, self.run.step)

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
        return UPDATE if self.manager is None or self.committed else SKIP

    def close(self, view) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def _local(state: dict) -> dict:
    return {k: getattr(v, "_local_tensor", v) for k, v in state.items()}


def _into(own: dict, received: dict) -> dict:
    """`own` state dict with `received`'s values: tensors copied into this rank's shards."""
    for key, value in received.items():
        if isinstance(own[key], torch.Tensor):
            getattr(own[key], "_local_tensor", own[key]).copy_(value)
        else:
            own[key] = value
    return own



def serve_lighthouse(min_replicas: int, root, poll_s: float = 2) -> None:
    """stool's lighthouse job: its address goes to <root>/lighthouse (atomically: a group never
    reads half of it); it serves while a job of <root>/lighthouse_jobs (the groups' ids, which
    stool writes once it has submitted them) is in Slurm's queue."""
    import time
    from pathlib import Path

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
    import subprocess

    out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ids], capture_output=True, text=True)
    # Slurm forgets a finished job (MinJobAge): "Invalid job id" is gone, other errors are not.
    return bool(out.stdout.strip()) or (out.returncode != 0
                                         and "Invalid job id" not in out.stderr)


def read_address(path, wait_s: float) -> str:
    """What serve_lighthouse wrote to path, once there (it may start after a group); '' after
    wait_s."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + wait_s
    while not Path(path).is_file() and time.monotonic() < deadline:
        time.sleep(1)
    return Path(path).read_text().strip() if Path(path).is_file() else ""
