"""Per-rank bytes of parameters, gradients and optimizer state after one training step.

Run under torchrun with the trainer's overrides; rank 0 writes {"rank": bytes...} to argv[1].
"""

import json
import sys

import torch

from apps.llama import train
from lingua import config, optim
from lingua.parallel import distributed
from lingua.train import build, loop


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def main(out_path, argv):
    args = config.load("llama", train.TrainArgs, argv, train.validate)
    env = distributed.init(args.distributed)
    parts, stage_ids = build.build_model_parts(args, env, train.APP)
    model = parts[0]
    optimizers = optim.Optimizers(parts, args.optim, args.steps, env.device)
    run = loop.Run(args, env, train.APP, parts, stage_ids, optimizers)
    run.train_step(run.train_loader.next_step())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    optimizers.optimizers[0].step()
    states = [v for s in optimizers.optimizers[0].state.values() for v in s.values()
              if torch.is_tensor(v) and v.numel() > 1]
    mine = {"params": local_bytes(model.parameters()), "grads": local_bytes(grads),
            "optim": local_bytes(states)}
    everyone = [None] * env.world_size
    torch.distributed.all_gather_object(everyone, mine)
    if env.is_main:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    distributed.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    distributed.exit_process(0)  # results are written; gloo can abort interpreter teardown
