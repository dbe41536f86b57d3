#!/usr/bin/env bash
# Install (first time only), prepare the embedded corpus (first time only) and train the debug
# LLaMA on CPU. A second run resumes the same run directory, so it is quick once training is done.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
DUMP_DIR="${DUMP_DIR:-runs/quickstart}"
python -m apps.llama.train config=debug dump_dir="$DUMP_DIR" "$@"
echo
echo ">> run directory: $REPO/$DUMP_DIR"
echo "   config.yaml (resolved config), metrics.jsonl (one line per logged step), checkpoints/"
echo "   generate: python -m apps.llama.generate $DUMP_DIR/checkpoints/<step> --prompt 'def '"
echo "   evaluate: python -m apps.llama.eval $DUMP_DIR 'eval.tasks=[lingua_continuation]'"
