"""Using a checkpoint: validation loss, lm-eval tasks, async jobs, the CLI, generation, tasks."""
