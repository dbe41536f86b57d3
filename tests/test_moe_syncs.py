"""The MoE layer's training forward and backward wait on the GPU nowhere (issue 32): a host sync
per layer and micro-batch drains the GPU's queue before the next collective. The CPU has no CUDA
sync-debug mode, so a TorchDispatchMode records the aten ops that sync on CUDA, and
Tensor.tolist (which dispatches none); only expert parallelism's split sizes may sync."""

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lingua.model.moe import MoE

aten = torch.ops.aten
# Ops whose CUDA kernel copies a device value to the host before returning.
SYNCING = {aten._local_scalar_dense,   # .item(), float(t), bool(t), int(t)
           aten.lift_fresh,            # torch.tensor / new_tensor of host data: a blocking H2D copy
           aten.bincount,              # output size = max + 1
           aten.nonzero, aten.masked_select, aten._unique2, aten.unique_consecutive,
           aten.unique_dim, aten.is_nonzero, aten.equal}


def _sync_name(func, args, kwargs) -> str:
    packet = func.overloadpacket
    if packet in SYNCING:
        return packet.__name__
    # repeat_interleave(x, repeats) reaches here as repeat_interleave.Tensor(repeats, output_size)
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if packet in (aten.index, aten.index_put, aten.index_put_):   # a boolean mask: nonzero
        if any(t is not None and t.dtype == torch.bool for t in args[1]):
            return f"{packet.__name__} with a boolean mask"
    return ""


class _Recorder(TorchDispatchMode):
    def __init__(self, syncs: list):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _sync_name(func, args, kwargs)
        if name:
            self.syncs.append(name)
        return func(*args, **kwargs)


@contextmanager
def recording_syncs(monkeypatch):
    """Yields the list of syncs the code inside makes (autograd's backward included)."""
    syncs = []
    tolist = torch.Tensor.tolist

    def recorded_tolist(t):
        syncs.append("tolist")
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", recorded_tolist)
    with _Recorder(syncs):
        yield syncs
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)


def test_the_recorder_sees_each_kind_of_sync(monkeypatch):
    x = torch.tensor([2, 0, 1])
    with recording_syncs(monkeypatch) as syncs:
        x.sum().item()
        x.tolist()
        torch.bincount(x)
        x.new_tensor(3.0)
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=3)   # not a sync
        x[x > 0]
    assert syncs == ["_local_scalar_dense", "tolist", "bincount", "lift_fresh",
                     "repeat_interleave without output_size", "index with a boolean mask"]


def _train_step(m: MoE, x: torch.Tensor) -> None:
    y = m(x)
    (y.square().sum() + m.balance_loss).backward()


def _train_step_without_balance(m: MoE, x: torch.Tensor) -> None:
    m(x).square().sum().backward()


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("impl,want", [("grouped", []), ("loop", ["tolist"])])
def test_moe_training_step_makes_no_host_sync(monkeypatch, shared, impl, want):
    """The loop (the reference implementation) splits the rows by the counts on the host."""
    torch.manual_seed(0)
    m = MoE(16, 24, 4, 2, n_shared_experts=shared, expert_impl=impl, aux_loss_coef=0.01,
            z_loss_coef=0.001)
    m.train()
    x = torch.randn(2, 6, 16, requires_grad=True)
    with recording_syncs(monkeypatch) as syncs:
        _train_step(m, x)
    assert syncs == want
    assert m.routing is not None and m.step_counts is not None   # the counted path ran


def test_capacity_drops_cost_one_sync(monkeypatch):
    """Which slots survive the capacity depends on the routing, and so does the number of rows
    the experts get: one sync, as in any packed (not padded-to-capacity) layout."""
    torch.manual_seed(0)
    m = MoE(16, 24, 4, 2, capacity_factor=0.5)
    m.train()
    with recording_syncs(monkeypatch) as syncs:
        _train_step_without_balance(m, torch.randn(12, 16))
    assert syncs == ["index with a boolean mask"]


def test_expert_parallel_dispatch_syncs_only_for_its_split_sizes(monkeypatch):
    """One gloo rank (ep = 1): the count exchange, the token all-to-alls and the regrouping run
    as on several; the split sizes the all-to-alls need on the host are the only sync."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lingua.parallel.expert_parallel import apply_ep

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        m = MoE(16, 24, 4, 2, aux_loss_coef=0.01)
        m.train()
        apply_ep(m, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
        with recording_syncs(monkeypatch) as syncs:
            _train_step(m, torch.randn(12, 16))
        assert syncs == ["tolist"]
    finally:
        dist.destroy_process_group()
