#!/usr/bin/env bash
# On the lent GPU machine (one command, under 9 minutes): install what .whl/ holds and the image
# lacks, run every gpu test and the runbook's benchmarks, write one JSON summary
# ($OUT/gpu_check.json). From here: the device tool's run with carry [".whl"] and the command
# `bash setup/gpu_check.sh`. setup/gpu_check.py says what each step does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python3 setup/gpu_check.py "$@"
