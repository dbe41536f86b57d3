"""Generate text with a checkpoint of this app (greedy, temperature, top-k, top-p):

    python -m apps.deepseek.generate RUN_DIR_OR_CHECKPOINT --prompt "Once upon" \
        [--max-new-tokens 64]

lingua/eval/generation.py is the command. Its KV cache holds, per MLA layer, the normalised kv
latent and the rope key (kv_lora_rank + qk_rope_head_dim numbers per token, not 2 x n_heads x
head_dim): apps/deepseek/model.py's MLA caches those and decompresses them at every step.
"""

from apps.deepseek.model import DeepSeekArgs, Transformer
from lingua.eval import generation


def load_model(target: str, device: str = "cpu"):
    """(model, tokenizer) from a run directory (its newest checkpoint) or a checkpoint."""
    return generation.load_model(target, Transformer, DeepSeekArgs, device)


def main(argv=None) -> None:
    generation.main(argv, "python -m apps.deepseek.generate", Transformer, DeepSeekArgs)


if __name__ == "__main__":
    main()
