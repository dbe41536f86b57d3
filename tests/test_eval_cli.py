"""The eval entry point's checks before any work (lingua/eval/eval_cli.py through
apps/llama/eval.py), in process: the quick tier's view of what tests/test_downstream.py runs as
commands. A checkpoint directory here is only its config.yaml, as checkpoint.save writes it."""

import importlib

import pytest

from apps.llama import eval as llama_eval
from apps.llama.train import TrainArgs
from lingua import config
from lingua.errors import ConfigError
from lingua.eval import eval_cli


@pytest.fixture
def ckpt(tmp_path):
    args = TrainArgs()
    args.model.dim, args.eval.tasks = 48, []
    step_dir = tmp_path / "run" / "checkpoints" / "4"
    step_dir.mkdir(parents=True)
    (step_dir / "config.yaml").write_text(config.to_yaml(args))
    return step_dir


@pytest.mark.parametrize("app", ["llama", "moe", "mtp", "deepseek"])
def test_no_argument_prints_the_usage_and_fails(app, capsys):
    app_eval = importlib.import_module(f"apps.{app}.eval")
    assert app_eval.main([]) == 2
    assert "eval.tasks=" in capsys.readouterr().out
    assert app_eval.main(["--help"]) == 0


def test_overrides_change_evaluation_keys_only(ckpt):
    args = eval_cli.run_config(TrainArgs, ckpt, ["eval.tasks=[lingua_continuation]",
                                                 "distributed.dp_shard=2"])
    assert args.eval.tasks == ["lingua_continuation"] and args.distributed.dp_shard == 2
    assert args.model.dim == 48   # the checkpoint's model, not the schema's default
    with pytest.raises(ConfigError, match=r"`model.dim=64`: an evaluation takes key=value "
                                          r"overrides of eval\.\*"):
        eval_cli.run_config(TrainArgs, ckpt, ["model.dim=64"])
    with pytest.raises(ConfigError, match=r"Bad override .*config\.yaml"):
        eval_cli.run_config(TrainArgs, ckpt, ["eval.no_such_key=1"])


def test_a_run_without_tasks_is_refused_before_any_work(ckpt):
    with pytest.raises(ConfigError, match=r"no task to evaluate"):
        llama_eval.main([str(ckpt)])
    assert not (ckpt.parent.parent / "evals").exists()


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError):
        llama_eval.main([str(tmp_path / "nothing_here")])
