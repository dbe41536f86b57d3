"""probe.every in the loop (ProbeHook): the probe (lingua.observe.probe) hooks the model for the
steps it samples, records after backward (gradients before clipping), counts its alerts into the
metrics row, and sends its plots to wandb at the end. The spike hook asks it for more: the step
after a spike in full (probe_in_full) and a rolled-back spiking batch again (probe_batch)."""

from typing import Optional

from lingua.observe import metrics
from lingua.observe.probe import Probe
from lingua.train.hooks import Hook
from lingua.train.microbatch import StepLoss


class ProbeHook(Hook):
    def __init__(self, args, spikes_on: bool):
        self.args, self.spikes_on = args.probe, spikes_on
        self.probe: Optional[Probe] = None   # made at start when probe.every, else at a spike
        self.alerts = 0        # since the last metrics row
        self.probing = False   # this step's forwards are hooked
        self.in_full = False   # the next step is probed whatever probe.every says

    def start(self, run) -> None:
        if not self.args.every and self.spikes_on and run.env.is_main:
            # A probe made at a spike (probe_in_full) comes after the resume: the lines of the
            # steps about to run again must go now, as Probe does when probe.every is set.
            metrics.drop_rows_after(run.dump_dir / "probe" / "probe.jsonl", run.step)
        if self.args.every:
            self.probe = Probe(self.args, run.parts, run.env, run.dump_dir, run.step)

    def _made(self, run) -> Probe:
        """The probe, made on first use when probe.every=0 (it has no hooks until started)."""
        if self.probe is None:
            self.probe = Probe(self.args, run.parts, run.env, run.dump_dir, run.step)
            if run.env.is_main:
                self.probe.dir.mkdir(parents=True, exist_ok=True)
        return self.probe

    def probe_in_full(self, run) -> None:
        self._made(run)
        self.in_full = True

    def before_step(self, run, step: int) -> None:
        self.probing = (self.probe is not None and self.probe.active(step)) or self.in_full
        self.in_full = False
        if self.probing:
            self.probe.start()

    def after_backward(self, run, step: int) -> dict:
        if self.probing:  # weights and gradients as the optimizer will see them, before clipping
            self.probe.stop()
            self.alerts += self.probe.finish_step(step, run.log.wandb_run)
        return {}

    def probe_batch(self, run, step: int, micro_batches, back_to: int) -> None:
        """A spiking batch again, forward and backward on the weights that produced the spike,
        with the probe on; recorded as step `step`, its gradients thrown away. The probe's lines
        after the checkpoint go first: those steps run again and will write their own."""
        probe = self._made(run)
        if run.env.is_main:
            metrics.drop_rows_after(probe.path, back_to)
        probe.start()
        run.step_loss = StepLoss(run.env.device)
        run.train_step(micro_batches)
        probe.stop()
        self.alerts += probe.finish_step(step, run.log.wandb_run)
        for optimizer in run.optimizers.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def metrics(self, run, row: dict) -> None:
        if self.probe is not None:
            row["probe_alerts"], self.alerts = self.alerts, 0

    def close(self, run) -> None:
        wandb_run = getattr(getattr(run, "log", None), "wandb_run", None)   # no log: failed early
        if self.probe is not None and run.env.is_main and wandb_run is not None:
            self.probe.log_plots(wandb_run)
