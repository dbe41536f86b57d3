"""The CUDA-only wiring of float8 FSDP all-gathers and TP styles, built on torch's fake process
group (gloo has no float8 type, so no CPU run can all-gather float8), for tests/test_float8.py.

`python -m tests.workers.float8_fsdp_worker`: a tiny LLaMA on the meta device, converted as a
CUDA run of dp_shard=4 converts it (tensorwise, float8 all-gather), sharded by apply_fsdp at
world size 4, given storage; then the per-step hook as the trainer builds it for a CUDA job.
Prints one JSON object: what the weights' local shards are, the scales the hook set against
the shards' own amax (no communication happens on the fake group, so each rank's amax is its
shard's), and the state dict's keys and dtypes against the unconverted model's. Then a model
tensor-parallelized over 2 of those ranks with the float8 styles a CUDA run gets: their names,
and that a forward and backward with loss parallelism run through them (no numbers: the fake
group moves no data).
"""

import json
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lingua import float8
from lingua.float8 import Float8ScalesHook
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.parallel.distributed import (
    DistEnv,
    DistributedArgs,
    apply_fsdp,
    build_mesh,
    parallel_dims,
)


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    args = DistributedArgs(dp_shard=4, model_dtype="bf16", compile=True, float8="tensorwise")
    dims = parallel_dims(args, 4)
    env = DistEnv(rank=0, local_rank=0, world_size=4, device=torch.device("cuda"), dims=dims,
                  mesh=build_mesh(dims, "cpu"))
    with torch.device("meta"):
        model = Transformer(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                      multiple_of=32, vocab_size=258, max_seq_len=64))
    plain = {k: v.dtype for k, v in model.state_dict().items()}
    all_gather = float8.uses_fsdp_float8_all_gather(args, dims, env.device.type)
    names = float8.apply_float8(model, args.float8, fsdp_float8_all_gather=all_gather)
    apply_fsdp(model, list(model.layers.values()), env, args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p.to_local())
    hook = Float8ScalesHook(SimpleNamespace(distributed=args), env)
    hook.before_step(SimpleNamespace(parts=[model]), 1)
    errors = []
    for name in names:
        local = model.get_submodule(name).weight._local_tensor
        want = torch.finfo(torch.float8_e4m3fn).max / local.abs().max().double().item()
        errors.append(abs(float(local._precomputed_scale) - want) / want)
    state = model.state_dict()
    print(json.dumps({
        "all_gather": all_gather, "hook_enabled": hook.enabled, "converted": len(names),
        "local_types": sorted({type(model.get_submodule(n).weight._local_tensor).__name__
                               for n in names}),
        "scale_error": max(errors) if errors else math.inf,
        "same_keys": list(state) == list(plain),
        "same_dtypes": all(state[k].dtype == d for k, d in plain.items()),
        "cpu_all_gather": float8.uses_fsdp_float8_all_gather(args, dims, "cpu"),
        **float8_tp_on_cuda(),
    }))


def float8_tp_on_cuda() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lingua.models.llama.parallelize import tp_plans
    from lingua.parallel.tensor_parallel import loss_parallel_context

    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    model = Transformer(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32,
                                  vocab_size=258, max_seq_len=64))
    float8.apply_float8(model, "tensorwise", emulate=True)
    root, block = tp_plans(model, loss_parallel=True)
    plans = [float8.float8_tp_plan(b, block, "cuda") for b in model.layers.values()]
    for b, plan in zip(model.layers.values(), plans):
        parallelize_module(b, tp_mesh, plan)
    parallelize_module(model, tp_mesh, float8.float8_tp_plan(model, root, "cuda"))
    tokens = torch.randint(0, 258, (2, 32))
    with loss_parallel_context(True):
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return {"tp_styles": {k: type(v).__name__ for k, v in plans[0].items()},
            "tp_grads": all(p.grad is not None for p in model.parameters())}


if __name__ == "__main__":
    main()
