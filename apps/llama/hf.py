"""`python -m apps.llama.hf export RUN_OR_CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32]`: LLaMA's
Hugging Face interop (key map, config.json, load_hf/save_hf) is lingua/models/llama/hf.py's."""

from lingua.models.llama.hf import export, export_problems, load_hf, main, save_hf  # noqa: F401

if __name__ == "__main__":
    main()
