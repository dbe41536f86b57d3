"""Loss spikes (docs/training.md): every rank decides alone on the step's tally; the windows are in
the train state (a resume decides as before). A rollback's batch range counts next_step() calls
(the same in every layout), recorded in `spikes.jsonl` before the reload."""

import json
import logging
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from lingua import checkpoint
from lingua.errors import ConfigError, RunError
from lingua.hooks import ROLLBACK, SKIP, UPDATE, Hook, Request

logger = logging.getLogger("train")

RECORDS = "spikes.jsonl"
# SpikeMonitor's counters and flags, saved in the train state, with their initial values.
COUNTERS = {"spike_steps": 0, "skipped_steps": 0, "in_a_row": 0, "since_row": False,
            "probe_next": False}


@dataclass
class SpikeArgs:
    """`spikes.*`: what a loss spike does (docs/training.md, "Loss spikes")."""
    policy: str = "log"             # off | log | skip | rollback
    on: str = "loss"                # loss | grad_norm | both: what is judged
    rule: str = "median"            # median: > factor x running median | sigma: > mean + sigmas std
    factor: float = 2.0
    sigmas: float = 6.0
    window: int = 50                # accepted steps in the statistics; none judged before it fills
    warmup: int = 0                 # and none judged in the first N steps
    skip_before: int = 0            # rollback: data batches skipped before the spiking one
    skip_after: int = 0             # and after it (0, 0: the spiking batch alone)
    max_rollbacks: int = 3          # rollbacks to one checkpoint before the run stops
    max_skips: int = 10             # skip: spike steps in a row before the run stops


def validate_args(args: SpikeArgs) -> None:
    choices = {"policy": ("off", "log", "skip", "rollback"), "on": ("loss", "grad_norm", "both"),
               "rule": ("median", "sigma")}
    for key, allowed in choices.items():
        if getattr(args, key) not in allowed:
            raise ConfigError(f"spikes.{key}={getattr(args, key)!r} is unknown: use one of "
                              f"{' | '.join(allowed)} (docs/training.md, \"Loss spikes\").")
    if not (args.factor > 1 and math.isfinite(args.factor)):
        raise ConfigError(f"spikes.factor={args.factor} must be above 1 (a spike is a value "
                          f"above factor x the running median), e.g. 2.0.")
    if not (args.sigmas > 0 and math.isfinite(args.sigmas)):
        raise ConfigError(f"spikes.sigmas={args.sigmas} must be positive, e.g. 6.0.")
    if args.window < 2:
        raise ConfigError(f"spikes.window={args.window} must be at least 2 steps (a median or a "
                          f"standard deviation needs several values), e.g. 50.")
    for key in ("warmup", "skip_before", "skip_after"):
        if getattr(args, key) < 0:
            raise ConfigError(f"spikes.{key}={getattr(args, key)} must be 0 or more.")
    for key in ("max_rollbacks", "max_skips"):
        if getattr(args, key) < 1:
            raise ConfigError(f"spikes.{key}={getattr(args, key)} must be at least 1.")


@dataclass
class Spike:
    step: int
    on: str             # "loss" or "grad_norm"
    value: float
    threshold: float
    why: str            # how the threshold was made, for messages

    def __str__(self) -> str:
        return (f"{self.on} spike at step {self.step}: {self.value:.4g} is above the threshold "
                f"{self.threshold:.4g} ({self.why})")


class SpikeMonitor:
    """Deterministic: the same values in the same order give the same decisions."""

    def __init__(self, args, verbose: bool = True):
        self.args, self.verbose = args, verbose   # verbose: this rank logs (rank 0)
        watched = ("loss", "grad_norm") if args.on == "both" else (args.on,)
        self.windows = {name: deque(maxlen=args.window) for name in watched}
        self.spike_steps = 0      # spikes found on the kept trajectory (log and skip)
        self.skipped_steps = 0    # updates not applied because of a spike
        self.in_a_row = 0         # consecutive skipped spike steps (spikes.max_skips)
        self.rollbacks: List[dict] = []   # one record per rollback (what spikes.jsonl holds)
        self.since_row = False    # a spike since the last metrics row (its loss_spike)
        self.probe_next = False   # probe the next step in full (log, skip: the step after one)

    @property
    def on(self) -> bool:
        return self.args.policy != "off"

    def threshold(self, name: str) -> Optional[tuple]:
        """(threshold, how it was made) from the window of `name`; None until the window is full."""
        window, a = self.windows[name], self.args
        if len(window) < window.maxlen:
            return None
        if a.rule == "median":
            median = statistics.median(window)
            return a.factor * median, (f"{a.factor:g} x the median {median:.4g} of "
                                             f"the last {len(window)} steps")
        mean, std = statistics.fmean(window), statistics.stdev(window)
        return mean + a.sigmas * std, (f"the mean {mean:.4g} + {a.sigmas:g} standard "
                                             f"deviations ({std:.4g}) of the last {len(window)} "
                                             f"steps")

    def check(self, step: int, values: dict) -> Optional[Spike]:
        """Changes nothing: the caller then calls accept() or skipped()."""
        if not self.on or step <= self.args.warmup:
            return None
        for name in self.windows:
            made = self.threshold(name)
            if made is None:
                continue
            value = values[name]
            if not math.isfinite(value) or value > made[0]:
                return Spike(step, name, value, made[0], made[1])
        return None

    def accept(self, values: dict) -> None:
        """Under `log` spikes join (a new level becomes normal); skip, rollback never accept one."""
        self.in_a_row = 0
        for name, window in self.windows.items():
            if math.isfinite(values[name]):
                window.append(values[name])

    def logged(self, spike: Spike) -> None:
        self.spike_steps += 1
        if self.verbose:
            logger.warning("%s; the update was applied (spikes.policy=log). probe.jsonl holds the "
                           "next step, probed in full: it shows which module moved.", spike)

    def skipped(self, spike: Spike, reason: str = "spikes.policy=skip") -> None:
        """Stops after more than spikes.max_skips in a row (skipping forever freezes weights)."""
        self.spike_steps += 1
        self.skipped_steps += 1
        self.in_a_row += 1
        if self.verbose:
            logger.warning("%s; the update was skipped (%s), %d spike steps skipped so far",
                           spike, reason, self.skipped_steps)
        if self.in_a_row > self.args.max_skips:
            raise RunError(
                f"Steps {spike.step - self.in_a_row + 1}..{spike.step}: {self.in_a_row} spike "
                f"steps in a row had their update skipped (spikes.max_skips="
                f"{self.args.max_skips}); the {spike.on} ({spike.value:.4g} at step "
                f"{spike.step}, threshold {spike.threshold:.4g}) has moved to a new level, and "
                f"skipping more updates would only freeze the weights. Look at the last rows of "
                f"metrics.jsonl and at probe.jsonl (the step after a spike is probed); then "
                f"train through it (spikes.policy=log), raise spikes.factor or "
                f"spikes.sigmas, or go back before it with spikes.policy=rollback, and run "
                f"the same command to resume from the newest checkpoint.")

    def record_rollback(self, spike: Spike, batch: int, checkpoint_step: int,
                        checkpoint_dir: str) -> dict:
        """RunError when the run already went back there spikes.max_rollbacks times."""
        a = self.args
        before = sum(1 for r in self.rollbacks if r.get("checkpoint") == checkpoint_step)
        if before >= a.max_rollbacks:
            raise RunError(
                f"Step {spike.step}: {spike.on} {spike.value:.4g} is above the threshold "
                f"{spike.threshold:.4g} ({spike.why}) again, after {before} rollbacks to "
                f"checkpoint {checkpoint_dir} (spikes.max_rollbacks="
                f"{a.max_rollbacks}; {RECORDS} in the run directory lists them): the "
                f"spike is not caused by a few bad batches. Look at probe.jsonl (the spiking "
                f"batch was probed) and metrics.jsonl; then lower optim.lr, raise optim.warmup "
                f"or optim.clip, skip a wider range (spikes.skip_before / "
                f"spikes.skip_after), or raise spikes.max_rollbacks, and run the same "
                f"command to resume from that checkpoint.")
        record = {"step": spike.step, "on": spike.on, "value": spike.value,
                  "threshold": spike.threshold, "rule": a.rule, "why": spike.why,
                  "batch": batch, "checkpoint": checkpoint_step, "checkpoint_dir": checkpoint_dir,
                  "skip": [max(1, batch - a.skip_before), batch + a.skip_after]}
        self.rollbacks.append(record)
        return record

    def skips_batch(self, batch: int) -> Optional[dict]:
        for record in self.rollbacks:
            first, last = record["skip"]
            if first <= batch <= last:
                return record
        return None

    def merge_records(self, records: list) -> None:
        """Add rollback records read back (spikes.jsonl, a checkpoint), each once."""
        known = {_key(r) for r in self.rollbacks}
        for record in records:
            if _key(record) not in known:
                self.rollbacks.append(record)
                known.add(_key(record))

    def state_dict(self) -> dict:
        # Plain lists, numbers and strings: train states are loaded with weights_only=True.
        return {"windows": {name: list(w) for name, w in self.windows.items()},
                "rollbacks": [dict(r) for r in self.rollbacks],
                **{key: getattr(self, key) for key in COUNTERS}}

    def load_state_dict(self, state: dict, keep_records: bool = False) -> None:
        """`keep_records`: a rollback keeps the records it knows, adding the checkpoint's."""
        for name, window in self.windows.items():
            window.clear()
            window.extend(state.get("windows", {}).get(name, []))
        for key, initial in COUNTERS.items():
            setattr(self, key, state.get(key, initial))
        if not keep_records:
            self.rollbacks = []
        self.merge_records(state.get("rollbacks", []))

    def metrics(self, skipped_batches: int) -> dict:
        # A range written into spikes.jsonl by hand (no checkpoint) is no rollback.
        return {"spike_steps": self.spike_steps, "spike_skipped_steps": self.skipped_steps,
                "rollbacks": sum(1 for r in self.rollbacks if "checkpoint" in r),
                "skipped_batches": skipped_batches}


def _key(record: dict) -> tuple:
    return record.get("step"), record.get("batch"), tuple(record["skip"])


def records_path(dump_dir) -> Path:
    return Path(dump_dir) / RECORDS


def read_records(dump_dir) -> list:
    """An unreadable line is an error: dropping it would train on batches meant to be skipped."""
    path = records_path(dump_dir)
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            first, last = (int(x) for x in record["skip"])
        except (ValueError, KeyError, TypeError):
            raise RunError(f"{path}, line {number} is not a rollback record ({line[:200]!r}): "
                           f"each line is a JSON object with \"skip\": [first batch, last batch]. "
                           f"Repair or remove that line, then run the same command "
                           f"again.") from None
        record["skip"] = [first, last]
        records.append(record)
    return records


def append_record(dump_dir, record: dict) -> None:
    """One line in spikes.jsonl, fsynced: a crash right after must not lose the range."""
    with open(records_path(dump_dir), "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


class SpikeHook(Hook):
    """spikes.policy in the loop; always listed (policy=off skips spikes.jsonl's ranges too)."""

    def __init__(self, args, env):
        self.monitor = SpikeMonitor(args.spikes, env.is_main)
        self.policy, self.env, self.dump_dir = args.spikes.policy, env, args.dump_dir
        self.values: Optional[dict] = None    # the step's values, accepted after its update
        self.rolling_back: Optional[tuple] = None   # (spike, its data batch) while rolling back
        self.keep_records = False             # a rollback's reload keeps the records it knows

    def start(self, view) -> None:
        """Rank 0 reads spikes.jsonl and tells the others, or its error (none may wait alone)."""
        outcome = [None]
        if self.env.is_main:
            try:
                outcome = [read_records(self.dump_dir)]
            except RunError as err:
                outcome = [str(err)]
        if self.env.world_size > 1:
            torch.distributed.broadcast_object_list(outcome, src=0)
        if isinstance(outcome[0], str):
            raise RunError(outcome[0])
        self.monitor.merge_records(outcome[0])

    def before_step(self, view, step: int) -> Optional[Request]:
        if view.rerun is not None:   # the loop rolls back to checkpoint view.rerun
            self._record_rollback(view.rerun)
            return None
        skip, batch = 0, view.batches_consumed + 1
        while (record := self.monitor.skips_batch(batch + skip)) is not None:
            if self.env.is_main:
                logger.info("data batch %d skipped (range %d..%d, from the loss spike at step %s)",
                            batch + skip, *record["skip"], record.get("step", "?"))
            skip += 1
        probe, self.monitor.probe_next = self.monitor.probe_next, False   # after a spike: in full
        return Request(skip_batches=skip, probe=probe)

    def vote(self, view, step: int) -> str:
        # The step's tally, the same on every rank: all vote alike.
        monitor, tally = self.monitor, view.tally
        self.values = ({"loss": tally["loss"], "grad_norm": tally["grad_norm"]}
                       if monitor.on else None)
        spike = None if self.values is None else monitor.check(step, self.values)
        if spike is None:
            return UPDATE
        monitor.since_row = True
        if self.policy == "rollback":
            self.rolling_back = (spike, view.batches_consumed)
            return ROLLBACK
        monitor.probe_next = True
        if self.policy == "skip":
            monitor.skipped(spike)
            return SKIP
        monitor.logged(spike)
        return UPDATE

    def after_step(self, view, step: int) -> None:
        if self.rolling_back is not None:   # the loop found no checkpoint before it: skipped
            spike, self.rolling_back = self.rolling_back[0], None
            self.monitor.probe_next = True
            self.monitor.skipped(spike, "spikes.policy=rollback, but no checkpoint was saved "
                                        "before it yet")
        elif self.values is not None and view.decision == UPDATE:
            self.monitor.accept(self.values)

    def _record_rollback(self, back_to: int) -> None:
        (spike, batch), self.rolling_back = self.rolling_back, None
        target = checkpoint.checkpoints_dir(self.dump_dir) / str(back_to)
        record = self.monitor.record_rollback(spike, batch, back_to, str(target))
        if self.env.is_main:
            append_record(self.dump_dir, record)
            logger.warning("%s; rolling back to %s and skipping data batches %d..%d (rollback "
                           "%d, recorded in %s)", spike, target, *record["skip"],
                           len(self.monitor.rollbacks), records_path(self.dump_dir))
        self.keep_records = True

    def metrics(self, view, row: dict) -> None:
        monitor = self.monitor
        if monitor.on or monitor.rollbacks:
            # loss_spike: a spike since the previous row (whatever was done about it)
            row["loss_spike"], monitor.since_row = int(monitor.since_row), False
            row.update(monitor.metrics(skipped_batches=view.batches_consumed - view.step))

    def state_dict(self) -> dict:
        return {"spikes": self.monitor.state_dict()}

    def load_state_dict(self, train_state: dict) -> None:
        self.monitor.load_state_dict(train_state.get("spikes", {}), self.keep_records)
        if self.keep_records:   # a rollback's reload: the next row says so
            self.monitor.since_row, self.keep_records = True, False
