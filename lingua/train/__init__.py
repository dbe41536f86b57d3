"""The training run: the loop (loop.py) and the hooks interface features attach through
(hooks.py), the App an app describes its model with, model building, the step's tally, the
loss-spike policy, probing and profiling hooks, preemption, memory policy, Slurm job settings.
Built on model, parallel, data, checkpoint, optim and observe."""
