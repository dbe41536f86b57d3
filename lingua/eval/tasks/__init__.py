"""Downstream tasks that ship with lingua, in lm-evaluation-harness's YAML format: each subfolder
is a task (its YAML, a utils.py whose `load` builds the docs, and their data file), loaded with no
network by TaskManager(include_path=str(TASKS_DIR)).

lingua_continuation: pick the true continuation of a held-out passage of the embedded corpus
among four (acc, acc_norm), for tests and the quickstart; setup/make_eval_task.py makes its data.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).parent
SHIPPED_TASKS = ("lingua_continuation",)
