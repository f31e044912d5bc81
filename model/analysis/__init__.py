"""The model-side operations the service runs on a loaded model, each named and typed.

    operations.py        one frozen dataclass of arguments per operation (AttentionCall,
                         HeadScoresCall, LogitsCall, LensCall, ExplainHeadCall, FillMaskCall,
                         ClassifyCall, EmbedCall, WarmUpCall, PatchCall, LogitAttributionCall,
                         ScoreDecompositionCall), the registry name -> function and
                         `run_operation(model, call)`: only such plain data crosses to the
                         engine's process, never a closure
    attention_maps.py    /attention's maps of every group with their reductions (MapRequest),
                         made a block of query rows at a time and reduced at once
    head_atlas_scores.py /heads' scores of every group, and Clark et al.'s real-text probe
    head_scores.py       the head-score definitions (TransformerLens's detector and the rest)
    explain.py           /logits, /lens and /attention/explain: logits, the logit lens, one head
                         step by step
    vocab_rows.py        per-row top-k and rank over the vocabulary
    encoder_outputs.py   an encoder's fill-mask and classification scores, sentence embeddings,
                         its warm-up forward
    patching.py          activation patching of a decoder, TransformerLens's semantics, exact and
                         batched (heads, heads by position, residual, layers, paths)
    attribution_patching.py  its first-order estimates from one forward and one backward
    block_runs.py        a decoder's blocks run by hand from any block and position, with taps
    logit_attribution.py direct logit attribution through the frozen final norm
    encoder_decoder_runs.py, encoder_decoder_patching.py, encoder_decoder_paths.py,
    encoder_decoder_attribution.py, encoder_decoder_scores.py
                         the same for an encoder-decoder: its blocks run by hand with taps, exact
                         and attribution patching of its encoder, decoder and cross heads, path
                         patching between its groups, direct logit attribution along its decoder's
                         stream and a head's score decomposition (post-norm: every norm frozen)
    score_decomposition.py  one head's score split into pairs of query-side and key-side parts

Nothing here tokenises text or encodes an answer: the service does both (app/).
"""
