"""Small random transformers checkpoints of every architecture import-hf reads, built offline.

Each case is a transformers config (a few layers; GQA where the architecture has it; rotary
positions, full or partial, with and without scaling; tied and untied heads) and a tokenizer
built here with the `tokenizers` library in the layout of the real model's tokenizer.json:
byte-level BPE (Llama 3, Qwen2, Qwen3, Pythia) or SentencePiece-style BPE with byte fallback
(Llama 2, TinyLlama, Mistral). Nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from helpers import TINY_TEXT
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2_CHAT = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
               "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
               "{% endif %}{% endfor %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

CORPUS = [TINY_TEXT, "The quick brown fox jumps over the lazy dog.\n", "  two spaces, a\ttab and\r\nCRLF lines\n"] * 6
# texts a tokenizer must round-trip: "Ω" and "ж" never occur in CORPUS (byte fallback, byte-level fragments)
ROUND_TRIP = ["To be, or not to be", "Café naïve 東京 😀🎭\r\n\ttabs", "  leading spaces\n\nand Ω ж", " x", "a  b   c"]


# the split before byte-level BPE: Llama 3's (shortened) and Qwen2's (transformers' PRETOKENIZE_REGEX)
LLAMA3_SPLIT = r" ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+"
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def byte_level_tokenizer(special: list[str], *, bos: str | None = None, split: str | None = LLAMA3_SPLIT,
                         nfc: bool = False, vocab_size: int = 360) -> HFTokenizer:
    """Byte-level BPE as Llama 3's, Qwen2's and Pythia's tokenizer.json are: a Split of the text
    (Pythia: ByteLevel's own GPT-2 split), ByteLevel bytes, the ByteLevel decoder, NFC first for
    Qwen2 and Pythia; with `bos`, a post-processor that puts it first (Llama 3's TemplateProcessing)."""
    tok = HFTokenizer(models.BPE())
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    post = [processors.ByteLevel(trim_offsets=False)]
    if bos is not None:
        post.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                  special_tokens=[(bos, tok.token_to_id(bos))]))
    tok.post_processor = processors.Sequence(post)
    return tok


def sentencepiece_tokenizer(*, vocab_size: int = 360) -> HFTokenizer:
    """SentencePiece-style BPE as Llama 2's, TinyLlama's and Mistral's tokenizer.json are: <unk>
    <s> </s>, the 256 byte pieces <0x00>..<0xFF>, then the merged pieces; spaces are "▁" (the
    normaliser prepends one and replaces the others), unknown characters fall back to bytes,
    the decoder undoes both and strips the prepended space; <s> goes first."""
    trained = HFTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trained.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(vocab_size=vocab_size - 259, show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


@dataclass
class Case:
    """One architecture to build: its transformers classes and config, and its tokenizer."""

    name: str
    config_class: str
    model_class: str
    config: dict
    tokenizer: str  # "byte_level" | "sentencepiece"
    special: list[str] = field(default_factory=list)
    tokenizer_config: dict = field(default_factory=dict)
    generation_eos: list[str] = field(default_factory=list)  # generation_config.json eos_token_id, by name


COMMON = dict(num_hidden_layers=2, max_position_embeddings=64)
CASES = {
    # Llama 3: GQA (4 query heads, 2 key/value heads), an untied head, llama3 rope scaling that bites
    # (original context 16 < 64), byte-level BPE with <|begin_of_text|> first, <|eot_id|> ending a turn
    "llama3": Case("llama3", "LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        tie_word_embeddings=False, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 16}),
                   "byte_level", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                  "<|end_header_id|>", "<|eot_id|>"],
                   {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": LLAMA3_CHAT},
                   ["<|end_of_text|>", "<|eot_id|>"]),
    # Llama 2 / TinyLlama: multi-head, a tied head (as SmolLM), linear rope scaling, attention and
    # MLP biases (attention_bias, mlp_bias), SentencePiece-style tokens with byte fallback
    "llama2": Case("llama2", "LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, tie_word_embeddings=True,
                        attention_bias=True, mlp_bias=True,
                        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
                   "sentencepiece", [],
                   {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                    "chat_template": LLAMA2_CHAT}),
    # Qwen2: multi-query (1 key/value head), q/k/v biased and o_proj not, a tied head, ChatML
    "qwen2": Case("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
                  dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
                       tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  "byte_level", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML},
                  ["<|im_end|>", "<|endoftext|>"]),
    # Mistral: GQA, head_dim 16 with hidden 32 / 4 heads (q/k/v wider than the residual), a sliding
    # window of 8 positions (much shorter than the sequences the tests run), an untied head
    "mistral": Case("mistral", "MistralConfig", "MistralForCausalLM",
                    dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, sliding_window=8, tie_word_embeddings=False),
                    "sentencepiece", [],
                    {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                     "chat_template": LLAMA2_CHAT}),
    # Qwen3: an RMSNorm per head on queries and keys (q_norm, k_norm), GQA, head_dim 32 given
    # explicitly with hidden 64 / 4 heads (q/k/v wider than the residual), no biases, an untied
    # head, the Qwen2 tokenizer and ChatML
    "qwen3": Case("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
                  dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  "byte_level", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML},
                  ["<|im_end|>", "<|endoftext|>"]),
    # Pythia: a quarter of each head rotary (16 dims, 4 rotated), LayerNorm, the parallel residual,
    # an untied embed_out, exact GELU, biases everywhere
    "pythia": Case("pythia", "GPTNeoXConfig", "GPTNeoXForCausalLM",
                   dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, rotary_pct=0.25,
                        rotary_emb_base=10000, use_parallel_residual=True, tie_word_embeddings=False),
                   "byte_level", ["<|endoftext|>"],
                   {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}),
}
ARCH_NAMES = list(CASES)

GEMMA_CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + (message['role'] | replace('assistant', "
              "'model')) + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
GEMMA_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                "chat_template": GEMMA_CHAT}

# The architectures of issue 47 (tests/model/test_hf_archs_more.py), each with its special paths made to
# bite: windows of 8 shorter than the prompts, soft-caps small enough to cap, ...
MORE_CASES = {
    # Gemma 2: sliding (8) and full layers alternating, both soft-caps small (the weights perturbed
    # make scores and logits far above them), query_pre_attn_scalar 24 (not head_dim 16), GQA,
    # head_dim 16 with hidden 48 / 4 heads, pre- and post-norms, GeGLU, a tied head
    "gemma2": Case("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
                   dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0,
                        final_logit_softcapping=3.0, num_hidden_layers=3, tie_word_embeddings=True),
                   "sentencepiece", [], GEMMA_TOKENS),
    # Gemma 3 text: a per-head q/k norm, three sliding layers (window 8) to one full, the sliding
    # layers' own rotary base (10000) beside the full layers' linearly scaled one (1e6, factor 4),
    # no soft-caps, an untied head
    "gemma3": Case("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
                   dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=4,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}}),
                   "sentencepiece", [], GEMMA_TOKENS),
    # Phi-3: fused qkv_proj and gate_up_proj, half of each head rotary (partial_rotary_factor 0.5, as
    # Phi-4 mini's 0.75), a sliding window of 8 on every layer, GQA, an untied head
    "phi3": Case("phi3", "Phi3Config", "Phi3ForCausalLM",
                 dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      sliding_window=8, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
                 "sentencepiece", [], {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                       "add_bos_token": True, "chat_template": LLAMA2_CHAT}),
    # OLMo 2: norms after each sub-layer only, one RMSNorm over all heads' queries (and keys), GQA,
    # an untied head, no chat template
    "olmo2": Case("olmo2", "Olmo2Config", "Olmo2ForCausalLM",
                  dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
                  "byte_level", ["<|endoftext|>", "<|pad|>"], {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}),
    # Granite: its four multipliers away from 1 (embeddings x 6, sub-layer outputs x 0.5, scores x
    # 0.3 instead of 1/sqrt(16), logits / 4), attention and MLP biases, GQA, a tied head, ChatML
    "granite": Case("granite", "GraniteConfig", "GraniteForCausalLM",
                    dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, attention_bias=True, mlp_bias=True, embedding_multiplier=6.0,
                         residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0),
                    "byte_level", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}),
    # StableLM 2: a quarter of each head rotary, LayerNorm with biases, q/k/v biases, GQA
    "stablelm": Case("stablelm", "StableLmConfig", "StableLmForCausalLM",
                     dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          use_qkv_bias=True, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
                     "byte_level", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                     {"eos_token": "<|endoftext|>", "chat_template": CHATML}),
    # StableLM 2 12B's parts: the parallel residual with one norm, a LayerNorm per head on q and k
    "stablelm_parallel": Case("stablelm_parallel", "StableLmConfig", "StableLmForCausalLM",
                              dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   use_parallel_residual=True, qk_layernorm=True, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25}),
                              "byte_level", ["<|endoftext|>"], {"eos_token": "<|endoftext|>"}),
    # GPT-J: interleaved rotary pairs on 8 of each head's 16 dims, the parallel residual with one
    # LayerNorm, a plain MLP with tanh GELU, a head with a bias
    "gptj": Case("gptj", "GPTJConfig", "GPTJForCausalLM",
                 dict(n_embd=64, n_inner=128, n_head=4, n_layer=2, n_positions=64, rotary_dim=8,
                      tie_word_embeddings=False),
                 "byte_level", ["<|endoftext|>"], {"eos_token": "<|endoftext|>"}),
    # Mixtral: 4 experts, 2 a token, a sliding window of 8, GQA, an untied head
    "mixtral": Case("mixtral", "MixtralConfig", "MixtralForCausalLM",
                    dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=4, num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False),
                    "sentencepiece", [], {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                          "add_bos_token": True, "chat_template": LLAMA2_CHAT}),
}


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Weights away from transformers' small init: norms around 1, biases and matrices large
    enough that attention is sharp and heads differ, so no mapping mistake can hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def build_tokenizer(case: Case) -> HFTokenizer:
    if case.tokenizer == "sentencepiece":
        return sentencepiece_tokenizer()
    if case.name in ("qwen2", "qwen3"):
        return byte_level_tokenizer(case.special, split=QWEN2_SPLIT, nfc=True)
    if case.name == "pythia":
        return byte_level_tokenizer(case.special, split=None, nfc=True)
    return byte_level_tokenizer(case.special, bos=case.tokenizer_config.get("bos_token"))


def write_hf_checkpoint(case: Case, root: Path, *, seed: int = 0):
    """A transformers directory as save_pretrained writes one (config.json, model.safetensors)
    with tokenizer.json, tokenizer_config.json and generation_config.json; returns (dir, model)."""
    import transformers

    tok = build_tokenizer(case)
    ids = {t: tok.token_to_id(t) for t in ("<s>", "</s>", *case.special) if tok.token_to_id(t) is not None}
    bos, eos = case.tokenizer_config.get("bos_token"), case.tokenizer_config["eos_token"]
    config = getattr(transformers, case.config_class)(
        vocab_size=tok.get_vocab_size(), **{**COMMON, **case.config},
        bos_token_id=ids.get(bos), eos_token_id=ids[eos], pad_token_id=None)
    torch.manual_seed(seed)
    model = getattr(transformers, case.model_class)(config).eval()
    perturb_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64, "clean_up_tokenization_spaces": False,
         **case.tokenizer_config}, indent=2))
    if case.generation_eos:
        generation = json.loads((root / "generation_config.json").read_text()) \
            if (root / "generation_config.json").is_file() else {}
        generation["eos_token_id"] = [ids[t] for t in case.generation_eos]
        (root / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return root, model


def load_hf(path: Path, case: Case):
    """The saved directory loaded back by transformers, eager attention (maps returned)."""
    import transformers

    cls = getattr(transformers, case.model_class)
    return cls.from_pretrained(path, attn_implementation="eager").eval()


def ids_for(ckpt, n_rows: int, n: int, seed: int = 0) -> torch.Tensor:
    """(n_rows, n) random token ids of the checkpoint's vocabulary, seeded."""
    return torch.randint(0, ckpt.config.vocab_size, (n_rows, n), generator=torch.Generator().manual_seed(seed))


def assert_batched_rows_equal_each_alone(ckpt, steps: int) -> dict:
    """Right-padded prompts of 3, 17 and 9 tokens prefilled together, then `steps` batched decode
    steps (row 2 streaming its attention): each row's tokens, log-probabilities and attention rows
    equal that row decoded alone. Returns the batched run's tokens by row."""
    import pytest

    from attnlens.model.decoding import RowSampler, SamplingParams, decode_step

    model = ckpt.model
    prompts = [ids_for(ckpt, 1, n, seed=n)[0].tolist() for n in (3, 17, 9)]

    def run(rows: list[int]):
        cache = model.new_kv_cache(len(rows))
        samplers = [RowSampler(SamplingParams(temperature=0), return_attention=(r == 2)) for r in rows]
        width = max(len(prompts[r]) for r in rows)
        padded = torch.tensor([prompts[r] + [0] * (width - len(prompts[r])) for r in rows])
        out: dict = {r: [] for r in rows}
        with torch.no_grad():
            step = decode_step(model, cache, padded, samplers, n_new=[len(prompts[r]) for r in rows])
            for _ in range(steps):
                for r, t in zip(rows, step.tokens):
                    out[r].append(t)
                step = decode_step(model, cache, torch.tensor([[t.id] for t in step.tokens]), samplers)
        return out

    together = run([0, 1, 2])
    for r in range(3):
        alone = run([r])[r]
        assert [t.id for t in together[r]] == [t.id for t in alone]
        for a, b in zip(together[r], alone):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            for x, y in zip(a.attention or [], b.attention or []):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    return together
