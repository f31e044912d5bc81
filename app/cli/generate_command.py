"""`attnlens generate`: stream a sample to the terminal as tokens come."""

from __future__ import annotations

import argparse
import codecs
import sys

import torch

from attnlens.model.checkpoint import load_checkpoint
from attnlens.model.decoding import SamplingParams, generate_tokens


def pick_device(pref: str) -> str:
    if pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return pref


def generate_to_terminal(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    ckpt = load_checkpoint(args.model, device=pick_device(args.device))
    ids = ckpt.tokenizer.encode_prompt(args.prompt)  # BOS first where the tokenizer says so (Llama, Mistral)
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= ckpt.config.context_length:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; the model's context is {ckpt.config.context_length}"
        )
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    # Bytes of one character can arrive in different tokens: decode incrementally.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out.write(args.prompt)
    out.flush()
    for token in generate_tokens(ckpt.model, ids, args.max_new_tokens, params):
        if token.id in ckpt.tokenizer.eos_ids:  # EOS, or another id that ends a generation (<|eot_id|>)
            break
        out.write(decoder.decode(ckpt.tokenizer.token_bytes(token.id)))
        out.flush()
    out.write(decoder.decode(b"", final=True) + "\n")
    out.flush()
    return 0
