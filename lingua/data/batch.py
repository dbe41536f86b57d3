"""What every data format shares: the Batch a loader hands the trainer, the name of the
validation directory, the source text of the debug corpora (stdlib docstrings), and how a
prepared directory is written (`write_once`).

A module of its own so that __init__.py (memmap, jsonl, and the dispatch to every format) and
chat.py (the chat format) both build on it without importing each other.
"""

import ast
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

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


SKIP_STDLIB_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo",
                    "__pycache__", "lib2to3", "ensurepip"}


def stdlib_docstrings(min_chars: int = 200) -> List[str]:
    """Long docstrings of the Python standard library: English prose on every machine with
    Python."""
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
    """ast.walk's nodes and order restricted to statements (and except/case clauses): a def is
    always a statement, so this finds the same docstrings without visiting every expression
    (a third of the corpus's build time)."""
    level = [tree]
    while level:
        yield from level
        level = [child for node in level for field in node._fields if field in STATEMENT_LISTS
                 for child in getattr(node, field)]


def write_once(root, marker: str, write: Callable, what: str):
    """Make the directory `root` with `write(tmp)` unless `root/marker` is there; safe when
    processes race. `write` fills a private temporary directory, which is then renamed into
    place: a rename is atomic, so nobody reads half of it, the loser of a race drops its copy,
    and a failure or Ctrl-C leaves nothing behind. Returns what `write` returned, or None where
    `root` was already made. A `root` that exists without its marker is refused, naming `what`."""
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
