"""LLaMA: model.py (blocks in lingua's decoder shell), parallelize.py (TP plan), hf.py (HF I/O)."""
