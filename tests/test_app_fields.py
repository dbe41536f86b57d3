"""No app's config field is named in lingua/ (issue 54, "One typed App"): everything the core, the
planner and the tools need from an app comes through its `App` (lingua/train/app.py). The names
are derived from the apps' model dataclasses minus the decoder shell's (TransformerArgs), so a new
app field is covered without editing this file."""

import ast
import dataclasses
import importlib
import sys
import types
from pathlib import Path

import pytest

from lingua.errors import ConfigError
from lingua.model.layers import TransformerArgs
from lingua.train.app import App, load_app
from tests.conftest import REPO

ALLOWED_RECEIVERS = {"self", "ctx"}   # an object's own attribute, autograd's context


def app_train_modules() -> list:
    return sorted(f"apps.{p.parent.name}.train" for p in (REPO / "apps").glob("*/train.py"))


def core_dataclass_fields() -> set:
    """The field names of every dataclass lingua/ defines (AttentionMask.window, SpikeArgs.window,
    ...): the core's own words, which an app may reuse for its own field."""
    names = set()
    for path in (REPO / "lingua").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    "dataclass" in ast.unparse(d) for d in node.decorator_list):
                names |= {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)
                          and isinstance(item.target, ast.Name)}
    return names


def app_only_fields() -> set:
    """Fields of every app's model args (TrainArgs.model) that neither the shared shell nor any
    other core dataclass has."""
    shell = {f.name for f in dataclasses.fields(TransformerArgs)} | core_dataclass_fields()
    names = set()
    for module in app_train_modules():
        train_args = importlib.import_module(module).TrainArgs
        model = next(f for f in dataclasses.fields(train_args) if f.name == "model")
        names |= {f.name for f in dataclasses.fields(model.default_factory())} - shell
    return names


def named_fields(path: Path, names: set) -> list:
    """'file:line name' for each place that reads one of `names` off an object other than its own
    (`args.model.n_experts`, `part.args.top_k`) or by string (`getattr(a, "n_experts")`). The
    core's own: an object's attribute on itself (`self.top_k`), and in the file that defines it
    (a class setting self.top_k, a CLI option --top-k) the same name on an object that is not a
    config (`m.top_k`, `self.router.score_func`, `ns.top_k`; not `args.X` or `a.model.X`)."""
    source = path.read_text()
    tree = ast.parse(source)
    own = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
           and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
           and node.value.id == "self"}
    own |= {name for name in names if f'"--{name.replace("_", "-")}"' in source}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            receiver = ast.unparse(node.value)
            config = "arg" in receiver or receiver.endswith("model")
            if receiver not in ALLOWED_RECEIVERS and (node.attr not in own or config):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in names:
            found.append((node.lineno, node.value))
    return [f"{path.relative_to(REPO)}:{line} {name}" for line, name in sorted(found)]


def test_the_apps_have_fields_of_their_own():
    # The check below is empty-handed if the derivation finds nothing.
    assert {"n_experts", "bias_update_rate", "dense_hidden_dim", "mtp_depth",
            "q_lora_rank"} <= app_only_fields()


def test_no_app_field_is_named_in_lingua():
    names = app_only_fields()
    found = [hit for path in sorted((REPO / "lingua").rglob("*.py"))
             for hit in named_fields(path, names)]
    assert not found, ("lingua/ names an app's config field; give the core what it needs through "
                       "the App (lingua/train/app.py) instead:\n" + "\n".join(found))


def test_the_check_finds_what_the_core_used_to_read(tmp_path, monkeypatch):
    """The readings issue 54 removed (plan_activations, RoutingHook), planted in a file."""
    import tests.test_app_fields as this

    names = app_only_fields()
    monkeypatch.setattr(this, "REPO", tmp_path)
    path = tmp_path / "planted.py"
    path.write_text("class Hook:\n    def __init__(self, rate):\n        self.top_k = rate\n\n"
                    "def f(run, a, m, args):\n    rate = run.parts[0].args.bias_update_rate\n"
                    "    return getattr(a, 'dense_hidden_dim', 0), m.top_k, self.n_experts\n\n"
                    "def g(args, a):\n    return args.top_k, a.model.n_experts\n")
    assert named_fields(path, names) == [
        "planted.py:6 bias_update_rate", "planted.py:7 dense_hidden_dim",
        "planted.py:10 n_experts", "planted.py:10 top_k"]


def test_load_app_finds_the_app_or_says_what_is_missing(monkeypatch):
    for module in app_train_modules():
        app = load_app(module)
        assert isinstance(app, App) and app.load_config is importlib.import_module(
            module).load_config
    fork = types.ModuleType("myfork_train")   # a train module that forgot its APP
    fork.load_config, fork.main = (lambda argv=None, check=True: None), (lambda argv=None: 0)
    monkeypatch.setitem(sys.modules, "myfork_train", fork)
    with pytest.raises(ConfigError, match="myfork_train has no APP"):
        load_app("myfork_train")
