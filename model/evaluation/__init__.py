"""Evaluation reports for trained checkpoints: encoder.py (masked-LM and genre metrics),
translation.py (exact match on every held-out pair) and info.py (what a checkpoint holds)."""
