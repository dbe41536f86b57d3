"""Mixture-of-experts layer: router, grouped experts, load-balancing losses. No distributed code.

`MoE.forward` (x flattened to T tokens): router -> top-k experts per token -> stable sort of the
T*k assignments by expert -> optional capacity drop -> `experts(x_sorted, counts)` -> unsort ->
weighted sum over the k slots -> plus shared experts. `experts` is expert parallelism's swap
point: any module with `forward(x_sorted [n, dim] in expert order, counts [n_experts]) -> [n, dim]`.

Load balancing over the GLOBAL batch: `moe.count_reducer(t)` sums `t` (maybe in place) over the
ranks holding distinct tokens of the micro-batch (identity unless lingua.parallel.expert_parallel
sets it); called per layer per training forward when aux_loss_coef or z_loss_coef > 0 (recomputes
included), once per step by update_expert_bias, never in eval mode. The balancing losses are SUMS
over this rank's tokens, like the cross-entropy; with f_e = reduced_count_e / sum(reduced_counts):
  aux_sum = aux_loss_coef * n_experts * sum_e f_e * (sum over tokens of normalised scores_e)
  z_sum   = z_loss_coef * (sum over tokens of logsumexp(logits)^2)
A training forward leaves `moe.balance_loss` = aux_sum + z_sum (None when both coefficients are 0)
for apps/moe to add."""

import math
from typing import Callable, Dict, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lingua.errors import ConfigError
from lingua.model.layers import FeedForward, inferring_shapes

SCORE_FUNCS = ("softmax", "sigmoid")
EXPERT_IMPLS = ("grouped", "loop")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's backward
    rejects stride-0 gradients (e.g. from `y.sum().backward()`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))


# torch.compile's shape rule for _grouped_mm takes bf16 only, while the eager kernel also runs
# fp32: compiled fp32 runs call it through this opaque op, which keeps the MoE block one graph.
@torch.library.custom_op("lingua::grouped_mm_fp32", mutates_args=())
def _grouped_mm_opaque(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offs)


@_grouped_mm_opaque.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("lingua::grouped_mm_fp32_weight_grad", mutates_args=())
def _grouped_weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x.t(), grad, offs=offs)   # per group: x_g^T @ grad_g


@_grouped_weight_grad.register_fake
def _(x, grad, offs):
    return x.new_empty(offs.shape[0], x.shape[1], grad.shape[1])


def _grouped_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    return (_grouped_mm_opaque(grad, w.transpose(-2, -1).contiguous(), offs),
            _grouped_weight_grad(x, grad, offs), None)


_grouped_mm_opaque.register_autograd(
    _grouped_mm_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class _GatherRows(torch.autograd.Function):
    """rows[i] = src[index[i]] for a permutation `index`; backward gathers through the inverse
    (index_select's backward would zero-fill and scatter-add: more passes, atomics on GPU)."""

    @staticmethod
    def forward(ctx, src, index, inverse):
        ctx.save_for_backward(inverse)
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _Dispatch(torch.autograd.Function):
    """x [T, dim] -> x[slot // top_k for slot in order]: each token's row once per expert it is
    routed to. Backward gathers the gradients into slot order (`inverse`: slot -> row, n_rows
    for a dropped slot) and sums each token's top_k slots: no scatter, deterministic on GPU."""

    @staticmethod
    def forward(ctx, x, order, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        if inverse.numel() > grad.shape[0]:  # dropped slots read an appended zero row
            grad = torch.cat([grad, grad.new_zeros(1, grad.shape[1])])
        slots = grad.index_select(0, inverse)
        return slots.view(-1, ctx.top_k, grad.shape[1]).sum(1), None, None, None


# CPU oneDNN caches a bf16/fp16 kernel per matmul shape and expert row counts change every step:
# pad each expert's rows to a multiple of CPU_GROUP_ROWS unless that adds over 10% rows.
CPU_GROUP_ROWS = 16


def _cpu_group_rows(x: torch.Tensor, n_experts: int) -> int:
    """The multiple to pad each expert's rows to (0: none): CPU bf16/fp16 only, see above."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return 0
    if n_experts * (CPU_GROUP_ROWS - 1) > 0.1 * x.shape[0]:
        return 0
    return CPU_GROUP_ROWS


class _ScatterRows(torch.autograd.Function):
    """out = zeros(n_out, dim) with out[rows[i]] = x[i]; backward gathers the rows back. Saves
    only `rows` (torch's index_copy would keep its whole source until backward)."""

    @staticmethod
    def forward(ctx, x, rows, n_out):
        ctx.save_for_backward(rows)
        return x.new_zeros(n_out, x.shape[1]).index_copy_(0, rows, x)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None


def _pad_groups(x: torch.Tensor, counts: torch.Tensor, multiple: int):
    """Expert-sorted x [n, dim] -> (padded_x, rows, offs): each group starts at a multiple of
    `multiple`, x[i] is padded_x[rows[i]], offs are _grouped_mm's int32 group ends. The size does
    not depend on the routing (torch.compile); the last group runs to the end (else unwritten)."""
    n, n_experts = x.shape[0], counts.numel()
    n_out = -(-(n + n_experts * (multiple - 1)) // multiple) * multiple
    padded = (counts + multiple - 1) // multiple * multiple
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)   # padded start - packed start
    expert = torch.repeat_interleave(torch.arange(n_experts, device=x.device), counts,
                                     output_size=n)
    rows = torch.arange(n, device=x.device) + shift[expert]
    ends[-1] = n_out
    return _ScatterRows.apply(x, rows, n_out), rows, ends.to(torch.int32)


def check_grouped_alignment(dim: int, hidden: int) -> None:
    """torch._grouped_mm needs every row stride to be a multiple of 16 bytes (8 bf16 values)."""
    if dim % 8 or hidden % 8:
        raise ConfigError(
            f"model.expert_impl=grouped needs dim={dim} and the expert hidden size={hidden} to be "
            "multiples of 8: torch._grouped_mm requires 16-byte aligned rows. Pick multiples of 8 "
            "(model.expert_hidden_dim) or use model.expert_impl=loop."
        )


class GroupedExperts(nn.Module):
    """n_experts SwiGLU FFNs with stacked weights. impl "grouped": one torch._grouped_mm per
    weight; "loop": one matmul per expert (the reference). _grouped_mm needs int32 offsets, one
    dtype for both operands (cast here: autocast does not cover it), 16-byte aligned rows, no
    stride-0 gradient and a non-empty input (the loop takes that)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, impl: str = "grouped"):
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ConfigError(f"model.expert_impl={impl!r} is not one of "
                              f"{', '.join(EXPERT_IMPLS)}.")
        if impl == "grouped":
            check_grouped_alignment(dim, hidden)
        self.impl = impl
        # float8.moe's swap points: grouped matmul (x, w, offs), group row multiple (0: none).
        self.grouped_mm: Optional[Callable] = None
        self.group_multiple = 0
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # The autocast dtype when on, else the weights' (bf16 under FSDP mixed precision).
        dtype = self.w1.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        x, w1, w3, w2 = (t.to(dtype) for t in (x, self.w1, self.w3, self.w2))
        if self.impl == "loop" or x.shape[0] == 0:
            # No rows (e.g. an expert-parallel rank that received none): grouped_mm's backward
            # rejects the [0, n] gradient, so the loop yields the (zero) gradients instead.
            return self._loop(x, counts, w1, w3, w2)
        # Padded groups: float8's aligned ones, or CPU bf16/fp16's few shapes (CPU_GROUP_ROWS).
        group_rows = self.group_multiple or _cpu_group_rows(x, counts.numel())
        if group_rows:
            x, rows, offs = _pad_groups(x, counts, group_rows)
        else:
            offs = counts.cumsum(0).to(torch.int32)
        if self.grouped_mm is not None:
            mm = self.grouped_mm
        else:
            opaque = torch.compiler.is_compiling() and x.dtype != torch.bfloat16
            mm = _grouped_mm_opaque if opaque else _grouped_mm
        h = F.silu(mm(x, w1, offs)) * mm(x, w3, offs)
        y = mm(h, w2, offs)
        return y.index_select(0, rows) if group_rows else y

    @staticmethod
    def _loop(x, counts, w1, w3, w2) -> torch.Tensor:
        # Reads the counts on the host (a sync), except with no rows, where they are all zero.
        sizes = counts.tolist() if x.shape[0] else [0] * counts.numel()
        return torch.cat([(F.silu(rows @ w1[e]) * (rows @ w3[e])) @ w2[e]
                          for e, rows in enumerate(torch.split(x, sizes))])


class Router(nn.Module):
    """Scores every expert, picks top_k per token. The gate runs in fp32 even under autocast:
    routing flips on small logit differences. `expert_bias` (DeepSeek-V3) only changes which
    experts are chosen; the combine weights are their unbiased scores. n_groups > 1 (DeepSeek-V3's
    group-limited routing): n_groups equal groups, each scored by its two best biased scores; a
    token picks its top_k in the topk_groups best groups."""

    def __init__(self, dim: int, n_experts: int, top_k: int, score_func: str = "softmax",
                 norm_topk: bool = False, route_scale: float = 1.0, n_groups: int = 1,
                 topk_groups: int = 1):
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ConfigError(f"model.score_func={score_func!r} is not one of "
                              f"{', '.join(SCORE_FUNCS)}.")
        check_groups(n_experts, top_k, n_groups, topk_groups)
        self.top_k, self.score_func = top_k, score_func
        self.norm_topk, self.route_scale = norm_topk, route_scale
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=True)

    def forward(self, x: torch.Tensor):
        """x [T, dim] -> (weights [T, k], experts [T, k] long, scores, logits [T, E]); fp32."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias.float()
        if self.topk_groups < self.n_groups:
            groups = choice.view(-1, self.n_groups, choice.shape[-1] // self.n_groups)
            group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
            kept = group_scores.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        _, experts = torch.topk(choice, self.top_k, dim=-1)
        weights = scores.gather(-1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, experts, scores, logits


def check_groups(n_experts: int, top_k: int, n_groups: int, topk_groups: int) -> None:
    """Group-limited routing's shape: equal groups, and enough experts in the kept ones."""
    if n_groups < 1 or n_experts % n_groups or not 1 <= topk_groups <= n_groups:
        raise ConfigError(f"model.n_groups={n_groups}, model.topk_groups={topk_groups} with "
                          f"model.n_experts={n_experts}: the experts form n_groups equal groups "
                          "(n_groups divides n_experts) and a token keeps 1 <= topk_groups <= "
                          "n_groups of them. Use n_groups=1, topk_groups=1 for plain top-k.")
    if top_k > topk_groups * (n_experts // n_groups):
        raise ConfigError(f"model.top_k={top_k} is more than the {topk_groups} kept groups hold "
                          f"({topk_groups} x {n_experts // n_groups} experts). Raise "
                          "model.topk_groups or lower model.top_k.")


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, n_shared_experts: int = 0,
                 score_func: str = "softmax", norm_topk: bool = False, route_scale: float = 1.0,
                 capacity_factor: float = 0.0, expert_impl: str = "grouped",
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, n_groups: int = 1,
                 topk_groups: int = 1):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ConfigError(f"model.top_k={top_k} must be between 1 and "
                              f"model.n_experts={n_experts}.")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = Router(dim, n_experts, top_k, score_func, norm_topk, route_scale,
                             n_groups, topk_groups)
        self.experts = GroupedExperts(n_experts, dim, hidden, expert_impl)
        self.shared_experts = (FeedForward(dim, hidden * n_shared_experts)
                               if n_shared_experts > 0 else None)
        self.count_reducer: Callable[[torch.Tensor], torch.Tensor] = _identity  # module docstring
        # The last training forward's balancing losses, summed over its tokens (with their graph).
        self.balance_loss: Optional[torch.Tensor] = None
        # Local counts over one optimizer step's training forwards, for update_expert_bias.
        self.step_counts: Optional[torch.Tensor] = None
        # This forward's local statistics (tests read them); the sums since reset_routing().
        self.stats: Dict[str, torch.Tensor] = {}
        self.routing: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, scores, logits = self.router(x)
        n_assign = experts.numel()
        flat = experts.reshape(-1)
        # Token-major within an expert: earlier tokens first.
        order = torch.argsort(flat, stable=True)
        sorted_experts = flat[order]
        # Each expert's first sorted row, and its count: no host sync (bincount would need one).
        bounds = torch.arange(self.n_experts + 1, device=x.device)
        start = torch.searchsorted(sorted_experts, bounds)
        counts = start.diff()
        kept = counts
        if self.capacity_factor > 0:
            cap = math.ceil(self.capacity_factor * x.shape[0] * self.top_k / self.n_experts)
            rank_in_expert = torch.arange(n_assign, device=x.device) - start[sorted_experts]
            # A host sync, the only one here: how many rows are kept depends on the routing.
            order = order[rank_in_expert < cap]
            kept = counts.clamp(max=cap)
        # slot -> row of the expert-sorted rows (n_kept for a dropped slot)
        inverse = torch.full((n_assign,), order.numel(), dtype=order.dtype, device=x.device)
        inverse.index_copy_(0, order, torch.arange(order.numel(), device=x.device))
        # Under autocast, cast the T rows once, not the T*k gathered ones.
        device_type = x.device.type
        xe = (x.to(torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type)
              else x)
        y = self.experts(_Dispatch.apply(xe, order, inverse, self.top_k), kept)
        out = self._combine(y, order, inverse, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        self._balance(counts, scores, logits, n_assign - order.numel())
        return out.reshape(*shape[:-1], out.shape[-1])

    def _combine(self, y, order, inverse, weights) -> torch.Tensor:
        """y [n, dim] (row i is slot order[i] = t * top_k + j) -> sum_j weights[t, j] * y's slot
        (t, j) row, [T, dim]; dropped slots count as zero. A gather then a batched [1, k] x [k, dim]
        product per token: deterministic on GPU (no index_add)."""
        n_slots, dim = weights.numel(), y.shape[-1]
        if order.numel() == n_slots:
            slots = _GatherRows.apply(y, inverse, order)
        else:
            slots = y.new_zeros(n_slots, dim).index_copy(0, order, y)
        slots = slots.view(-1, self.top_k, dim)
        # In y's dtype: an fp32 copy of the [T*k, dim] rows costs more than small experts' GEMMs.
        # bmm accumulates in fp32; the weights are rounded like any autocast matmul's operands.
        return torch.bmm(weights.unsqueeze(1).to(y.dtype), slots).squeeze(1)

    def _probs(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-token distributions over experts: sigmoid scores are normalised to sum to 1."""
        if self.router.score_func == "softmax":
            return scores
        return scores / scores.sum(-1, keepdim=True)

    def _balance(self, counts, scores, logits, n_dropped: int) -> None:
        counts_f = counts.float()
        # Not counted: recomputes in backward (compiled ones too) and pipeline shape inference.
        in_backward = (not torch.compiler.is_compiling()
                       and torch._C._current_graph_task_id() != -1)
        counted = self.training and not in_backward and not inferring_shapes()
        if counted:
            self.step_counts = (counts_f.detach() if self.step_counts is None
                                else self.step_counts + counts_f.detach())
        aux = z = torch.zeros((), device=counts.device)
        self.balance_loss = None
        # Training only: evaluation and generation must not call the trainer's collectives.
        if self.training and (self.aux_loss_coef > 0 or self.z_loss_coef > 0):
            global_counts = self.count_reducer(counts_f.detach().clone())
            f = global_counts / global_counts.sum()
            aux = self.aux_loss_coef * self.n_experts * (f * self._probs(scores).sum(0)).sum()
            z = self.z_loss_coef * torch.logsumexp(logits, -1).pow(2).sum()
            self.balance_loss = aux + z
        with torch.no_grad():
            p = self._probs(scores)
            entropy = -(p * p.clamp_min(1e-20).log()).sum(-1)
            n_slots = scores.shape[0] * self.top_k
            self.stats = {
                "tokens_per_expert": counts_f.detach(),
                "dropped_fraction": counts_f.new_full((), n_dropped / max(n_slots, 1)),
                "router_entropy": entropy.mean(),
                "aux_loss": aux.detach(),  # summed over this rank's tokens
                "z_loss": z.detach(),
            }
            if counted:
                # new_full fills on the device (new_tensor would copy from the host and wait).
                sums = torch.stack([counts_f.new_full((), n_dropped),
                                    counts_f.new_full((), n_slots), entropy.sum().float(),
                                    counts_f.new_full((), scores.shape[0]),
                                    aux.detach().float(), z.detach().float()])
                row = torch.cat([counts_f.detach(), sums])
                self.routing = row if self.routing is None else self.routing + row


@torch.no_grad()
def update_expert_bias(moe_layers: Iterable[MoE], rate: float) -> None:
    """DeepSeek-V3 aux-loss-free balancing, after each optimizer step: per layer,
    bias_e += rate * sign(mean_e(count) - count_e) on the step's globally reduced counts, then
    the counts restart. All layers' counts go through one (the first layer's) `count_reducer`."""
    layers = [m for m in moe_layers if m.step_counts is not None]
    if not layers:
        return
    counts = layers[0].count_reducer(torch.stack([m.step_counts for m in layers]))
    for m, c in zip(layers, counts):
        m.router.expert_bias.add_(rate * torch.sign(c.mean() - c).to(m.router.expert_bias.dtype))
        m.step_counts = None


def moe_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, MoE)]


def balance_loss_sum(layers: Iterable[MoE], device) -> torch.Tensor:
    """The last forward's balancing losses summed ([1]), then dropped (a graph blocks deepcopy)."""
    total = torch.zeros(1, device=device)
    for m in layers:
        if m.balance_loss is not None:
            total = total + m.balance_loss
            m.balance_loss = None
    return total


# A layer's routing sums (MoE.routing) after its n_experts token counts, in this order.
ROUTING_SUMS = ("dropped", "slots", "entropy", "tokens", "aux_loss", "z_loss")


def reset_routing(layers: Iterable[MoE]) -> None:
    """Start new routing sums (before each step's forward passes)."""
    for m in layers:
        m.routing = None


@torch.no_grad()
def routing_metrics(layers: Dict[int, MoE], n_layers: int, n_experts: int,
                    reduce: Callable[[torch.Tensor], torch.Tensor],
                    device: torch.device) -> Dict[str, float]:
    """Routing health per MoE layer since reset_routing, as "<layer>/<name>". Collective: every
    rank builds the same table and `reduce` sums it over ranks and pipeline stages.
      imbalance         max / mean of the tokens routed to each expert (1 = perfectly balanced)
      dropped_fraction  routed slots dropped by capacity / all routed slots
      router_entropy    mean over tokens of the entropy of the router's distribution (nats)
      aux_loss, z_loss  the balancing losses added to the step's loss, per token"""
    table = torch.zeros(n_layers, n_experts + len(ROUTING_SUMS), device=device)
    for index, layer in layers.items():
        if layer.routing is not None:
            table[index] = layer.routing.to(device)
    table = reduce(table).cpu()
    out = {}
    for index in range(n_layers):
        counts = table[index, :n_experts]
        sums = dict(zip(ROUTING_SUMS, table[index, n_experts:].tolist()))
        if sums["tokens"] == 0:  # a dense layer, or no training forward since the reset
            continue
        out[f"{index}/imbalance"] = (counts.max() / counts.mean().clamp_min(1e-9)).item()
        out[f"{index}/dropped_fraction"] = sums["dropped"] / max(sums["slots"], 1.0)
        out[f"{index}/router_entropy"] = sums["entropy"] / sums["tokens"]
        out[f"{index}/aux_loss"] = sums["aux_loss"] / sums["tokens"]   # per token, as the loss
        out[f"{index}/z_loss"] = sums["z_loss"] / sums["tokens"]
    return out


def active_params_per_token(model: nn.Module) -> float:
    """Matmul parameters per token (FLOPs/MFU): every nn.Linear plus top_k / n_experts of routed
    experts; not the embedding lookup nor a tied output (no nn.Linear: callers add it)."""
    total = float(sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)))
    return total + sum(routed_params_per_token(m) for m in moe_layers(model))


def routed_params_per_token(m: MoE) -> float:
    """The routed experts' parameters one token goes through: top_k of n_experts."""
    return sum(p.numel() for p in m.experts.parameters()) * m.top_k / m.n_experts
