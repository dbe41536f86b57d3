#!/usr/bin/env bash
# Run the test suite in the project's environment. Extra arguments go to pytest (e.g. -k hf).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests (exit 5): the suite or the selection is empty." >&2
  exit 1
fi
exit "$rc"
