"""Test tasks read the shipped task's docs."""

from lingua.eval.tasks.lingua_continuation.utils import load  # noqa: F401
