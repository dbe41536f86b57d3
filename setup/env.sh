# Sourced by quickstart.sh and test.sh: make .venv (if missing) and install the project into it.
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PYTHON="$candidate"; break; fi
  done
fi
if [ -z "$PYTHON" ] || ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "error: Python 3.10 or newer is needed (found: ${PYTHON:-none}). Install it, or set PYTHON=/path/to/python3." >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo ">> creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.lingua-installed-$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo ">> installing the project and its pinned dependencies into .venv (a minute or two)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
  rm -f .venv/.lingua-installed-*
  touch "$stamp"
fi
export PATH="$REPO/.venv/bin:$PATH"
# One process per core is what the tests and quickstart assume; more threads only thrash.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
export WANDB_MODE="${WANDB_MODE:-offline}"
