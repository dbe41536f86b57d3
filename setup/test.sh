#!/usr/bin/env bash
# Run the test suite in the project's environment. Extra arguments go to pytest (e.g. -k hf).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# The slurm-marked tests need a real Slurm: start the local one-node cluster where this user can
# (root: it installs Debian's packages if missing), saying so; LINGUA_NO_SLURM=1 leaves it alone.
# Where it cannot, those tests skip and say why.
as_root=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null; then as_root="sudo -n"; fi
if [ "${LINGUA_NO_SLURM:-0}" != "0" ]; then
  echo ">> LINGUA_NO_SLURM=$LINGUA_NO_SLURM: the local Slurm is not started, the slurm tests will skip"
elif ! python setup/slurm_wanted.py "$@"; then
  echo ">> -m selects no slurm test: the local Slurm is not started"
elif { [ "$(id -u)" -eq 0 ] || [ -n "$as_root" ]; } && { command -v apt-get >/dev/null || command -v slurmctld >/dev/null; }; then
  echo ">> starting a local one-node Slurm as root for the slurm tests (installs slurm and munge if missing; LINGUA_NO_SLURM=1 skips it and them)"
  $as_root bash setup/slurm_local.sh start
  export LINGUA_REQUIRE_SLURM=1
else
  echo ">> neither root nor passwordless sudo: the local Slurm is not started, the slurm tests will skip"
fi
# Two pytest-xdist workers (LINGUA_TEST_WORKERS=1 for one process): while one waits on Slurm
# jobs, sleeps or a subprocess, the other computes. Each file's tests stay on one worker
# (tests/conftest.py), and each worker's own torch gets its share of the cores.
workers="${LINGUA_TEST_WORKERS:-2}"
xdist=()
if [ "$workers" -gt 1 ]; then
  xdist=(-n "$workers" --dist loadfile)
  export OMP_NUM_THREADS=$(( $(nproc) / workers > 0 ? $(nproc) / workers : 1 ))
fi
set +e
# --durations=30: the slowest 30, what to trim when the suite nears CI's limit
python -m pytest "${xdist[@]}" --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests (exit 5): the suite or the selection is empty." >&2
  exit 1
fi
exit "$rc"
