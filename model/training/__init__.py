"""Training: the shared loop and run config (train.py, also the decoder objective) and the
encoder (encoder.py) and translator (translation.py) objectives."""
