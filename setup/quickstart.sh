#!/usr/bin/env bash
# Install (first time only), prepare the embedded corpus (first time only) and train the debug
# LLaMA on CPU. A second run resumes the same run directory, so it is quick once training is done.
# Ctrl-C saves a checkpoint at the next step and stops (a second Ctrl-C stops at once); either
# way this script still says where the run is and how to go on.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# Commands are printed with absolute paths and the environment's own python, so they work when
# pasted into a new shell anywhere (where `python` has no torch until .venv is activated).
q() { printf %q "$1"; }
again="bash $(q "$REPO/setup/quickstart.sh")"   # the command to run again, as it was given
[ -n "${DUMP_DIR:-}" ] && again="DUMP_DIR=$(q "$DUMP_DIR") $again"
for arg in "$@"; do again+=" $(q "$arg")"; done
DUMP_DIR="${DUMP_DIR:-runs/quickstart}"
status=0
# The trainer's own "to resume, run again: ..." line names this script's command, not its own.
LINGUA_RESUME_COMMAND="$again" python -m apps.llama.train config=debug dump_dir="$DUMP_DIR" "$@" || status=$?
case "$DUMP_DIR" in /*) RUN_DIR="$DUMP_DIR" ;; *) RUN_DIR="$REPO/$DUMP_DIR" ;; esac
newest="$(ls "$RUN_DIR/checkpoints" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -n 1 || true)"
echo
case "$status" in
  0)
    echo ">> run directory: $RUN_DIR"
    echo "   config.yaml (resolved config), metrics.jsonl (one line per logged step), checkpoints/"
    py="$(q "$REPO/.venv/bin/python")"
    echo "   generate: $py -m apps.llama.generate $(q "$RUN_DIR") --prompt 'def '"
    echo "   evaluate: $py -m apps.llama.eval $(q "$RUN_DIR") 'eval.tasks=[lingua_continuation]'"
    echo "   (or \`source $(q "$REPO/.venv/bin/activate")\` once in a shell, then plain \`python\`)" ;;
  3|130)   # stopped early by a signal (lingua.train.preemption.EXIT_STOPPED) or by Ctrl-C
    echo ">> stopped before the end: run directory $RUN_DIR, newest checkpoint:" \
         "$([ -n "$newest" ] && echo "$DUMP_DIR/checkpoints/$newest" || echo "none yet")"
    echo "   to go on from there, run the same command again: $again" ;;
  *)
    echo ">> the run failed (exit code $status; the message above says why)." \
         "Run directory: $RUN_DIR" ;;
esac
exit "$status"
