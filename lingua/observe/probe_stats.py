"""The probe's math: tensors, sampled attention logits or router choices reduced to fixed-size
sum/max vectors that add up over ranks, and the statistics read back from the reduced vectors."""

import math
from typing import Optional

import torch

BINS_PER_DECADE = 64
LOG10_LO, LOG10_HI = -8, 8
N_MAG = BINS_PER_DECADE * (LOG10_HI - LOG10_LO)          # bins per sign
N_HIST = 2 * N_MAG + 1                                    # negatives, zero, positives
N_SUM = 7 + N_HIST   # count, sum, sumsq, sum3, sum4, zeros, nonfinite, histogram
N_MAX = 2            # max, -min


def summarize(x: torch.Tensor) -> tuple:
    """(sums [N_SUM], maxes [N_MAX]) of a local tensor, float64, on its device. Elementwise work
    is float32 with float64 sums (cheap), float64 above 1e8 where float32 powers would overflow."""
    x = x.detach().reshape(-1)
    x = x.float() if x.dtype != torch.float64 else x
    finite = torch.isfinite(x)
    nonfinite = x.numel() - int(finite.sum()) if x.numel() else 0
    if nonfinite:
        x = x[finite]
    sums = torch.zeros(N_SUM, dtype=torch.float64, device=x.device)
    maxes = torch.full((N_MAX,), -math.inf, dtype=torch.float64, device=x.device)
    if x.numel():
        maxes[0] = x.max()
        maxes[1] = -x.min()
        if float(maxes.max()) > 1e8:
            x = x.double()
        x2 = x * x
        sums[0] = x.numel()
        sums[1] = x.sum(dtype=torch.float64)
        sums[2] = x2.sum(dtype=torch.float64)
        sums[3] = (x2 * x).sum(dtype=torch.float64)
        sums[4] = (x2 * x2).sum(dtype=torch.float64)
        sums[5] = (x == 0).sum()
        sums[7:] = torch.bincount(histogram_bins(x), minlength=N_HIST).double()
    sums[6] = nonfinite
    return sums, maxes


def histogram_bins(x: torch.Tensor) -> torch.Tensor:
    """Bin index of each (finite) value: N_MAG + 1 + k for positives, N_MAG - 1 - k for
    negatives, N_MAG for zero, with k the log-magnitude bin (clamped to the grid)."""
    mag = torch.log10(x.abs()).sub_(LOG10_LO).mul_(BINS_PER_DECADE).floor_()
    mag = mag.clamp_(0, N_MAG - 1).to(torch.int32)
    index = torch.where(x >= 0, mag + (N_MAG + 1), (N_MAG - 1) - mag)
    index[x == 0] = N_MAG
    return index


def _bin_edges() -> torch.Tensor:
    """Lower edge (in value) of each of the N_HIST bins, and upper edges, ascending in value."""
    k = torch.arange(N_MAG, dtype=torch.float64)
    lo_mag = 10 ** (LOG10_LO + k / BINS_PER_DECADE)
    hi_mag = 10 ** (LOG10_LO + (k + 1) / BINS_PER_DECADE)
    lower = torch.cat([-hi_mag.flip(0), torch.zeros(1, dtype=torch.float64), lo_mag])
    upper = torch.cat([-lo_mag.flip(0), torch.zeros(1, dtype=torch.float64), hi_mag])
    return lower, upper


LOWER, UPPER = _bin_edges()


def finish(sums: torch.Tensor, maxes: torch.Tensor, wanted, quantiles) -> dict:
    """Statistics of the whole tensor from its reduced vectors."""
    sums, maxes = sums.double().cpu(), maxes.double().cpu()
    n = float(sums[0])
    out = {}
    if "count" in wanted:
        out["count"] = n
    if "nonfinite" in wanted:
        out["nonfinite"] = float(sums[6])
    if n == 0:
        return out
    mean = float(sums[1]) / n
    ex2 = float(sums[2]) / n
    var = max(ex2 - mean * mean, 0.0)
    std = math.sqrt(var)
    vmax, vmin = float(maxes[0]), -float(maxes[1])
    values = {"mean": mean, "std": std, "rms": math.sqrt(ex2), "min": vmin, "max": vmax,
              "abs_max": max(abs(vmin), abs(vmax)), "zero_frac": float(sums[5]) / n}
    values["kurtosis"] = float("nan")
    if var > 0:
        # Fourth central moment from raw moments: E[(x-m)^4] = E4 - 4 m E3 + 6 m^2 E2 - 3 m^4.
        ex3, ex4 = float(sums[3]) / n, float(sums[4]) / n
        m4 = ex4 - 4 * mean * ex3 + 6 * mean * mean * ex2 - 3 * mean ** 4
        values["kurtosis"] = max(m4, 0.0) / (var * var)
    hist = sums[7:]
    if "outlier_frac" in wanted:
        values["outlier_frac"] = _mass_outside(hist, mean - 6 * std, mean + 6 * std) / n
    out.update((key, value) for key, value in values.items() if key in wanted)
    if "quantiles" in wanted:
        for q in quantiles:
            out[f"q{q:g}"] = _quantile(hist, n, q, vmin, vmax)
    return out


def _fraction_below(lower: torch.Tensor, upper: torch.Tensor, edge: float) -> torch.Tensor:
    """Share of each bin [lower, upper) below `edge` (log-uniform within a bin; zero: a point)."""
    tiny = 1e-300
    if edge > 0:   # only positive bins can be cut by a positive edge
        frac = ((math.log(max(edge, tiny)) - lower.clamp_min(tiny).log()) /
                (upper.clamp_min(tiny).log() - lower.clamp_min(tiny).log()))
    else:     # negative bins: magnitudes run from -upper (small) to -lower (large)
        frac = 1 - ((math.log(max(-edge, tiny)) - (-upper).clamp_min(tiny).log()) /
                    ((-lower).clamp_min(tiny).log() - (-upper).clamp_min(tiny).log()))
    frac = torch.nan_to_num(frac, nan=0.0).clamp(0, 1)
    frac = torch.where(upper <= edge, torch.ones_like(frac), frac)
    return torch.where(lower >= edge, torch.zeros_like(frac), frac)


def _mass_outside(hist: torch.Tensor, lo: float, hi: float) -> float:
    """Values below lo or above hi (both estimated within the bins they cut)."""
    below = (hist * _fraction_below(LOWER, UPPER, lo)).sum()
    above = (hist * (1 - _fraction_below(LOWER, UPPER, hi))).sum()
    return float(below + above)


def _quantile(hist: torch.Tensor, n: float, q: float, vmin: float, vmax: float) -> float:
    target = q * n
    cum = torch.cumsum(hist, 0)
    i = int(torch.searchsorted(cum, torch.tensor(target, dtype=torch.float64))
            .clamp(max=N_HIST - 1))
    before = float(cum[i - 1]) if i > 0 else 0.0
    inside = float(hist[i])
    frac = 0.5 if inside == 0 else min(max((target - before) / inside, 0.0), 1.0)
    lower, upper = max(float(LOWER[i]), vmin), min(float(UPPER[i]), vmax)
    if i == N_MAG or lower >= upper:
        return lower if i != N_MAG else 0.0
    if lower > 0:  # log-interpolate within the bin
        return math.exp(math.log(lower) + frac * (math.log(upper) - math.log(lower)))
    if upper < 0:
        return -math.exp(math.log(-lower) + frac * (math.log(-upper) - math.log(-lower)))
    return lower + frac * (upper - lower)


def attention_summary(q: torch.Tensor, k: torch.Tensor, mask, n_queries: int,
                      scale: Optional[float] = None) -> tuple:
    """Max logit and entropy for `n_queries` evenly spaced query positions of every sequence and
    head; `mask` a boolean tensor (True = may attend), other mask objects taken as plain causal.
    Returns (sums [3], maxes [1]): entropy total, log(keys seen) total, (query, head) rows."""
    b, s, h, d = q.shape
    # CoreAttention's inputs keep their grouped-query k heads: repeat them for the summary.
    if k.shape[2] != h:
        from lingua.model.layers import repeat_kv

        k, _ = repeat_kv(k, k, h)
    idx = torch.linspace(s - 1, 0, min(n_queries, s), device=q.device).round().long().unique()
    qs = q.detach()[:, idx].float()                                        # [b, n, h, d]
    scale = scale if scale is not None else 1 / math.sqrt(d)   # the attention's own (MLA's differs)
    logits = torch.einsum("bnhd,bshd->bhns", qs, k.detach().float()) * scale
    allowed = torch.arange(s, device=q.device)[None, :] <= idx[:, None]   # [n, s] causal
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        m = mask if mask.dim() == 4 else mask[None, None]
        allowed = allowed[None, None] & m[:, :, idx, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = logits.softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)             # [b, h, n]
    seen = allowed.sum(-1).double().expand_as(entropy)                   # keys each row sees
    sums = torch.stack([entropy.double().sum(), seen.clamp_min(1).log().sum(),
                        torch.tensor(float(entropy.numel()), dtype=torch.float64,
                                     device=q.device)])
    maxes = logits.amax().double().reshape(1)
    return sums, maxes


def router_summary(scores: torch.Tensor, experts: torch.Tensor) -> tuple:
    """Tokens per expert and routing entropy: sums [E + 2] (counts, entropy total, tokens)."""
    n_experts = scores.shape[-1]
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).double()
    p = scores.detach().float()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    extra = torch.stack([entropy.double().sum(),
                         torch.tensor(float(entropy.numel()), dtype=torch.float64,
                                      device=scores.device)]).to(counts.device)
    return torch.cat([counts, extra]), torch.zeros(0, dtype=torch.float64, device=counts.device)


def finish_attention(sums, maxes) -> dict:
    rows = float(sums[2])
    if rows == 0:
        return {}
    return {"max_logit": float(maxes[0]), "entropy": float(sums[0]) / rows,
            "entropy_frac": float(sums[0]) / max(float(sums[1]), 1e-30)}


def finish_router(sums, maxes) -> dict:
    counts = sums[:-2].double()
    total = float(counts.sum())
    if total == 0:
        return {}
    load = counts / total * len(counts)   # 1.0 = perfectly balanced
    return {"load_min": float(load.min()), "load_max": float(load.max()),
            "load_cv": float(counts.std(unbiased=False) / counts.mean()),
            "entropy": float(sums[-2]) / max(float(sums[-1]), 1.0)}
