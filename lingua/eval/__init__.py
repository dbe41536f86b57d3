"""Evaluating and using a checkpoint: validation loss, downstream tasks through lm-eval,
async evaluation jobs, the eval CLI, generation and the shipped tasks. Built on train."""
