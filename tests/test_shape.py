"""The core's shape, read with ast: no file under lingua/ over 600 lines, no function under lingua/
or apps/ over 60 (decorators left out), the training loop one short function in a short module
(lingua/train/loop.py: what a researcher reads to understand a step), and a hook protocol of at
most ten points, each used by two hooks or named a seam of the core."""

import ast

from tests.conftest import REPO

MAX_FILE_LINES = 600
MAX_CORE_LINES, MAX_PACKAGE_LINES = 16_000, 2_500
MAX_FUNCTION_LINES = 60
LOOP_MODULE, LOOP_FUNCTION = "lingua/train/loop.py", "train_loop"
MAX_LOOP_LINES, MAX_LOOP_MODULE_LINES = 60, 400
MAX_HOOK_POINTS = 10
# Points one hook may be alone on: the core's own seams (lingua/hooks.py says so).
SEAMS = {"vote", "after_save", "should_stop", "state_dict"}


def functions(path):
    """(name, lines) of every function and method in the file (the def line to its end)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_core_file_is_long():
    long = {str(p.relative_to(REPO)): n for p in sorted((REPO / "lingua").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by concern): {long}"


def test_the_core_stays_under_its_ceilings():
    """lingua/ at most 16,000 lines, no subpackage over 2,500 (issue 54: a ceiling, not a goal)."""
    lines = {p: len(p.read_text().splitlines()) for p in (REPO / "lingua").rglob("*.py")}
    assert sum(lines.values()) <= MAX_CORE_LINES, sum(lines.values())
    packages = {}
    for path, n in lines.items():
        if path.parent != REPO / "lingua":
            top = path.relative_to(REPO / "lingua").parts[0]
            packages[top] = packages.get(top, 0) + n
    assert max(packages.values()) <= MAX_PACKAGE_LINES, packages


def test_no_function_is_long():
    long = [f"{p.relative_to(REPO)}:{name} ({n} lines)"
            for top in ("lingua", "apps") for p in sorted((REPO / top).rglob("*.py"))
            for name, n in functions(p) if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(long)


def test_the_training_loop_is_one_short_function():
    path = REPO / LOOP_MODULE
    assert len(path.read_text().splitlines()) <= MAX_LOOP_MODULE_LINES
    sizes = dict(functions(path))
    assert LOOP_FUNCTION in sizes, f"{LOOP_MODULE} has no {LOOP_FUNCTION}"
    assert sizes[LOOP_FUNCTION] <= MAX_LOOP_LINES, sizes[LOOP_FUNCTION]


def test_the_shape_rules_count_as_documented(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("@decorator\ndef f():\n    return 1\n\n\nclass C:\n    def g(self):\n"
                      "        pass\n")
    assert dict(functions(source)) == {"f": 2, "g": 2}


def hook_points(tops=("lingua", "apps")) -> dict:
    """{point: [classes defining it]} over the classes whose bases name Hook (Hooks, which calls
    them all, left out); every point of Hook listed (state_dict/load_state_dict is one)."""
    tree = ast.parse((REPO / "lingua/hooks.py").read_text())
    [hook] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Hook"]
    points = {n.name: [] for n in hook.body if isinstance(n, ast.FunctionDef)}
    points.pop("load_state_dict")
    for top in tops:
        for path in sorted((REPO / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name != "Hooks" and any(
                        getattr(b, "id", getattr(b, "attr", None)) == "Hook" for b in node.bases):
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef) and item.name in points:
                            points[item.name].append(node.name)
    return points


def test_the_hook_protocol_is_ten_points_each_used_twice_or_a_seam():
    points = hook_points()
    assert len(points) <= MAX_HOOK_POINTS, sorted(points)
    lonely = {p: users for p, users in points.items() if len(users) < 2 and p not in SEAMS}
    assert not lonely, f"hook points with fewer than two users (merge them): {lonely}"
    assert all(points[seam] for seam in SEAMS), points   # a seam nobody uses is a point to drop


def view_members() -> set:
    """The public members of lingua.train.loop.RunView: all a hook sees of the run."""
    from lingua.train.loop import RunView

    return set(RunView.MEMBERS) | {n for n, v in vars(RunView).items() if isinstance(v, property)}


def test_hooks_see_the_run_read_only_through_a_few_members():
    """Hooks decide and the loop acts (lingua/hooks.py): a hook's points read the run through
    RunView's members only and assign none of them; the view refuses an assignment."""
    from types import SimpleNamespace

    from lingua.train.loop import RunView

    members = view_members()
    assert len(members) <= 13, sorted(members)   # 13th: snapshot, a peer heals from it
    points = set(hook_points()) - {"state_dict"}   # every point that takes the view
    used, assigned, unknown = set(), [], []
    for top in ("lingua", "apps"):
        for path in sorted((REPO / top).rglob("*.py")):
            for cls in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(cls, ast.ClassDef) and cls.name != "Hooks" and any(
                        getattr(b, "id", getattr(b, "attr", None)) == "Hook" for b in cls.bases)):
                    continue
                for fn in cls.body:
                    if not (isinstance(fn, ast.FunctionDef) and len(fn.args.args) > 1):
                        continue
                    view = fn.args.args[1].arg   # the view, in every point that takes one
                    for node in ast.walk(fn):
                        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                                and node.value.id == view and fn.name in points | {"_made"}):
                            used.add(node.attr)
                            where = f"{path.relative_to(REPO)}:{node.lineno} {view}.{node.attr}"
                            if isinstance(node.ctx, ast.Store):
                                assigned.append(where)
                            elif node.attr not in members:
                                unknown.append(where)
    assert not assigned, f"hooks assign to the run (return a Request or a vote): {assigned}"
    assert not unknown, f"hooks read the run beyond RunView: {unknown}"
    assert used >= {"step", "parts", "tally", "decision", "rerun"}, used   # the scan sees them
    view = RunView(SimpleNamespace(step=3))
    assert view.step == 3
    try:
        view.step = 0
    except AttributeError as err:
        assert "hooks decide" in str(err)
    else:
        raise AssertionError("RunView let a hook move the run's step")


def test_only_the_loop_assigns_to_the_run():
    """No `run.X = ...` outside lingua/train/: a change to the run's state is a Run method."""
    found = []
    for top in ("lingua", "apps"):
        for path in sorted((REPO / top).rglob("*.py")):
            if path.is_relative_to(REPO / "lingua" / "train"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                           else [])
                found += [f"{path.relative_to(REPO)}:{node.lineno}" for t in targets
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                          and t.value.id in ("run", "view")]
    assert not found, f"assignments to the run outside lingua/train/: {found}"
