#!/usr/bin/env bash
# Here, where a package index is reachable: fill .whl/ with every wheel the lent GPU machine's
# image lacks for the GPU tier, and 02984d0's tree; there, `bash setup/gpu_check.sh` uses them.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python setup/gpu_wheels.py "$@"
