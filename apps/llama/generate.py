"""Generate text with a checkpoint (lingua/eval/generation.py is the command): `python -m
apps.llama.generate RUN_DIR_OR_CHECKPOINT --prompt "Once upon" [--max-new-tokens 64]`."""

from lingua.eval import generation
from lingua.models.llama.model import LlamaArgs, Transformer


def load_model(target: str, device: str = "cpu"):
    """(model, tokenizer) from a run directory (its newest checkpoint) or a checkpoint."""
    return generation.load_model(target, Transformer, LlamaArgs, device)


def main(argv=None) -> None:
    generation.main(argv, "python -m apps.llama.generate", Transformer, LlamaArgs)


if __name__ == "__main__":
    main()
