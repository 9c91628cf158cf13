"""A tiny Llama made on the spot (random weights, a word-level tokenizer): vLLM's CPU build can
serve it with no model hub. head_dim 32 (vLLM's CPU attention needs >= 32)."""
from __future__ import annotations

import os

WORDS = [f"w{i}" for i in range(250)]


def make_tiny_llama(path: str, *, seed: int = 0, layers: int = 2, hidden: int = 128,
                    heads: int = 4, kv_heads: int = 2, max_positions: int = 2048, init_range: float = 0.02) -> str:
    """Writes a model directory (config, safetensors weights, tokenizer) at `path` and returns
    it. The same seed gives the same weights; `init_range` is their standard deviation."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         torch_dtype="float32", initializer_range=init_range)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


def prompt(n_words: int, offset: int = 0) -> str:
    """A prompt of `n_words` tokens (plus BOS)."""
    return " ".join(WORDS[(offset + 7 * i) % len(WORDS)] for i in range(n_words))
