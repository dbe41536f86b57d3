"""Float8 MoE experts (`distributed.float8`, any recipe): torchao's float8 rowwise grouped GEMM
(e4m3, power-of-2 scales along the reduced dim), each expert's rows padded to a multiple of 16.
Off CUDA `EmulatedFloat8GroupedMM` does the same casts and multiplies in fp32."""

import torch
from torch import nn

from lingua.model.moe import GroupedExperts

GROUP_MULTIPLE = 16


def converts_experts(module: nn.Module) -> bool:
    """Whether `module` is grouped experts the float8 grouped GEMM can run (see why_not)."""
    return isinstance(module, GroupedExperts) and why_not(module) is None


def why_not(module: GroupedExperts):
    """Why the float8 grouped GEMM cannot run these experts, or None when it can."""
    if module.impl != "grouped":
        return f"they loop over experts (model.expert_impl={module.impl})"
    _, dim, hidden = module.w1.shape
    odd = [f"{name}={n}" for name, n in (("dim", dim), ("expert hidden", hidden))
           if n % GROUP_MULTIPLE]
    return f"{' and '.join(odd)} not a multiple of {GROUP_MULTIPLE}" if odd else None


def convert_experts(module: GroupedExperts, emulate: bool) -> None:
    """Make `module` compute in float8 (in place; its parameters are unchanged)."""
    module.grouped_mm = emulated_float8_grouped_mm if emulate else float8_grouped_mm
    module.group_multiple = GROUP_MULTIPLE


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [n, k] @ w[e] [k, m] for each expert's rows (group ends `offs`), in float8 (CUDA)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    # torchao takes the weight column-major ([e, k, m] with k contiguous); ours are row-major.
    w_column_major = w.transpose(-2, -1).contiguous().transpose(-2, -1)
    return _to_fp8_rowwise_then_scaled_grouped_mm(x, w_column_major, offs, out_dtype=x.dtype,
                                                  pad_token_groups_for_grouped_mm=False)


def _quantized(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` cast to e4m3 with torchao's power-of-2 scales along `dim`, back in fp32."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(t, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=dim, round_scales_to_power_of_2=True)
    return to_fp8_saturated(t.float() * scale, torch.float8_e4m3fn).float() / scale


class EmulatedFloat8GroupedMM(torch.autograd.Function):
    """torchao's float8 rowwise grouped matmul, products summed in fp32, one expert at a time."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        x8, w8 = _quantized(x, -1), _quantized(w, -2)
        y = x8.new_zeros(x.shape[0], w.shape[-1])
        for e, rows in _groups(offs):
            y[rows] = x8[rows] @ w8[e]
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad8, w8 = _quantized(grad, -1), _quantized(w, -1)
        grad_x = torch.zeros_like(x, dtype=torch.float32)
        grad_w = torch.zeros_like(w, dtype=torch.float32)
        for e, rows in _groups(offs):
            grad_x[rows] = grad8[rows] @ w8[e].T
            # The weight gradient reduces over the expert's tokens: scales per column of those.
            grad_w[e] = _quantized(x[rows], 0).T @ _quantized(grad[rows], 0)
        return grad_x.to(x.dtype), grad_w.to(w.dtype), None


def _groups(offs: torch.Tensor):
    """(expert, its rows as a slice) for every expert with rows."""
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            yield e, slice(start, end)
        start = end


@torch.compiler.disable   # reads the group ends on the host; CPU tests only
def emulated_float8_grouped_mm(x: torch.Tensor, w: torch.Tensor,
                               offs: torch.Tensor) -> torch.Tensor:
    return EmulatedFloat8GroupedMM.apply(x, w, offs)
