"""Downstream tasks that ship with lingua in lm-eval's YAML format, a subfolder each (YAML, a
utils.py whose `load` builds the docs, a data file), loaded offline via include_path=TASKS_DIR.
lingua_continuation: pick a held-out passage's true continuation among four (tests, quickstart)."""

from pathlib import Path

TASKS_DIR = Path(__file__).parent
SHIPPED_TASKS = ("lingua_continuation",)
