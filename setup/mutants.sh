#!/usr/bin/env bash
# Planted bugs, one at a time, in a temporary copy of the tree; the tests that must catch each
# (setup/mutants.py says how). Run before and after any change that trims or moves tests.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python setup/mutants.py "$@"
