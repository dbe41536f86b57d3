"""The tree stays clean under the ruff rules in pyproject.toml ([tool.ruff])."""

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: it is pinned in the dev extras (pip install -e '.[dev]')"
    proc = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"
