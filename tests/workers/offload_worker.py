"""distributed.cpu_offload's path on 2 CPU ranks, for tests/test_cuda_setup.py.

`torchrun --nproc-per-node 2 -m tests.workers.offload_worker OUT_DIR`; each rank writes
OUT_DIR/rank<r>.json.

On a GPU the process group is `process_group_backend(cpu_offload=True)` = "cuda:nccl,cpu:gloo"
and FSDP2's CPUOffloadPolicy keeps sharded parameters, gradients and optimizer state on the CPU.
Here the CUDA half is torch's fake backend (it must never be used: every tensor is on the CPU),
and pinning memory, which needs an accelerator, is a no-op. What runs for real: the mesh
sub-groups built from that two-backend default group, lingua's apply_fsdp with the offload
policy, the gradient norm (optim.clip_grad_norm: a Partial DTensor's full_tensor over the mesh),
the fused AdamW step, the probe's sharded-gradient statistics and a DCP save and load, all on
CPU tensors through the CPU half of the group.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
from torch import nn

from lingua import checkpoint, optim
from lingua.observe.probe import Probe
from lingua.observe.probe_stats import summarize
from lingua.parallel import distributed

MESH_GROUPS = distributed.MESH_DIMS + ("dp", "dp_shard_cp", "dp_cp")


def main(out_dir: Path) -> None:
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # no accelerator to pin for
    args = distributed.DistributedArgs(dp_shard=2, cpu_offload=True)
    backend = distributed.process_group_backend(args, "cuda")
    dist.init_process_group(backend=backend.replace("cuda:nccl", "cuda:fake"))
    env = distributed.init(args)  # the group exists: this builds the mesh on it
    result = {"backend": backend, "groups": {}}
    for name in MESH_GROUPS:
        group = env.mesh[name].get_group()
        result["groups"][name] = [group._get_backend(torch.device(d)).name()
                                  for d in ("cpu", "cuda")]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    model = distributed.apply_fsdp(model, list(model), env, args)
    inputs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    model(inputs[env.rank]).square().sum().backward()
    result["param_devices"] = sorted({str(p.to_local().device) for p in model.parameters()})
    result["grad_devices"] = sorted({str(p.grad.to_local().device) for p in model.parameters()})

    # The probe's statistics of a sharded gradient (all-reduced over the mesh) against the full one.
    grad = model[0].weight.grad
    sums, _ = Probe._param_summary(grad.detach())
    full_sums, _ = summarize(grad.full_tensor())
    result["probe_sums_match"] = bool(torch.allclose(sums, full_sums))

    norm = optim.clip_grad_norm([model], max_norm=0.5)
    for x in inputs:  # FSDP sums the ranks' gradients (divide factor 1)
        reference(x).square().sum().backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    result["norm"], result["reference_norm"] = norm.item(), want.item()
    result["norm_device"] = str(norm.device)
    clipped = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]).norm()
    result["clipped_norm"] = clipped.item()

    before = [p.full_tensor().clone() for p in model.parameters()]
    optimizers = optim.Optimizers([model], optim.OptimArgs(warmup=0), 10, torch.device("cuda"))
    optimizers.step()
    after = [p.full_tensor().clone() for p in model.parameters()]
    result["stepped"] = all(not torch.equal(a, b) for a, b in zip(after, before))
    result["param_devices_after_step"] = sorted({str(p.to_local().device)
                                                 for p in model.parameters()})

    saved = checkpoint.save(out_dir / "run", 1, [model], optimizers.optimizers, {"step": 1},
                            "x: 1\n", env.rank, env.world_size, keep=0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    checkpoint.load(saved, [model], optimizers.optimizers, env.rank, env.world_size)
    restored = [p.full_tensor() for p in model.parameters()]
    result["restored"] = all(torch.equal(a, b) for a, b in zip(after, restored))
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    distributed.barrier(env)
    distributed.exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
