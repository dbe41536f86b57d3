"""The CUDA-only parts of lingua/parallel/distributed.py, checked on CPU where their logic allows:
the process group's backend string (CPU offload needs a CPU backend beside NCCL), which GPU a
process takes, and the offload path on 2 gloo ranks with a fake CUDA half. What only a GPU can check
is listed in the GPU runbook (tests/test_gpu.py)."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lingua.errors import ConfigError
from lingua.parallel import distributed
from lingua.parallel.distributed import DistributedArgs, param_device, process_group_backend
from tests.conftest import run_torchrun


@pytest.mark.parametrize("backend,offload,device_type,want", [
    ("auto", False, "cuda", "nccl"),
    ("auto", True, "cuda", "cuda:nccl,cpu:gloo"),
    ("nccl", True, "cuda", "cuda:nccl,cpu:gloo"),
    ("nccl", False, "cuda", "nccl"),
    ("auto", False, "cpu", "gloo"),
    ("gloo", True, "cuda", "gloo"),   # gloo alone already moves CPU (and CUDA) tensors
])
def test_process_group_backend(backend, offload, device_type, want):
    args = DistributedArgs(backend=backend, cpu_offload=offload)
    assert process_group_backend(args, device_type) == want


def test_the_offload_backend_string_is_one_torch_parses_into_both_devices():
    """torch's own parser (BackendConfig, what init_process_group and new_group use): a CUDA and
    a CPU backend, so c10d can pick by the tensor's device."""
    from torch.distributed.distributed_c10d import BackendConfig

    string = process_group_backend(DistributedArgs(cpu_offload=True), "cuda")
    assert BackendConfig(dist.Backend(string)).get_device_backend_map() == {"cuda": "nccl",
                                                                           "cpu": "gloo"}


def test_offloaded_parameters_are_materialised_on_the_cpu():
    cuda = torch.device("cuda", 3)
    assert param_device(DistributedArgs(cpu_offload=True), cuda) == torch.device("cpu")
    assert param_device(DistributedArgs(), cuda) == cuda


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda as a process sees it with `count` visible GPUs; returns the set_device calls."""
    calls = []

    def install(count):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", calls.append)
        return calls
    return install


@pytest.mark.parametrize("local_rank,visible,want", [
    (3, 1, 0),    # srun --gpus-per-task=1: each task sees only its own GPU
    (3, 8, 3),    # torchrun / stool's gpus_per_node: every task sees the node's GPUs
    (0, 8, 0),
    (5, 4, 1),    # --gpus-per-task=4: one of the task's own four
])
def test_the_device_is_the_local_rank_among_the_visible_gpus(fake_gpus, local_rank, visible, want):
    calls = fake_gpus(visible)
    assert distributed._device(local_rank) == torch.device("cuda", want)
    assert calls == [want]


def test_a_cpu_process_takes_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device on CPU"))
    assert distributed._device(5) == torch.device("cpu")


@pytest.mark.parametrize("world_size,extra,refused", [
    (1, {}, True),                      # one process: FSDP is not applied, nothing would offload
    (2, {"tp": 2}, True),               # tensor parallel only: no data-parallel ranks either
    (2, {}, False),                     # dp_shard=2
    (2, {"dp_replicate": 2, "dp_shard": 1}, False),   # DDP-style replicas, FSDP's HSDP path
])
def test_cpu_offload_needs_a_layout_that_shards(monkeypatch, world_size, extra, refused):
    monkeypatch.setenv(distributed.JOB_DEVICE_VAR, "cuda")  # as stool validates for a GPU job
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = DistributedArgs(cpu_offload=True, **extra)
    if refused:
        with pytest.raises(ConfigError, match="cpu_offload=true offloads through FSDP"):
            distributed.validate_args(args)
    else:
        distributed.validate_args(args)


@pytest.mark.distributed
def test_cpu_offload_path_on_a_two_backend_group(tmp_path):
    """2 ranks, default group "cuda:<fake>,cpu:gloo" (process_group_backend's string with NCCL
    replaced by torch's fake backend): every mesh sub-group has both backends, and the offloaded
    FSDP2 model's gradient norm, clipping, optimizer step, probe statistics and checkpoint
    round trip all run on CPU tensors through the CPU half."""
    run_torchrun(2, "tests.workers.offload_worker", [str(tmp_path)], timeout=120)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["backend"] == "cuda:nccl,cpu:gloo"
        assert all(backends == ["gloo", "fake"] for backends in r["groups"].values()), r["groups"]
        assert r["param_devices"] == r["grad_devices"] == r["param_devices_after_step"] == ["cpu"]
        assert r["norm_device"] == "cpu"
        assert r["norm"] == pytest.approx(r["reference_norm"], rel=1e-5)
        assert r["clipped_norm"] == pytest.approx(0.5, rel=1e-4)
        assert r["probe_sums_match"] and r["stepped"] and r["restored"]


def test_an_untested_torch_is_named_at_start_and_the_tested_one_is_not():
    """Three pipeline schedules fail under torch 2.11: a run on another torch than the pin says
    so once, at start; the pin and the check name one version."""
    from lingua.launch.process import TESTED_TORCH, torch_version_warning

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'"torch=={TESTED_TORCH}.0"' in pyproject
    assert torch_version_warning(f"{TESTED_TORCH}.0") is None
    assert torch_version_warning(f"{TESTED_TORCH}.1+cu130") is None
    message = torch_version_warning("2.11.0+cu130")
    assert message.startswith("torch 2.11.0+cu130 is not the version lingua is tested with")
    assert "ZBVZeroBubble" in message and f"torch=={TESTED_TORCH}.0" in message
    assert torch_version_warning("2.1.3") is not None   # not a prefix match
