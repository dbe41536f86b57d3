"""The training run: config schema, the loop, optimizers, loss-spike policy, data and
tokenizers, checkpoints, preemption, Slurm job settings, HF interop. Built on model,
parallel and observe."""
