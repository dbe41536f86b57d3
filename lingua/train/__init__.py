"""The training run: the loop (loop.py) and the hooks interface features attach through
(hooks.py), the App an app describes its model with, model building, optimizers, loss-spike
policy, probing and profiling hooks, data and tokenizers, checkpoints, preemption, memory policy,
Slurm job settings, HF interop. Built on model, parallel and observe."""
