"""Whether pytest's arguments (setup/test.sh's) can select a slurm-marked test, so that the quick
tier (-m "not slow") does not start the local Slurm. Exit 0: start it; 1: no slurm test selected.
Only -m is read: a -m expression this cannot evaluate, or none, starts Slurm as before."""

import collections
import itertools
import sys

# What a slurm test may be marked with besides slurm and slow (tests/conftest.py adds slow to
# it); none is marked gpu, so the GPU runbook (-m gpu) leaves Slurm alone too.
OTHER_MARKS = ("distributed",)


def wanted(argv: list) -> bool:
    expr = None
    for i, arg in enumerate(argv):   # the last -m wins, as in pytest
        if arg == "-m" and i + 1 < len(argv):
            expr = argv[i + 1]
        elif arg.startswith("-m") and len(arg) > 2:
            expr = arg[2:]
    if expr is None:
        return True
    for others in itertools.product((False, True), repeat=len(OTHER_MARKS)):
        marks = collections.defaultdict(bool, slurm=True, slow=True, **dict(zip(OTHER_MARKS,
                                                                                others)))
        try:   # pytest's marker expressions (and, or, not, parentheses) are Python's
            if eval(expr, {"__builtins__": {}}, marks):
                return True
        except Exception:
            return True
    return False


if __name__ == "__main__":
    sys.exit(0 if wanted(sys.argv[1:]) else 1)
