"""Generate text with a checkpoint of this app (greedy, temperature, top-k, top-p):

    python -m apps.qwen3_next.generate RUN_DIR_OR_CHECKPOINT --prompt "Once upon" \
        [--max-new-tokens 64]

lingua/eval/generation.py is the command. Its KVCache holds keys and values for the
full-attention layers only; each Gated DeltaNet layer keeps its state in `cache.states[layer]`
instead: the short convolutions' last kernel - 1 inputs and the delta rule's state
[heads, dk, dv], a fixed size however long the text (apps/qwen3_next/model.py).
"""

from apps.qwen3_next.model import Qwen3NextArgs, Transformer
from lingua.eval import generation


def load_model(target: str, device: str = "cpu"):
    """(model, tokenizer) from a run directory (its newest checkpoint) or a checkpoint."""
    return generation.load_model(target, Transformer, Qwen3NextArgs, device)


def main(argv=None) -> None:
    generation.main(argv, "python -m apps.qwen3_next.generate", Transformer, Qwen3NextArgs)


if __name__ == "__main__":
    main()
