"""Corpora and the samples built from them: the Shakespeare corpus (shakespeare.py), the First
Folio genres (genres.py), encoder passages (passages.py), masked-LM masking (mlm.py) and the
generated translation pairs (translation.py)."""
