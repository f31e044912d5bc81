"""The model-side operations the service runs on a loaded model, each named and typed.

    operations.py        one frozen dataclass of arguments per operation (AttentionCall,
                         HeadScoresCall, LogitsCall, LensCall, ExplainHeadCall, FillMaskCall,
                         ClassifyCall, EmbedCall, WarmUpCall), the registry name -> function and
                         `run_operation(model, call)`: only such plain data crosses to the
                         engine's process, never a closure
    attention_maps.py    /attention's maps of every group with their reductions (MapRequest)
    attention_blocks.py  those maps made a block of query rows at a time and reduced at once
    head_atlas_scores.py /heads' scores of every group, and Clark et al.'s real-text probe
    head_scores.py       the head-score definitions (TransformerLens's detector and the rest)
    explain.py           /logits, /lens and /attention/explain: logits, the logit lens, one head
                         step by step
    vocab_rows.py        per-row top-k and rank over the vocabulary
    encoder_outputs.py   an encoder's fill-mask and classification scores, sentence embeddings,
                         its warm-up forward

Nothing here tokenises text or encodes an answer: the service does both (app/).
"""
