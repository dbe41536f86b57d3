"""`python -m lingua.env`: what a new cluster offers, with no secret printed."""

import torch

from tests.conftest import run_python


def test_env_report_names_versions_and_distributed_variables_without_secrets(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "node-17")
    monkeypatch.setenv("WANDB_API_KEY", "sk-should-never-be-printed")
    out = run_python("lingua.env", []).stdout
    assert f"torch       {torch.__version__}" in out
    assert ("not available" in out) == (not torch.cuda.is_available())
    assert "RANK=3" in out and "MASTER_ADDR=node-17" in out
    assert "WANDB_API_KEY=(set)" in out and "sk-should-never-be-printed" not in out
    assert "slurm" in out and "infiniband" in out
