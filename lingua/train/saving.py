"""The run's checkpoints: resume from the newest intact one, save when due (periodically, at the
end, or when a hook stops the run), and the train state beside the weights. Run (lingua/train/
loop.py) has these methods; the hooks' own train state comes in through Hooks.state_dict."""

import logging
from typing import Optional

import torch
from torch.distributed.checkpoint import state_dict as dcp

from lingua import checkpoint
from lingua.train.preemption import resume_command

logger = logging.getLogger("train")
_FLAT = dcp.StateDictOptions(flatten_optimizer_state_dict=True)   # keyed by parameter name


def where_to_resume(dump_dir) -> str:
    """Where a stopped run is and the command that goes on from there."""
    newest = checkpoint.newest(dump_dir)
    if newest is None:
        return f"no checkpoint saved yet; to start over, run again: {resume_command()}"
    return f"checkpoint {newest} saved; to resume, run again: {resume_command()}"


class Checkpointing:
    """Run's checkpoint methods (a mixin: they use Run's parts, optimizers, data and hooks)."""

    def resume(self) -> int:
        """Load the newest intact checkpoint, if any; returns the step the run continues from."""
        self.step = self._load_newest()
        return self.step

    def _load_newest(self) -> int:
        # Each rank checksums its share of the files and the ranks agree, so no rank reads all
        # of it (hundreds of GB) while the others wait under the collective timeout.
        resume_from = checkpoint.newest_verified(self.dump_dir, self.env.rank, self.env.world_size,
                                                 set_aside=True)
        return 0 if resume_from is None else self._load(resume_from)

    def _load(self, target) -> int:
        """Checkpoint `target` (weights, optimizer, train state), for resume and rollback alike."""
        state = checkpoint.load(target, self.parts, self.optimizers.optimizers,
                                self.env.rank, self.env.world_size)
        self.restore_train_state(state)
        return state["step"]

    def roll_back(self, step: int) -> bool:
        """A ROLLBACK vote at `step`: its batch again for the hooks (view.rerun), then the newest
        intact checkpoint before `step` loaded. False (nothing done) when there is none."""
        self.finish_save(block=True)   # the checkpoint being written is the newest one
        target = checkpoint.newest_verified(self.dump_dir, self.env.rank, self.env.world_size,
                                            set_aside=True)
        if target is None or int(target.name) >= step:
            return False
        self._zero_grads()
        self.rerun = int(target.name)   # what the hooks see while the batch runs again
        self.before_step(step)
        self.train_step(self.micro_batches)
        self.hooks.after_backward(self.view, step)
        self.rerun = None
        self._zero_grads()
        self.step = self._load(target)
        self.log.rewind(self.step)     # steps after the checkpoint run again: their rows go
        self.window.reset()
        return True

    def _zero_grads(self) -> None:
        for optimizer in self.optimizers.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def restore_train_state(self, state: dict) -> None:
        self.step = state["step"]
        self.train_loader.load_state_dict(state["data"])
        self.optimizers.load_scheduler_state(state["scheduler"])
        self.nonfinite_steps = state.get("nonfinite_steps", 0)
        # A checkpoint from before spike handling has neither: no batch had been skipped.
        self.batches_consumed = state.get("batches_consumed", state["step"])
        self.hooks.load_state_dict(state)

    def save_if_due(self) -> None:
        """With checkpoint.async_save a periodic save is written while the next steps run; the
        next save, the last step and a stop wait for it (each check is a collective)."""
        args = self.args
        last = self.step == args.steps
        self.saved_now = bool((args.checkpoint.every and self.step % args.checkpoint.every == 0)
                              or (last and args.checkpoint.save_final))
        if self.saved_now:   # the last step's save is written before the run ends
            self._save(wait=last)
            if self.pending_save is None:
                self.hooks.after_save(self.view, self.step)
        else:       # a save in flight (checkpoint.async_save) is finished once written
            self.finish_save(block=last)

    def stops(self) -> bool:
        """A hook stops the run: the state after this step written to disk before it leaves."""
        if not self.hooks.should_stop(self.view):
            return False
        if not self.saved_now:
            self._save()
        self.finish_save(block=True)
        return True

    def _save(self, before: Optional[tuple] = None, wait: bool = True) -> None:
        """`before`: (data state, batches consumed) to save instead of the current ones. With
        checkpoint.async_save and wait=False only the copy to CPU memory happens now. At most one
        save is in flight."""
        args, env = self.args, self.env
        self.finish_save(block=True)
        background = args.checkpoint.async_save and not wait
        saved = checkpoint.save(self.dump_dir, self.step, self.parts, self.optimizers.optimizers,
                                self.train_state(before), self.config_yaml, env.rank,
                                env.world_size, args.checkpoint.keep, self.checkpoint_in_use,
                                self.base, background=background)
        if background:
            self.pending_save = saved

    def snapshot(self) -> dict:
        """This rank's whole state in memory, for a peer of the same layout to load (a replica
        group that heals, lingua/parallel/fault_tolerance.py): its own shards, not gathered."""
        return {"model": [_local(dcp.get_model_state_dict(p)) for p in self.parts],
                "optim": [_local(dcp.get_optimizer_state_dict(p, o, options=_FLAT))
                          for p, o in zip(self.parts, self.optimizers.optimizers)],
                "train": self.train_state(), "rng": checkpoint.rng_state()}

    def load_snapshot(self, state: dict) -> None:
        """A peer's snapshot(), as a checkpoint is loaded; this run's log goes on from its step."""
        for part, optimizer, model, optim in zip(self.parts, self.optimizers.optimizers,
                                                 state["model"], state["optim"]):
            dcp.set_model_state_dict(part, _into(dcp.get_model_state_dict(part), model))
            own = dcp.get_optimizer_state_dict(part, optimizer, options=_FLAT)
            dcp.set_optimizer_state_dict(part, optimizer, _into(own, optim), options=_FLAT)
        train, behind = state["train"], 0
        if train["data"].get("dp_rank", self.env.dp_rank) != self.env.dp_rank:
            # jsonl/parquet: a data rank's position is its own, so this rank reads its stream
            # forward by the batches it is behind (ours from the start or our checkpoint).
            behind = train["batches_consumed"] - self.batches_consumed
            train = dict(train, data=self.train_loader.state_dict())
        self.restore_train_state(train)
        for _ in range(behind):
            self.train_loader.next_step()
        checkpoint.set_rng_state(state["rng"])
        self.log.rewind(self.step)
        self.window.reset()

    def train_state(self, before: Optional[tuple] = None) -> dict:
        """Step, data, scheduler, hooks: in checkpoints, and sent to a group that heals."""
        data_state, batches = before if before is not None else (
            self.train_loader.state_dict(), self.batches_consumed)
        return {"step": self.step, "data": data_state,
                "scheduler": self.optimizers.scheduler_state(),
                "nonfinite_steps": self.nonfinite_steps, "batches_consumed": batches,
                **self.hooks.state_dict()}

    def writing_count(self) -> dict:
        """Whether this rank still writes in the background, in the step's tally (no extra
        collective)."""
        pending = self.pending_save
        return {"ranks_writing": float(pending is not None and not pending.written_here())}

    def finish_save(self, block: bool) -> None:
        """Make the checkpoint being written visible once every rank's write is done (block: wait
        for it). Collective; a write that failed on any rank raises RunError on every rank."""
        if self.pending_save is None:
            return
        all_written = self.tally.get("ranks_writing") == 0
        if self.pending_save.finish(block, all_written) is not None:
            step, self.pending_save = self.pending_save.step, None
            self.hooks.after_save(self.view, step)



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
