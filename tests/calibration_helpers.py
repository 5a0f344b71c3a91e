"""Tiny random decoder models built from a config (no download) for the calibration tests."""
from __future__ import annotations

import torch


def tiny_model(family: str = "qwen3", num_layers: int = 2, q_heads: int = 4, kv_heads: int = 2,
               head_dim: int = 32, vocab: int = 64, seed: int = 0, dtype=torch.float32):
    """A tiny random Qwen3 / Qwen2 / Llama / Mistral causal LM (eval mode, SDPA attention)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}
    cfg_cls, model_cls = classes[family]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=q_heads * head_dim, intermediate_size=2 * q_heads * head_dim,
                  num_hidden_layers=num_layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, max_position_embeddings=512, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    model.config.architectures = [model_cls.__name__]
    return model


def save_tiny_model_dir(path, family: str = "qwen3", **kw) -> str:
    """A complete local HF model folder (config, weights, byte-level BPE tokenizer of 300
    tokens trained in-process on a few stdlib lines), for CLI tests without downloads."""
    import inspect

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([inspect.getsource(inspect)[:20000]], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    model = tiny_model(family, vocab=fast.vocab_size, **kw)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)
