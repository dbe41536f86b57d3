"""Docs of the lingua_continuation task, read from data.jsonl beside this file."""

import json
from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parent / "data.jsonl"


def load(**kwargs) -> datasets.DatasetDict:
    """The task's splits ("test"; "train" for few-shot); lm-eval's keyword arguments are ignored."""
    splits = {}
    with open(DATA, encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            splits.setdefault(doc["split"], []).append(doc)
    return datasets.DatasetDict({name: datasets.Dataset.from_list(docs)
                                 for name, docs in splits.items()})
