"""Test tasks read the shipped task's docs."""

from lingua.eval_tasks.lingua_continuation.utils import load  # noqa: F401
