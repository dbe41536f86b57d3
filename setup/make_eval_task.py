"""Make the lingua_continuation downstream task's data from the embedded corpus.

    python setup/make_eval_task.py            write lingua/eval/tasks/lingua_continuation/data.jsonl
    python setup/make_eval_task.py --check    exit 1 if data.jsonl is not what this would write

Each doc is a passage and four continuations, one of them true: {"id", "split", "context",
"choices", "label"}. Test docs come from the corpus's held-out (val) docstrings, which the debug
model never trains on; a passage whose continuation the train docstrings also hold is left out
(the stdlib copies some docstrings). That text is small (44 docstrings, 29 KB), so the test
passages are a sliding window over it: their true continuations never overlap, but a context
may hold an earlier passage's continuation. The 5 few-shot docs come from train docstrings, so
no solved example shares text with a test doc. A context ends right before a space and its
continuations start right after one: lm-eval's default target_delimiter " " puts back the text
as it was. Distractors are true continuations of passages from other docstrings of the split.

The text is the running Python's standard library, so the output depends on the Python version:
the task's YAML records the version it was made with (metadata.python), and --check says when
the running Python differs from it.
"""

import argparse
import inspect
import json
import platform
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lingua.data import build_embedded_corpus, stdlib_docstrings  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "lingua" / "eval" / "tasks" / "lingua_continuation"
SEED = 0
N_TEST, N_FEWSHOT, N_CHOICES = 200, 5, 4
CONTEXT_CHARS = (150, 250)
CONTINUATION_CHARS = (40, 80)
# the held-out rule of the embedded corpus, read from its builder so the two cannot drift apart
VAL_EVERY = inspect.signature(build_embedded_corpus).parameters["val_every"].default
PYTHON_LINE = re.compile(r'^(  python: )"([^"]*)"$', re.M)  # metadata.python in the YAML


def corpus_texts():
    """The embedded corpus's documents as (val, train), split as build_embedded_corpus does."""
    docs = stdlib_docstrings()
    return ([d for i, d in enumerate(docs) if i % VAL_EVERY == 0],
            [d for i, d in enumerate(docs) if i % VAL_EVERY])


def _cut(text: str, i: int) -> bool:
    """A context may end at i and a continuation start at i + 1: one space between two words."""
    return (0 < i < len(text) - 1 and text[i] == " " and not text[i - 1].isspace()
            and not text[i + 1].isspace())


def _word_end(text: str, i: int) -> bool:
    return i == len(text) or (text[i].isspace() and not text[i - 1].isspace())


def passages(text: str, rng: random.Random, once: bool = False):
    """(context, continuation) pairs from one docstring whose continuations tile it, in order."""
    out, b = [], CONTEXT_CHARS[0]
    while b < len(text):
        if not _cut(text, b):
            b += 1
            continue
        lo = b + 1 + CONTINUATION_CHARS[0]
        ends = [c for c in range(lo, min(b + 1 + rng.randint(*CONTINUATION_CHARS), len(text)) + 1)
                if _word_end(text, c)]
        first = max(0, b - rng.randint(*CONTEXT_CHARS))
        starts = [a for a in range(first, b - CONTEXT_CHARS[0] + 1)
                  if a == 0 or (text[a - 1].isspace() and not text[a].isspace())]
        if not ends or not starts:  # a very long "word" (a URL, a table row): try the next space
            b += 1
            continue
        out.append((text[starts[0]:b], text[b + 1:ends[-1]]))
        if once:
            break
        b = ends[-1]
    return out


def make_docs(split: str, pool, chosen, rng: random.Random):
    """Docs for the chosen (doc index, context, continuation) entries; distractors from `pool`."""
    docs = []
    for n, (src, context, truth) in enumerate(chosen):
        choices = [truth]
        while len(choices) < N_CHOICES:
            other, _, candidate = rng.choice(pool)
            # from another docstring, and not text the passage's own docstring holds (a copy of
            # a docstring elsewhere in the stdlib would otherwise make a distractor true)
            if other != src[0] and candidate not in choices and candidate not in src[1]:
                choices.append(candidate)
        distractors = choices[1:]
        label = rng.randrange(N_CHOICES)
        docs.append({"id": f"{split}-{n:03d}", "split": split, "context": context,
                     "choices": distractors[:label] + [truth] + distractors[label:],
                     "label": label})
    return docs


def build(val, train) -> str:
    """The contents of data.jsonl."""
    rng = random.Random(SEED)
    # the stdlib repeats itself (a function's docstring copied onto a method), so some held-out
    # text is also train text: keep a passage only if its continuation is nowhere in train
    seen = "\0".join(train)
    pool = [((i, text), c, t) for i, text in enumerate(val) for c, t in passages(text, rng)
            if t not in seen]
    if len(pool) < N_TEST:
        raise SystemExit(f"The held-out text gives only {len(pool)} passages, fewer than "
                         f"N_TEST={N_TEST}: lower N_TEST or the passage lengths.")
    test = [pool[k] for k in sorted(rng.sample(range(len(pool)), N_TEST))]
    few_pool = []
    for i in rng.sample(range(len(train)), 4 * N_FEWSHOT):  # the spares give distractors
        few_pool += [((i, train[i]), c, t) for c, t in passages(train[i], rng, once=True)]
    docs = make_docs("test", pool, test, rng) + make_docs("train", few_pool,
                                                          few_pool[:N_FEWSHOT], rng)
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="compare with the data.jsonl on disk instead of writing it")
    parser.add_argument("--out", type=Path, default=TASK_DIR / "data.jsonl")
    parser.add_argument("--yaml", type=Path, default=TASK_DIR / "lingua_continuation.yaml")
    args = parser.parse_args(argv)
    data = build(*corpus_texts()).encode("utf-8")
    n_docs = data.count(b"\n")
    now = platform.python_version()
    yaml_text = args.yaml.read_text(encoding="utf-8")
    stamp = PYTHON_LINE.search(yaml_text)
    if stamp is None:
        raise SystemExit(f"{args.yaml} has no `  python: \"X.Y.Z\"` line under metadata: put it "
                         f"back, it records which Python's docstrings the data came from.")
    if args.check:
        if args.out.is_file() and args.out.read_bytes() == data:
            print(f"{args.out} is up to date ({n_docs} docs, Python {now})")
            return 0
        why = (f"it was made from Python {stamp.group(2)}'s standard library and this is Python "
               f"{now}, whose docstrings differ; check under Python {stamp.group(2)}, or "
               if stamp.group(2) != now else "")
        print(f"{args.out} is not what setup/make_eval_task.py makes: {why}regenerate it with "
              f"`python setup/make_eval_task.py` (it rewrites the data and metadata.python).",
              file=sys.stderr)
        return 1
    args.out.write_bytes(data)
    args.yaml.write_text(PYTHON_LINE.sub(rf'\g<1>"{now}"', yaml_text), encoding="utf-8")
    print(f"wrote {args.out} ({n_docs} docs, {len(data)} bytes, Python {now})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
