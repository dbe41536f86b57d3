"""LLaMA: model.py (its blocks in lingua's decoder shell), parallelize.py (its tensor-parallel
plan), hf.py (its Hugging Face names, config.json, import and export)."""
