"""Hugging Face interop: export/import of our checkpoints as GPT-2 (hf.py) and BERT (hf_bert.py)."""
