"""The training loop: `train_loop(run)` is one step after another, read top to bottom; `Run` is
the state it moves. What happens around a step (spikes, probing, evaluation, preemption, ...) is
no branch of the loop but a Hook (lingua/hooks.py) called at the step's fixed points.
"""

import logging
import math
import time
from pathlib import Path
from typing import Optional

import torch

from lingua import checkpoint, config, data, optim
from lingua.errors import RunError
from lingua.hooks import ROLLBACK, SKIP, UPDATE, Hooks, Request
from lingua.model import loss as loss_module
from lingua.model.layers import head_dim, inferring_shapes
from lingua.observe import metrics, profiling
from lingua.parallel import distributed, pipeline
from lingua.parallel.distributed import DistEnv
from lingua.parallel.tensor_parallel import loss_parallel_context
from lingua.train import microbatch, tally
from lingua.train.app import App
from lingua.train.build import mixed_precision
from lingua.train.microbatch import StepLoss, sequence_shard
from lingua.train.saving import Checkpointing

logger = logging.getLogger("train")


def train_loop(run: "Run") -> bool:
    """Train from run.step to args.steps; False when a hook stopped the run early (saved)."""
    hooks, steps, view = run.hooks, run.args.steps, run.view
    run.open()
    hooks.start(view)
    while run.step < steps:
        run.phases.start_step(timed=run.logs_at(run.step + 1))
        t0 = time.perf_counter()
        step = run.before_step(run.step + 1)       # the hooks' requests: skip batches, probe, heal
        t_fetch = time.perf_counter()
        with torch.profiler.record_function("data"):
            micro_batches = run.next_batches()
        t_data = time.perf_counter() - t_fetch

        run.train_step(micro_batches)              # forward and backward (or the pipeline)
        counts = hooks.after_backward(view, step)

        grad_norm, lr, decision = run.clip_and_update(step, counts)
        if decision == ROLLBACK:
            continue   # from the checkpoint's step, with the spike's batches to be skipped
        run.step = step
        run.window.add(time.perf_counter() - t0, t_data, run.global_tokens,
                       run.phases.step_seconds())
        hooks.after_step(view, step)               # evaluation at eval.every, gc, ...

        if run.logs_at(step):
            run.log_row(grad_norm, lr)
        run.save_if_due()
        if run.stops():                            # a signal: saved, stop
            break
    return run.step == steps


def evaluates_at(args, step: int) -> bool:
    """Validation (and downstream tasks) after this step? `args`: the run's whole config."""
    e = args.eval
    return bool((e.every and step % e.every == 0) or (step == args.steps and e.at_end))


class RunView:
    """What a hook sees of the run (lingua/hooks.py), read-only: hooks decide, the loop acts.
    MEMBERS are read from Run (whose __init__ says what each holds)."""
    MEMBERS = ("args", "env", "step", "parts", "tally", "decision", "batches_consumed",
               "probe_requested", "rerun", "eval_loss", "snapshot")   # and wandb_run, mfu_basis

    def __init__(self, run: "Run"):
        object.__setattr__(self, "_run", run)

    def __getattr__(self, name):
        if name not in RunView.MEMBERS:
            raise AttributeError(f"hooks see only {RunView.MEMBERS}, wandb_run and mfu_basis")
        return getattr(self._run, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"a hook cannot set run.{name}: hooks decide and the loop acts "
                             f"(lingua/hooks.py); return a Request, a vote or a stop instead.")

    @property
    def wandb_run(self):   # None without wandb, or before the log opened
        return getattr(getattr(self._run, "log", None), "wandb_run", None)

    @property
    def mfu_basis(self) -> tuple:   # (FLOPs of one step on this rank, the peak MFU divides by)
        run = self._run
        return run.flops_per_token * run.global_tokens / run.env.world_size, run.peak


class Run(Checkpointing):
    """One training run's state: model parts, optimizers, data, pipeline, logging, position."""

    def __init__(self, args, env: DistEnv, app: App, parts: list, stage_ids: list,
                 optimizers: optim.Optimizers, hooks: Hooks = None,
                 checkpoint_in_use: Optional[checkpoint.InUse] = None):
        self.args, self.env, self.app = args, env, app
        self.parts, self.optimizers = parts, optimizers
        self.hooks = hooks if hooks is not None else Hooks()
        self.dump_dir = Path(args.dump_dir)
        self.loss_parallel = app.loss_parallel(args.distributed)
        d = args.distributed
        self.loss = loss_module.for_training(app.loss, d.compile, d.compile_backend,
                                             self.loss_parallel)
        self.train_loader = data.build_train_loader(args.data, env.dp_rank, env.dp_size, args.seed)
        self.global_batch = args.data.batch_size * env.dp_size * args.data.grad_accum
        self.global_tokens = self.global_batch * args.data.seq_len
        self.loss_denominator = self.global_tokens   # the step's counted targets (train_step)
        self.pipe = self._build_pipeline(stage_ids)
        self.phases = profiling.PhaseTimer(env.device)   # fwd_s, bwd_s, optim_s in metrics
        self.step_loss = StepLoss(env.device)   # the current step's losses (train_step)
        self.nonfinite_steps = 0  # steps skipped for NaN/Inf gradients (optim.nonfinite=skip)
        # next_step() calls so far, rollbacks' skips included: a rollback's skip range is in these
        # numbers, the same on every layout (the jsonl loader has no global index of its own).
        self.batches_consumed = 0
        self.step = 0             # steps done; resume() moves it to the newest checkpoint's
        self.pending_save: Optional[checkpoint.PendingSave] = None  # checkpoint.async_save's write
        self.saved_now = False    # this step's checkpoint was saved (save_if_due)
        # LoRA on checkpoint.init_from: checkpoints leave the frozen base out (base.json)
        self.base = checkpoint.frozen_base(parts, args.checkpoint.init_from)
        self.tally: dict = {}     # the current step's tally over the ranks (lingua/train/tally.py)
        self.decision = UPDATE    # what the current step did with its update (hooks.py)
        self.micro_batches: list = []   # the current step's (next_batches)
        self.probe_requested = False    # a hook's Request for this step (before_step)
        self.rerun: Optional[int] = None   # a rollback's checkpoint step while its batch reruns
        self.data_before = None   # where the data stood before this step (data_position_to_undo)
        self.view = RunView(self)
        # step -> True while that checkpoint must outlive checkpoint.keep (an evaluation job's)
        self.checkpoint_in_use = checkpoint_in_use

    def _build_pipeline(self, stage_ids):
        d = self.args.distributed
        if d.pp == 1:
            return None

        def loss_fn(output, target):  # called by the schedule on the last stage, per micro-batch
            if inferring_shapes():   # torch's extra first call, on empty tensors: eager,
                return self.app.loss(output, target).loss_sum / self.loss_denominator  # eager
            out = self.loss(output, target)
            self.step_loss.add(out)
            return out.loss_sum / self.loss_denominator

        n_microbatches = (d.pp_microbatches
                          or pipeline.default_microbatches(d.pp, d.pp_virtual_stages))
        return pipeline.build_schedule(self.parts, stage_ids, d.pp * d.pp_virtual_stages,
                                       self.env.mesh["pp"], self.env.device, d.pp_schedule,
                                       n_microbatches, loss_fn)

    def train(self) -> bool:
        """Train up to args.steps; False when a signal stopped it early (after saving). Every
        hook's close() runs however the loop ends, before the log closes."""
        try:
            completed = train_loop(self)
        finally:
            self.hooks.close(self.view)
        self.close()
        return completed

    def train_step(self, micro_batches) -> None:
        """Each micro-batch's summed loss is divided by the global batch's count of targets
        and gradients are summed over ranks: the gradient of the mean loss, whatever the layout."""
        args, env = self.args, self.env
        self.step_loss = StepLoss(env.device)   # this step's losses only
        self.loss_denominator = micro_batches[0].step_targets or self.global_tokens
        with loss_parallel_context(self.loss_parallel):
            for batch in micro_batches:
                with sequence_shard(self.parts, batch, args, env, self.app) as mb:
                    if self.pipe is not None:
                        # The schedule interleaves forwards and backwards, so only their sum is
                        # timed, and autocast covers the backwards too (harmless: backward ops
                        # run in the dtypes their forwards saved).
                        with self.phases.phase("fwd_bwd"), mixed_precision(args, env, self.parts):
                            self.pipe.step(mb.tokens, mb.target, mb.doc_ids, mb.model_kwargs)
                        continue
                    with self.phases.phase("fwd"), mixed_precision(args, env, self.parts):
                        out = microbatch.forward_loss(self.loss, self.parts[0], mb)
                    with self.phases.phase("bwd"):
                        (out.loss_sum / self.loss_denominator).backward()
                    self.step_loss.add(out)

    def before_step(self, step: int) -> int:
        """Each hook's Request carried out before the next hook is asked (a rerun skips no data);
        returns the step to run, which a peer's state loaded (a heal) moves."""
        self.probe_requested = self.rerun is not None
        self.data_before = self.data_position_to_undo()
        for hook in self.hooks:
            request = hook.before_step(self.view, step) or Request()
            if request.load is not None:
                self.load_snapshot(request.load)
                step, self.data_before = self.step + 1, self.data_position_to_undo()
            for _ in range(0 if self.rerun is not None else request.skip_batches):
                self.train_loader.next_step()
                self.batches_consumed += 1
            self.probe_requested |= request.probe
        return step

    def next_batches(self) -> list:
        """This step's micro-batches (also self.micro_batches, for a rollback's rerun)."""
        self.micro_batches = self.train_loader.next_step()
        self.batches_consumed += 1
        return self.micro_batches

    def eval_loss(self, batch):
        """Summed token loss of this rank's share of a validation batch, through the training
        layout (None on pipeline stages before the last)."""
        args, env = self.args, self.env
        with loss_parallel_context(self.loss_parallel), \
                sequence_shard(self.parts, batch, args, env) as mb, \
                mixed_precision(args, env, self.parts):
            if self.pipe is not None:
                return self.pipe.eval_loss(mb.tokens, mb.target, mb.doc_ids,
                                           loss_fn=loss_module.token_loss_sum)
            logits = self.parts[0](mb.tokens, doc_ids=mb.doc_ids, positions=mb.positions)
            return loss_module.token_loss_sum(logits, mb.target)

    def data_position_to_undo(self) -> Optional[tuple]:
        """Where the data stood before this step, for optim.nonfinite=stop to save."""
        if self.args.optim.nonfinite != "stop":
            return None
        return self.train_loader.state_dict(), self.batches_consumed

    def clip_and_update(self, step: int, counts: dict) -> tuple:
        """Clip, then update, unless the gradient norm is not finite or a hook votes otherwise
        (ROLLBACK becomes SKIP where it cannot roll back). Returns (grad_norm, lr, decision)."""
        with self.phases.phase("optim"):
            norm = optim.clip_grad_norm(self.parts, self.args.optim.clip, self.pp_group)
            lr = self.optimizers.lr
            # The step's one collective of decisions and its one host read (tally.py).
            self.tally = tally.over_ranks(self.env, self.step_loss.sums.get("loss"), norm,
                                          {**self.writing_count(), **counts})
        grad_norm = self.tally["grad_norm"]
        if not math.isfinite(grad_norm):
            self._skip_nonfinite(grad_norm, self.data_before)
            self.decision = SKIP
        else:   # outside the optim phase: a rollback runs a batch again and reloads
            self.decision = self.hooks.vote(self.view, step)
            if self.decision == ROLLBACK and not self.roll_back(step):
                self.decision = SKIP
        with self.phases.phase("optim"):
            if self.decision == SKIP:
                self.optimizers.skip()
            elif self.decision == UPDATE:
                self.optimizers.step()
        return grad_norm, lr, self.decision

    def _skip_nonfinite(self, grad_norm, data_before) -> None:
        if self.args.optim.nonfinite != "skip":
            self._stop_on_nonfinite(grad_norm, data_before)
        self.nonfinite_steps += 1
        if self.env.is_main:
            logger.warning("step %d: gradient norm is %s; update skipped "
                           "(optim.nonfinite=skip), %d such steps so far",
                           self.step + 1, grad_norm, self.nonfinite_steps)

    def _stop_on_nonfinite(self, grad_norm, data_before: tuple) -> None:
        """Nothing was updated yet: save the previous step's state with the data position
        before this step, and stop."""
        self._zero_grads()
        saved = "nothing was saved (no step had run)"
        if self.step > 0:
            self._save(before=data_before)
            saved = (f"the state after step {self.step} is saved in "
                     f"{checkpoint.newest(self.dump_dir)}")
        raise RunError(
            f"Step {self.step + 1}: the gradient norm is {grad_norm} (NaN or Inf), so the "
            f"update was not applied and the run stopped (optim.nonfinite=stop); {saved}. Look "
            f"at the last rows of metrics.jsonl and, with probe.every=1 from a resumed run, at "
            f"which module's activations blew up; then lower optim.lr, raise optim.warmup, train "
            f"in fp32 (distributed.model_dtype=fp32), or set optim.nonfinite=skip to drop such "
            f"steps, and run the same command to resume.")

    def logs_at(self, step: int) -> bool:
        """Also at every evaluation step: its results go in that step's row."""
        return (step % self.args.logging.every == 0 or step == self.args.steps
                or evaluates_at(self.args, step))

    def open(self) -> None:
        args, env = self.args, self.env
        self.flops_per_token = self._flops_per_token()
        # Measured once for the run, on this model's shapes: every row's MFU divides by it.
        self.peak = metrics.run_peak(env.device, args.distributed.model_dtype, self.parts,
                                     args.data.batch_size * args.data.seq_len, self.step,
                                     self.dump_dir if env.is_main else None)
        logger.info("training steps %d -> %d, global batch %d x %d tokens", self.step, args.steps,
                    self.global_batch, args.data.seq_len)
        self.log = metrics.MetricLogger(self.dump_dir, args.logging, config.to_dict(args),
                                        env.is_main, self.step)
        self.config_yaml = config.to_yaml(args)
        self.window = metrics.Window()
        self.pp_group = env.mesh["pp"].get_group() if env.dims.pp > 1 else None

    def close(self) -> None:
        self.log.close()
        if self.env.is_main and self.step == self.args.steps:
            logger.info("done: run directory %s (config.yaml, metrics.jsonl, checkpoints/)",
                        self.dump_dir.resolve())

    def _flops_per_token(self) -> float:
        if self.app.flops_per_token is not None:
            return self.app.flops_per_token(self.args)
        m = self.args.model
        with torch.device("meta"):  # FLOPs of the whole model, whatever this rank holds
            model = self.app.model_class(m)
            if self.app.transform_model is not None:   # LoRA: which weights are frozen
                self.app.transform_model(model, self.args)
            return metrics.flops_per_token(model, m.n_layers, m.n_heads * head_dim(m),
                                           self.args.data.seq_len, m.tie_embeddings)

    def log_row(self, grad_norm, lr) -> None:
        """Collective: the metrics.jsonl row of this step."""
        env, window = self.env, self.window
        tokens_per_s = window.tokens_per_s()
        losses = self.step_loss.reduced(env, self.pipe is None or self.pipe.has_last)
        row = {"step": self.step, "loss": losses.pop("loss"), "lr": lr,
               "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
               **metrics.mfu_fields(self.flops_per_token * tokens_per_s / env.world_size,
                                    self.peak),
               "data_s": window.data_s(), "step_s": window.step_s(),
               **window.phase_s(), "peak_mem_gib": metrics.peak_memory_gib(env.device),
               "nonfinite_steps": self.nonfinite_steps, **self._skipped_data(),
               "eta_s": window.eta_s(self.args.steps - self.step)}
        row.update(losses)    # the app's loss metrics (LossOutput.metrics)
        self.hooks.metrics(self.view, row)   # evaluation's fields too, at evaluation steps
        window.reset()
        self.log.log(row)
        if env.is_main:
            logger.info(metrics.format_line(row, self.args.steps))

    def _skipped_data(self) -> dict:
        """Bad data lines skipped so far, summed over data-parallel ranks (cp/tp/pp peers read
        the same lines)."""
        reasons = self.train_loader.skipped()
        counts = torch.tensor([float(sum(reasons.values())), *map(float, reasons.values())],
                              dtype=torch.float64, device=self.env.device)
        counts = distributed.all_reduce_sum(counts, self.env, dims=("dp",))
        return {"skipped_lines": int(counts[0]),
                **{f"skipped_{reason}": int(n) for reason, n in zip(reasons, counts[1:].tolist())}}
