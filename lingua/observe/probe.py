"""Activation, weight and gradient statistics: `probe.every=N`, one JSON line per probe step in
`dump_dir/probe/probe.jsonl`; hooks exist only during a probe step. Each rank's vectors of sums and
maxima are reduced over the ranks holding distinct parts, so every layout records the whole tensor
(docs/observing.md, "Probing activations, weights and gradients")."""

import fnmatch
import json
import logging
import math
import statistics
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from lingua.errors import ConfigError
from lingua.hooks import Hook
from lingua.model.layers import CoreAttention, inferring_shapes
from lingua.model.moe import Router
from lingua.observe.metrics import drop_rows_after
from lingua.observe.probe_report import plot
from lingua.observe.probe_stats import (
    attention_summary,
    finish,
    finish_attention,
    finish_router,
    router_summary,
    summarize,
)

logger = logging.getLogger(__name__)

ALL_STATS = ("count", "mean", "std", "rms", "min", "max", "abs_max", "kurtosis", "zero_frac",
             "outlier_frac", "nonfinite", "quantiles")
TENSOR_KINDS = ("input", "output", "weight", "grad", "attention", "router")


@dataclass
class ProbeArgs:
    every: int = 0                  # probe every N steps (0: off, and no hooks at all)
    # fnmatch patterns over module names, e.g. "layers.*.attention.w?" or "*feed_forward*"
    modules: List[str] = field(default_factory=lambda: ["*"])
    tensors: List[str] = field(default_factory=lambda: list(TENSOR_KINDS))
    stats: List[str] = field(default_factory=lambda: list(ALL_STATS))
    quantiles: List[float] = field(default_factory=lambda: [0.001, 0.01, 0.5, 0.99, 0.999])
    attention_queries: int = 16     # queries per sequence for attention max logit / entropy
    # Alerts (logged with module and step, counted in metrics as probe_alerts, sent to wandb):
    alert_abs_max: float = 0.0      # an abs_max above this (0: off)
    alert_jump: float = 0.0         # a stat above alert_jump x its running median (0: off)
    alert_stats: List[str] = field(default_factory=lambda: ["abs_max", "rms"])
    alert_window: int = 20          # probe steps in the running median


def validate_args(args: ProbeArgs) -> None:
    if args.every < 0:
        raise ConfigError(f"probe.every={args.every} must be 0 (off) or a number of steps.")
    unknown = [k for k in args.tensors if k not in TENSOR_KINDS]
    if unknown:
        raise ConfigError(f"probe.tensors has unknown entries {unknown}: choose from "
                          f"{', '.join(TENSOR_KINDS)}.")
    unknown = [s for s in list(args.stats) + list(args.alert_stats)
               if s not in ALL_STATS and s not in ("max_logit", "entropy", "load_cv")]
    if unknown:
        raise ConfigError(f"probe.stats / probe.alert_stats have unknown entries {unknown}: "
                          f"choose from {', '.join(ALL_STATS)}.")
    if any(not 0 < q < 1 for q in args.quantiles):
        raise ConfigError(f"probe.quantiles={list(args.quantiles)} must lie strictly between 0 "
                          f"and 1, e.g. [0.01,0.5,0.99].")
    if args.attention_queries < 1:
        raise ConfigError(f"probe.attention_queries={args.attention_queries} must be at least 1.")
    if args.alert_abs_max < 0 or args.alert_jump < 0 or args.alert_window < 1:
        raise ConfigError("probe.alert_abs_max and probe.alert_jump must be >= 0 (0 is off) and "
                          "probe.alert_window >= 1.")


WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module")


def clean_name(name: str) -> str:
    """Without wrapper segments (checkpointing, compile), so every layout names it alike."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def _skip_call(module_inputs) -> bool:
    """Activation checkpointing's re-run during backward, and a pipeline's shape inference."""
    if torch._C._current_graph_task_id() != -1 or inferring_shapes():
        return True
    first = _first_tensor(module_inputs)
    return first is not None and first.device.type == "meta"


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return item
    return None


class Probe:
    def __init__(self, args: ProbeArgs, parts: List[nn.Module], env, dump_dir,
                 resumed_step: int = 0):
        self.args, self.parts, self.env = args, parts, env
        self.dir = Path(dump_dir) / "probe"
        self.path = self.dir / "probe.jsonl"
        self.handles = []
        self.seen = {}                     # id(tensor) -> (weakref, sums, maxes), one step
        self.acc: Dict[str, list] = {}     # key -> [sums, maxes, kind]
        self.history: Dict[str, deque] = defaultdict(lambda: deque(maxlen=args.alert_window))
        self.last_stats = {}
        self.warned_cp = False
        if env.is_main and args.every:
            self.dir.mkdir(parents=True, exist_ok=True)
            drop_rows_after(self.path, resumed_step)

    def active(self, step: int) -> bool:
        return bool(self.args.every) and step % self.args.every == 0

    def _selected(self, name: str) -> bool:
        return bool(name) and any(fnmatch.fnmatchcase(name, p) for p in self.args.modules)

    def _add(self, key: str, kind: str, sums: torch.Tensor, maxes: torch.Tensor) -> None:
        if key in self.acc:
            entry = self.acc[key]
            entry[0] += sums
            entry[1] = torch.maximum(entry[1], maxes)
        else:
            self.acc[key] = [sums, maxes, kind]

    def start(self) -> None:
        """Attach hooks for this step's forward passes (every micro-batch adds up)."""
        kinds = set(self.args.tensors)
        seen = set()  # a wrapper (activation checkpointing, compile) and its module share a name
        for part in self.parts:
            for raw_name, module in part.named_modules():
                name = clean_name(raw_name)
                if (isinstance(module, (nn.ModuleDict, nn.ModuleList)) or name in seen
                        or not self._selected(name)):
                    continue
                seen.add(name)
                if isinstance(module, CoreAttention):
                    if "attention" in kinds:
                        self.handles.append(module.register_forward_hook(self._attention_hook(name)))
                    continue
                if type(module).__name__ in ("AllGatherKVAttention", "RingAttention"):
                    if "attention" in kinds and not self.warned_cp and self.env.is_main:
                        logger.info("probe: attention max logit / entropy are not recorded under "
                                    "context parallelism (each rank sees part of the keys)")
                        self.warned_cp = True
                    continue
                if isinstance(module, Router):
                    if "router" in kinds:
                        self.handles.append(module.register_forward_hook(self._router_hook(name)))
                    continue
                if kinds & {"input", "output"}:
                    self.handles.append(module.register_forward_hook(self._activation_hook(name)))

    def _activation_hook(self, name):
        wanted = [kind for kind in ("input", "output") if kind in self.args.tensors]

        def hook(module, inputs, output):
            if _skip_call(inputs):
                return
            with torch.no_grad():
                for kind in wanted:
                    x = _first_tensor(inputs if kind == "input" else output)
                    if x is not None and x.is_floating_point():
                        self._add(f"{name}/{kind}", "act", *self._summarize_once(x))
        return hook

    def _summarize_once(self, x: torch.Tensor) -> tuple:
        """Once per tensor object: one module's output is often the next one's input."""
        cached = self.seen.get(id(x))
        if cached is not None and cached[0]() is x:
            return cached[1].clone(), cached[2].clone()
        sums, maxes = summarize(_local(x))
        self.seen[id(x)] = (weakref.ref(x), sums, maxes)
        return sums.clone(), maxes.clone()

    def _attention_hook(self, name):
        def hook(module, inputs, output):
            if _skip_call(inputs) or len(inputs) < 2:
                return
            mask = inputs[3] if len(inputs) > 3 else None
            with torch.no_grad():
                sums, maxes = attention_summary(_local(inputs[0]), _local(inputs[1]), mask,
                                                self.args.attention_queries, module.scale)
            self._add(f"{name}/attention", "attention", sums, maxes)
        return hook

    def _router_hook(self, name):
        def hook(module, inputs, output):
            if _skip_call(inputs):
                return
            with torch.no_grad():
                weights, experts, scores, logits = output
                sums, maxes = router_summary(_local(scores), _local(experts))
            self._add(f"{name}/router", "router", sums, maxes)
        return hook

    def stop(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.seen = {}

    def _record_params(self) -> None:
        """Weights and gradients (after backward, before the optimizer step)."""
        kinds = set(self.args.tensors) & {"weight", "grad"}
        if not kinds:
            return
        for part in self.parts:
            for raw_name, param in part.named_parameters():
                name = clean_name(raw_name)
                module_name, _, pname = name.rpartition(".")
                if not self._selected(module_name or name):
                    continue
                for kind in sorted(kinds):
                    tensor = param if kind == "weight" else param.grad
                    if tensor is None:
                        continue
                    key = f"{module_name}/{pname}" + (".grad" if kind == "grad" else "")
                    sums, maxes = self._param_summary(tensor.detach())
                    self.acc[key] = [sums, maxes, "param"]

    @staticmethod
    def _param_summary(tensor) -> tuple:
        """Full-tensor sums: the shards' sums added over the mesh dimensions it is sharded on."""
        if not isinstance(tensor, DTensor):
            return summarize(tensor)
        if any(isinstance(p, Partial) for p in tensor.placements):
            tensor = tensor.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                                     for p in tensor.placements])
        sums, maxes = summarize(tensor.to_local())
        mesh = tensor.device_mesh
        for dim, placement in enumerate(tensor.placements):
            # Anything but a copy is a piece: Shard, and FSDP x TP's _StridedShard (no Shard).
            if not isinstance(placement, Replicate) and mesh.size(dim) > 1:
                group = mesh.get_group(dim)
                dist.all_reduce(sums, group=group)
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        return sums, maxes

    def _reduce_activations(self, keys: List[str]) -> None:
        """Sum the activation/attention/router vectors over the ranks that hold distinct data."""
        env = self.env
        if env.world_size == 1 or not keys:
            return
        sums = torch.cat([self.acc[k][0] for k in keys])
        maxes = torch.cat([self.acc[k][1] for k in keys])
        sizes = [self.acc[k][0].numel() for k in keys]
        if env.size("tp") > 1:
            # Identical vectors on every tp rank = a replicated tensor: count it once.
            group = env.mesh["tp"].get_group()
            hi, lo = sums.clone(), sums.clone()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            replicated = torch.cat([torch.full((n,), bool(torch.equal(high, low)))
                                    for n, high, low in zip(sizes, hi.split(sizes),
                                                            lo.split(sizes))])
            summed = sums.clone()
            dist.all_reduce(summed, group=group)
            sums = torch.where(replicated.to(sums.device), sums, summed)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        if env.size("dp_cp") > 1:
            group = env.mesh["dp_cp"].get_group()
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        for key, s, m in zip(keys, sums.split(sizes), maxes.split([self.acc[k][1].numel()
                                                                  for k in keys])):
            self.acc[key][0], self.acc[key][1] = s, m

    def finish_step(self, step: int, wandb_run=None) -> int:
        """Reduce, write the line (rank 0), check alerts; returns the number of alerts."""
        self._record_params()
        act_keys = sorted(k for k, v in self.acc.items() if v[2] != "param")
        self._reduce_activations(act_keys)
        stats = {}
        wanted = set(self.args.stats)
        for key, (sums, maxes, kind) in self.acc.items():
            if kind == "attention":
                stats[key] = finish_attention(sums.cpu(), maxes.cpu())
            elif kind == "router":
                stats[key] = finish_router(sums.cpu(), maxes.cpu())
            else:
                stats[key] = finish(sums, maxes, wanted, self.args.quantiles)
        self.acc = {}
        if self.env.dims.pp > 1:  # each stage has its own layers: merge them on rank 0
            gathered = [None] * self.env.world_size if self.env.is_main else None
            dist.gather_object(stats, gathered, dst=0)
            if self.env.is_main:
                stats = {}
                for part in gathered:   # the first stage holding a key wins
                    stats.update({k: v for k, v in part.items() if k not in stats})
        alerts = self._alerts(step, stats) if self.env.is_main else []
        if self.env.is_main:
            line = {"step": step, "alerts": alerts, "stats": dict(sorted(stats.items()))}
            with open(self.path, "a") as f:
                f.write(json.dumps(line, allow_nan=True) + "\n")
        self.last_stats = stats
        if wandb_run is not None and self.env.is_main:
            wandb_run.log(self.wandb_summary(), step=step)
        return len(alerts)

    def _alerts(self, step: int, stats: dict) -> List[str]:
        a = self.args
        alerts = []
        for key, values in stats.items():
            for stat in a.alert_stats:
                value = values.get(stat)
                if value is None or not math.isfinite(value):
                    continue
                if a.alert_abs_max and stat == "abs_max" and value > a.alert_abs_max:
                    alerts.append(f"step {step}: {key} abs_max={value:.4g} above "
                                  f"probe.alert_abs_max={a.alert_abs_max:g}")
                history = self.history[f"{key}:{stat}"]
                if a.alert_jump and len(history) >= 3:
                    median = statistics.median(history)
                    if median > 0 and value > a.alert_jump * median:
                        alerts.append(f"step {step}: {key} {stat}={value:.4g} is "
                                      f"{value / median:.1f}x its running median {median:.4g}")
                history.append(value)
        for alert in alerts:
            logger.warning("probe alert: %s", alert)
        return alerts

    def wandb_summary(self) -> dict:
        """A few scalars per recorded tensor for wandb (the full table is in probe.jsonl)."""
        out = {}
        for key, values in self.last_stats.items():
            for stat in ("abs_max", "rms", "kurtosis", "max_logit", "entropy", "load_cv"):
                if stat in values and values[stat] is not None and math.isfinite(values[stat]):
                    out[f"probe/{key}/{stat}"] = values[stat]
        return out

    def log_plots(self, wandb_run) -> None:
        """At the end of a run: the probe's plots as wandb images (they also stay on disk)."""
        try:
            paths = plot(self.dir.parent)
        except Exception as err:  # a plotting problem must not fail a finished run
            logger.warning("probe: could not draw the plots for wandb: %s", err)
            return
        import wandb

        wandb_run.log({f"probe_plots/{p.stem}": wandb.Image(str(p)) for p in paths})


class ProbeHook(Hook):
    """probe.every and steps a hook asks for; records after backward (gradients before clipping)."""

    def __init__(self, args, spikes_on: bool):
        self.args, self.spikes_on = args.probe, spikes_on
        self.probe: Probe | None = None   # made at start when probe.every, else when asked
        self.alerts = 0        # since the last metrics row
        self.probing = False   # this step's forwards are hooked

    def start(self, view) -> None:
        dump_dir = Path(view.args.dump_dir)
        if not self.args.every and self.spikes_on and view.env.is_main:
            # A probe made at a spike missed dropping the lines of steps run again: drop them now.
            drop_rows_after(dump_dir / "probe" / "probe.jsonl", view.step)
        if self.args.every:
            self.probe = Probe(self.args, view.parts, view.env, dump_dir, view.step)

    def _made(self, view) -> Probe:
        if self.probe is None:
            self.probe = Probe(self.args, view.parts, view.env, Path(view.args.dump_dir),
                               view.step)
            if view.env.is_main:
                self.probe.dir.mkdir(parents=True, exist_ok=True)
        return self.probe

    def before_step(self, view, step: int) -> None:
        if view.probe_requested:
            self._made(view)
            if view.rerun is not None and view.env.is_main:
                drop_rows_after(self.probe.path, view.rerun)
        self.probing = view.probe_requested or (self.probe is not None
                                                and self.probe.active(step))
        if self.probing:
            self.probe.start()

    def after_backward(self, view, step: int) -> dict:
        if self.probing:  # weights and gradients as the optimizer will see them, before clipping
            self.probe.stop()
            self.alerts += self.probe.finish_step(step, view.wandb_run)
            self.probing = False
        return {}

    def metrics(self, view, row: dict) -> None:
        if self.probe is not None:
            row["probe_alerts"], self.alerts = self.alerts, 0

    def close(self, view) -> None:
        if self.probe is not None and view.env.is_main and view.wandb_run is not None:
            self.probe.log_plots(view.wandb_run)
