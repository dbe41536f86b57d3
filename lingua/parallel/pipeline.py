"""Pipeline parallelism: split a model into stages and run them with torch's pipelining schedules.
Parts keep the full model's parameter names, so checkpoints are layout-independent. Gradients
are the SUM over micro-batches (scale_grads=False): loss_fn already divides by the global count."""

import copy
import itertools
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lingua.errors import ConfigError
from lingua.model.layers import set_inferring_shapes

logger = logging.getLogger(__name__)

# torch's schedule name -> stages on rank r: one, looped (r + k*pp), or V (r and 2*pp-1-r).
SCHEDULE_STYLES = {"GPipe": "single", "1F1B": "single", "Interleaved1F1B": "loop",
                   "LoopedBFS": "loop", "InterleavedZeroBubble": "loop", "ZBVZeroBubble": "v",
                   "DualPipeV": "v"}


def _torch_schedules() -> dict:
    """The schedules of SCHEDULE_STYLES that this torch provides (older versions lack some)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    found = {}
    for name, style in SCHEDULE_STYLES.items():
        try:
            get_schedule_class(name)
        except ValueError:
            continue
        found[name] = style
    return found


def schedule_name(name: str) -> str:
    """The canonical spelling of a schedule name, or ConfigError listing the known ones."""
    known = _torch_schedules()
    for canonical in known:
        if canonical.lower() == name.lower():
            return canonical
    raise ConfigError(
        f"distributed.pp_schedule={name!r} is not a pipeline schedule this torch "
        f"({torch.__version__}) runs. Use one of {', '.join(known)}.")


def default_microbatches(pp: int, virtual: int) -> int:
    """distributed.pp_microbatches=0 means one micro-batch per stage (pp x virtual)."""
    return pp * virtual


def stage_layer_ids(n_layers: int, n_stages: int, pp_split: Sequence[int] = ()) -> list[list[int]]:
    """pp_split: the first layer of stages 1..n-1; empty: even, remainder to the first stages."""
    if n_stages < 1:
        raise ConfigError(f"The pipeline needs at least one stage, got {n_stages}.")
    if n_stages > n_layers:
        raise ConfigError(
            f"The pipeline has {n_stages} stages (distributed.pp x distributed.pp_virtual_stages) "
            f"but the model has only model.n_layers={n_layers} layers; every stage needs at least "
            f"one. Lower pp or pp_virtual_stages, or use a deeper model.")
    split = list(pp_split)
    if split and len(split) != n_stages - 1:
        raise ConfigError(
            f"distributed.pp_split={split} has {len(split)} entries but the pipeline has "
            f"{n_stages} stages, so it needs {n_stages - 1}: the first layer of each stage "
            f"after the first (e.g. {_even_split(n_layers, n_stages)}), or [] for an even split.")
    bounds = [0, *(split or _even_split(n_layers, n_stages)), n_layers]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ConfigError(
            f"distributed.pp_split={split} must be strictly increasing and within 1.."
            f"{n_layers - 1} (model.n_layers={n_layers}) so that every stage gets at least "
            f"one layer; e.g. {_even_split(n_layers, n_stages)}, or [] for an even split.")
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def _even_split(n_layers: int, n_stages: int) -> list[int]:
    per, extra = divmod(n_layers, n_stages)
    sizes = [per + (s < extra) for s in range(n_stages)]
    return [sum(sizes[:s]) for s in range(1, n_stages)]


def stage_ids_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """pp_rank's global stages as torch maps them: r, r+pp, ..., or r and 2pp-1-r (V schedules)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{pp - 1}")
    if _torch_schedules().get(schedule_name(schedule)) == "v":
        if virtual != 2:
            raise ConfigError(f"distributed.pp_schedule={schedule} holds exactly 2 stages per "
                              f"rank: set distributed.pp_virtual_stages=2 (got {virtual}).")
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [pp_rank + k * pp for k in range(virtual)]


def split_model(model: nn.Module, layer_ids: Sequence[int], is_first: bool,
                is_last: bool) -> nn.Module:
    """A copy of `model` keeping one stage's modules, under the full model's parameter names."""
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    if tied and not (is_first and is_last):
        raise _tied_refusal("pipeline parallelism")
    missing = [i for i in layer_ids if str(i) not in model.layers]
    if missing:
        raise ValueError(f"layers {missing} are not in the model (it has {list(model.layers)})")
    part = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    first_only = getattr(model, "first_stage_modules", ("tok_embeddings",))
    last_only = getattr(model, "last_stage_modules", ("norm", "output"))
    for name in (() if is_first else first_only) + (() if is_last else last_only):
        setattr(part, name, None)
    return part


def _tied_refusal(what: str) -> ConfigError:
    return ConfigError(
        f"model.tie_embeddings=true with {what}: the output projection reuses the embedding "
        "matrix, which lives on the first stage, while the output is computed on the last. Set "
        "model.tie_embeddings=false or distributed.pp=1.")


def validate_pp(n_layers: int, pp: int, virtual: int, schedule: str, n_microbatches: int,
                batch_size: int, tie_embeddings: bool, pp_split: Sequence[int] = ()) -> None:
    """Every pipeline-parallel check that needs no process group."""
    name = schedule_name(schedule)
    if pp < 1 or virtual < 1:
        raise ConfigError(f"distributed.pp={pp} and distributed.pp_virtual_stages={virtual} "
                          "must be at least 1.")
    if pp == 1:
        if virtual != 1:
            raise ConfigError(f"distributed.pp_virtual_stages={virtual} needs pipeline "
                              "parallelism: set distributed.pp > 1 or pp_virtual_stages=1.")
        return
    styles = _torch_schedules()
    style = styles[name]
    if style == "single" and virtual != 1:
        multi = ", ".join(n for n, s in styles.items() if s != "single")
        raise ConfigError(
            f"distributed.pp_schedule={name} runs one stage per rank but "
            f"distributed.pp_virtual_stages={virtual}. Set pp_virtual_stages=1, or use a "
            f"multi-stage schedule ({multi}).")
    if style == "v" and virtual != 2:
        raise ConfigError(
            f"distributed.pp_schedule={name} places exactly 2 stages on each rank (a V shape) but "
            f"distributed.pp_virtual_stages={virtual}. Set pp_virtual_stages=2.")
    if tie_embeddings:
        raise _tied_refusal(f"distributed.pp={pp}")
    n_stages = pp * virtual
    stage_layer_ids(n_layers, n_stages, pp_split)  # more stages than layers, bad split
    if n_microbatches < 0:
        raise ConfigError(f"distributed.pp_microbatches={n_microbatches} must be >= 0 "
                          "(0 = one per stage).")
    n_mb = n_microbatches or default_microbatches(pp, virtual)
    if batch_size % n_mb:
        given = "" if n_microbatches else f" (0: one per stage, pp x pp_virtual_stages = {n_mb})"
        raise ConfigError(
            f"data.batch_size={batch_size} sequences per rank cannot be split into "
            f"distributed.pp_microbatches={n_microbatches}{given} equal micro-batches. Pick a "
            f"batch_size that is a multiple of {n_mb}, or a pp_microbatches dividing {batch_size}.")
    _check_microbatch_count(name, pp, n_stages, n_mb)


def _check_microbatch_count(name: str, pp: int, n_stages: int, n_mb: int) -> None:
    """The micro-batch counts torch's schedule constructors accept (torch 2.13 source)."""
    if name in ("1F1B", "DualPipeV") and n_mb < n_stages:
        raise ConfigError(
            f"distributed.pp_schedule={name} needs at least as many micro-batches as pipeline "
            f"stages ({n_stages}) but distributed.pp_microbatches={n_mb}. Raise pp_microbatches "
            f"to {n_stages} or more (and data.batch_size to a multiple of it).")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        # torch runs the micro-batches in max(1, n_mb // pp) rounds, which must divide n_mb.
        rounds = max(1, n_mb // pp)
        if n_mb % rounds:
            raise ConfigError(
                f"distributed.pp_schedule={name} with distributed.pp={pp} runs micro-batches in "
                f"rounds: pp_microbatches={n_mb} gives max(1, {n_mb} // {pp}) = {rounds} rounds, "
                f"which do not divide {n_mb}. Use a multiple of pp (e.g. {rounds * pp} or "
                f"{(rounds + 1) * pp}) or fewer micro-batches than pp.")


class _StageOutputsByKeyword(nn.Module):
    """torch passes a stage's outputs to the next stage as positional inputs; a part returning
    (hidden states, extras...) names the extras in `stage_outputs` and takes them by keyword."""

    def __init__(self, part: nn.Module, names: tuple):
        super().__init__()
        self.part, self.names = part, tuple(names)

    def forward(self, h, *extras, **kwargs):
        return self.part(h, **dict(zip(self.names, extras)), **kwargs)


class Pipeline:
    """One training step (forward + backward of every micro-batch) or an evaluation pass."""

    def __init__(self, schedule, stages: list, n_microbatches: int, loss_fn, stage_to_rank: dict,
                 group):
        self.schedule, self.loss_fn, self.stages = schedule, loss_fn, stages
        self.n_microbatches, self.stage_to_rank, self.group = n_microbatches, stage_to_rank, group
        self.n_stages = len(stage_to_rank)
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.device = stages[0].device
        # torch's first step infers shapes with an extra forward (and in 2.13 a loss_fn call from
        # _prepare_backward_infra) on garbage: both marked inferring_shapes(), by caller not count.
        self.steps_run = 0
        self._preparing_backward = False
        for stage in stages:
            if stage.is_last and hasattr(stage, "_prepare_backward_infra"):
                stage._prepare_backward_infra = self._marking_loss_calls(
                    stage._prepare_backward_infra)

    def _marking_loss_calls(self, prepare):
        def prepare_backward(*args, **kwargs):
            self._preparing_backward = True
            try:
                return prepare(*args, **kwargs)
            finally:
                self._preparing_backward = False
        return prepare_backward

    def loss_fn_for_torch(self, output, target, **kwargs):
        """The loss_fn build_schedule gives torch's schedule: ours, marked while inferring."""
        set_inferring_shapes(self._preparing_backward)
        try:
            return self.loss_fn(output, target, **kwargs)
        finally:
            set_inferring_shapes(False)

    def _mark_first_forwards(self) -> None:
        """Mark each local stage's first forward (torch's shape inference) inferring_shapes()."""
        for stage in self.stages:
            handles, submod = [], stage.submod

            def begin(module, args, kwargs):
                set_inferring_shapes(True)

            def end(module, args, kwargs, output, handles=handles):
                set_inferring_shapes(False)
                for handle in handles:
                    handle.remove()

            handles.append(submod.register_forward_pre_hook(begin, with_kwargs=True))
            handles.append(submod.register_forward_hook(end, with_kwargs=True, always_call=True))

    def _check_batch(self, tokens):
        if tokens.shape[0] % self.n_microbatches:
            raise ConfigError(f"a batch of {tokens.shape[0]} sequences cannot be split into "
                              f"{self.n_microbatches} equal pipeline micro-batches.")

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None,
             model_kwargs: dict | None = None) -> torch.Tensor | None:
        """Forward and backward; the detached sum of loss_fn on the last stage, else None."""
        self._check_batch(tokens)
        # doc_ids and model_kwargs ([b, ...]) go to every stage. Contiguous: tokens are a [:, :-1]
        # view, and torch 2.11's stages compare input strides with the ones they inferred.
        args = (tokens.to(self.device).contiguous(),) if self.has_first else ()
        kwargs = {"doc_ids": doc_ids.to(self.device).contiguous()} if doc_ids is not None else {}
        kwargs.update({k: v.to(self.device).contiguous() for k, v in (model_kwargs or {}).items()})
        target = labels.to(self.device) if self.has_last else None
        losses: list = []
        if self.steps_run == 0:
            self._mark_first_forwards()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        self.steps_run += 1
        if not self.has_last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, labels: torch.Tensor,
                  doc_ids: torch.Tensor | None = None, loss_fn=None) -> torch.Tensor | None:
        """Forward only: the sum of loss_fn on the last stage, else None. Blocking send/recv in
        stage order, not torch's `schedule.eval()`, which fails on V schedules in torch 2.13."""
        self._check_batch(tokens)
        loss_fn = loss_fn or self.loss_fn
        modules = {stage.stage_index: stage.submod for stage in self.stages}
        n = self.n_microbatches
        token_mbs = tokens.to(self.device).chunk(n)
        label_mbs = labels.to(self.device).chunk(n)
        doc_mbs = doc_ids.to(self.device).chunk(n) if doc_ids is not None else [None] * n
        total = torch.zeros((), device=self.device)
        for mb in range(n):
            kwargs = {"doc_ids": doc_mbs[mb]} if doc_mbs[mb] is not None else {}
            h = token_mbs[mb]
            for s in sorted(modules):   # the input: the tokens, or the previous stage's output
                if s > 0 and not self._local(s - 1):
                    h = _recv_tensor(self.group, self.stage_to_rank[s - 1], self.device)
                h = modules[s](h, **kwargs)
                if s < self.n_stages - 1 and not self._local(s + 1):
                    _send_tensor(h, self.group, self.stage_to_rank[s + 1])
            if self.n_stages - 1 in modules:
                total += loss_fn(h, label_mbs[mb]).float()
        return total if self.has_last else None

    def _local(self, stage: int) -> bool:
        return self.stage_to_rank[stage] == self.group.rank()


# Hidden states cross ranks with a header (dtype, ndim, shape): SP and CP change the length.
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _send_tensor(t: torch.Tensor, group, group_dst: int) -> None:
    meta = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    header = torch.tensor(meta + [0] * (8 - len(meta)), dtype=torch.int64, device=t.device)
    torch.distributed.send(header, group=group, group_dst=group_dst)
    torch.distributed.send(t.contiguous(), group=group, group_dst=group_dst)


def _recv_tensor(group, group_src: int, device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    torch.distributed.recv(header, group=group, group_src=group_src)
    dtype, ndim, *shape = header.tolist()
    out = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    torch.distributed.recv(out, group=group, group_src=group_src)
    return out


def build_schedule(stage_modules: Sequence[nn.Module], stage_ids: Sequence[int], n_stages: int,
                   pp_group, device, schedule: str, n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Pipeline:
    """pp_group: a ProcessGroup or a 1-D DeviceMesh. loss_fn is summed, never averaged."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    name = schedule_name(schedule)
    if len(stage_modules) != len(stage_ids):
        raise ValueError(f"{len(stage_modules)} stage modules for stage ids {list(stage_ids)}")
    group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
    pp = group.size()
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages do not spread evenly over {pp} pipeline ranks")
    virtual = n_stages // pp
    stage_to_rank = {s: r for r in range(pp) for s in stage_ids_of_rank(r, pp, virtual, name)}
    expected = stage_ids_of_rank(group.rank(), pp, virtual, name)
    if sorted(stage_ids) != expected:
        # torch sends activations by its own stage-to-rank mapping: any other layout hangs.
        raise ValueError(f"pp rank {group.rank()} holds stages {list(stage_ids)} but schedule "
                         f"{name} expects {expected} (use stage_ids_of_rank)")
    n_mb = n_microbatches or default_microbatches(pp, virtual)

    def stage_module(part):
        names = getattr(part, "stage_outputs", ())
        return _StageOutputsByKeyword(part, names) if names else part

    device = torch.device(device)
    stages = [PipelineStage(stage_module(module), stage_id, n_stages, device, group=group)
              for module, stage_id in zip(stage_modules, stage_ids)]
    pipe = Pipeline(None, stages, n_mb, loss_fn, stage_to_rank, group)
    cls = get_schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    if single and len(stages) != 1:
        raise ConfigError(f"distributed.pp_schedule={name} runs one stage per rank; this rank "
                          f"holds {len(stages)} ({list(stage_ids)}).")
    pipe.schedule = cls(stages[0] if single else stages, n_microbatches=n_mb,
                        loss_fn=pipe.loss_fn_for_torch, scale_grads=False)
    logger.info("pipeline: schedule %s, stages %s of %d on pp rank %d, %d micro-batches",
                name, list(stage_ids), n_stages, group.rank(), n_mb)
    return pipe
