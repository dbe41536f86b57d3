"""Downstream tasks that ship with lingua, in lm-evaluation-harness's YAML task format.

Each subfolder is one task: its YAML, a utils.py whose `load` builds the docs, and the docs in
a file beside them, so the tasks load with no network and no Hugging Face cache:

    from lm_eval.tasks import TaskManager
    TaskManager(include_path=str(TASKS_DIR))  # then tasks=["lingua_continuation"]

lingua_continuation: pick the true continuation of a held-out passage of the embedded corpus
among four (acc, acc_norm). It exists for tests and the quickstart, not to rank models; its
data is made by setup/make_eval_task.py.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).parent
SHIPPED_TASKS = ("lingua_continuation",)
