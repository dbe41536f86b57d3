"""What every data format shares (so __init__.py and chat.py need not import each other): Batch,
the resume check, the validation directory, the debug corpora's text, and `write_once`.
"""

import ast
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import torch

from lingua.errors import ConfigError

VAL_DIR = "val"


@dataclass
class Batch:
    tokens: torch.Tensor    # [b, seq_len] inputs
    labels: torch.Tensor    # [b, seq_len] next tokens
    doc_ids: torch.Tensor   # [b, seq_len] document index of each input token (for masking)
    # Labels that count (not IGNORE_INDEX) in the step's whole global batch, the same on every
    # rank: the loss is their mean. None: every label counts (seq_len x global batch).
    step_targets: Optional[int] = None


def packed_batch(rows: np.ndarray, docs: np.ndarray) -> Batch:
    """Rows of seq_len+1 tokens and their document ids, as inputs and next-token labels."""
    rows = torch.from_numpy(rows.astype(np.int64))
    docs = torch.from_numpy(docs.astype(np.int64))
    return Batch(tokens=rows[:, :-1], labels=rows[:, 1:], doc_ids=docs[:, :-1])


def val_share(rows: np.ndarray, docs: np.ndarray, dp_rank: int, dp_size: int,
              batch_size: int) -> List[Batch]:
    """Rank dp_rank's contiguous share of the validation rows, in micro-batches."""
    share = len(rows) // dp_size
    mine = slice(dp_rank * share, (dp_rank + 1) * share)
    rows, docs = rows[mine], docs[mine]
    return [packed_batch(rows[i:i + batch_size], docs[i:i + batch_size])
            for i in range(0, share, batch_size)]


def check_position(state: dict, now: dict, keys: str) -> None:
    """ConfigError unless the data position `state` was saved with `now`'s values of `keys`."""
    if any(state.get(k) != v for k, v in now.items()):
        saved = ", ".join(f"{k}={state.get(k)}" for k in now)
        this = ", ".join(f"{k}={v}" for k, v in now.items())
        raise ConfigError(f"The checkpoint's data position was saved with {saved}; this run has "
                          f"{this}. Resume with the same {keys}, or start in a new dump_dir.")


SKIP_STDLIB_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo",
                    "__pycache__", "lib2to3", "ensurepip"}


def stdlib_docstrings(min_chars: int = 200) -> List[str]:
    """Long docstrings of the Python standard library: English prose on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_STDLIB_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in statements(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars:
                        docs.append(doc)
    return docs


STATEMENT_LISTS = {"body", "orelse", "finalbody", "handlers", "cases"}


def statements(tree: ast.AST):
    """ast.walk restricted to statements (and except/case clauses): the same docstrings, faster."""
    level = [tree]
    while level:
        yield from level
        level = [child for node in level for field in node._fields if field in STATEMENT_LISTS
                 for child in getattr(node, field)]


def write_once(root, marker: str, write: Callable, what: str):
    """Make the directory `root` with `write(tmp)` unless `root/marker` is there; safe when
    processes race (a private temporary directory renamed into place; a failure leaves nothing).
    Returns what `write` returned, or None; refuses a `root` without its marker, naming `what`."""
    root = Path(root)
    if (root / marker).is_file():
        return None
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        made = write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (root / marker).is_file():
            raise ConfigError(f"Could not create {what} at {root}: the path exists but holds no "
                              f"{marker}. Remove it or choose another path.") from None
        return None   # another process made it first
    return made
