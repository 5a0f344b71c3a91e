"""The architectures oscar-calibrate is tested on, as random-weight models built from a config.

Each :class:`Architecture` row holds the *real* attention geometry of one public model
(query / KV heads, head_dim, RoPE parameters, q/k/v biases, tied embeddings, MoE routing) and
cuts only what attention does not see: layers (2), MLP / expert widths, expert count and the
vocabulary (the in-process tokenizer's).

:data:`ARCHITECTURES`: every layer full attention (what the server serves today).
:data:`LAYER_PATTERN_ARCHITECTURES`: models whose full-attention layers are a subset, in the
public model's own order (Qwen3-Next: linear attention, one full layer in four; gpt-oss:
alternating sliding (128) / full; Gemma-3: 5 sliding : 1 full); each row sets its own layer
count so that both kinds appear, and states its full-attention layers
(``full_attention_layers``), which only get the INT2 cache and rotations.
:data:`ALL_ARCHITECTURES` is both; :func:`get` finds any row by name. :func:`build_model_dir` turns a row into a local HF
model folder (config.json, seeded random safetensors weights, tokenizer) that
``oscar-calibrate --model`` reads and that SGLang 0.5.17 can serve with ``--load-format dummy``
(every ``architecture`` below is an SGLang 0.5.17 EntryClass). Nothing is ever downloaded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

LAYERS = 2
BIAS_STD = 0.5  # HF initialises biases to zero; q/k/v biases are drawn so that their path is exercised
TOKENIZER_VOCAB = 1024
# stdlib modules whose source trains the tokenizer: fixed text, so the same Python builds the same vocab
TOKENIZER_TEXT_MODULES = ("inspect", "argparse", "typing", "dataclasses", "pathlib")
SPECIAL_TOKENS = ("<|endoftext|>",)


@dataclass(frozen=True)
class Architecture:
    """One row: ``config`` goes to ``AutoConfig.for_model(model_type, **config)``."""

    name: str  # short id used in file names and results
    family: str  # what a user would call it
    source: str  # the public model whose attention geometry the row copies
    model_type: str  # transformers' model_type
    architecture: str  # config.architectures[0]: transformers class and SGLang 0.5.17 EntryClass
    config: dict
    features: tuple[str, ...] = ()  # what this row exercises beyond plain GQA
    notes: str = ""  # where the config departs from the source model, and why
    # the model layers that are full attention (None: every layer), as the row's layer pattern gives them
    full_attention_layers: tuple[int, ...] | None = None

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.config["hidden_size"] // self.config["num_attention_heads"])

    @property
    def geometry(self) -> dict:
        c = self.config
        q, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        return {"num_q_heads": q, "num_kv_heads": kv, "q_per_kv": q // kv, "head_dim": self.head_dim,
                "hidden_size": c["hidden_size"], "num_layers": c["num_hidden_layers"]}


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "llama-3.1-8b", "Llama-3", "meta-llama/Llama-3.1-8B", "llama", "LlamaForCausalLM",
        dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             rope_parameters=_llama3_rope(8.0), max_position_embeddings=131072, rms_norm_eps=1e-5,
             tie_word_embeddings=False, intermediate_size=512, num_hidden_layers=LAYERS),
        features=("rope_type llama3",)),
    Architecture(
        "llama-3.2-1b", "Llama-3.2", "meta-llama/Llama-3.2-1B", "llama", "LlamaForCausalLM",
        dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             rope_parameters=_llama3_rope(32.0), max_position_embeddings=131072, rms_norm_eps=1e-5,
             tie_word_embeddings=True, intermediate_size=512, num_hidden_layers=LAYERS),
        features=("head_dim 64", "tied embeddings", "rope_type llama3"),
        notes="the 1B, not the 3B: Llama-3.2-3B has head_dim 128 (3072 / 24), the 1B has 64"),
    Architecture(
        "mistral-7b-v0.3", "Mistral", "mistralai/Mistral-7B-v0.3", "mistral", "MistralForCausalLM",
        dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, sliding_window=None,
             max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
             intermediate_size=512, num_hidden_layers=LAYERS),
        notes="v0.3 has no sliding window (v0.1's 4096 window would be a hybrid the server refuses)"),
    Architecture(
        "qwen2.5-7b", "Qwen2.5", "Qwen/Qwen2.5-7B", "qwen2", "Qwen2ForCausalLM",
        dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
             sliding_window=None, max_position_embeddings=32768, rms_norm_eps=1e-6,
             tie_word_embeddings=False, intermediate_size=512, num_hidden_layers=LAYERS),
        features=("q/k/v bias", "7 query heads per KV head")),
    Architecture(
        "qwen3-14b", "Qwen3", "Qwen/Qwen3-14B", "qwen3", "Qwen3ForCausalLM",
        dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
             sliding_window=None, max_position_embeddings=40960, rms_norm_eps=1e-6,
             tie_word_embeddings=False, intermediate_size=512, num_hidden_layers=LAYERS),
        features=("qk-norm", "5 query heads per KV head")),
    Architecture(
        "qwen3-30b-a3b", "Qwen3-MoE", "Qwen/Qwen3-30B-A3B", "qwen3_moe", "Qwen3MoeForCausalLM",
        dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
             sliding_window=None, max_position_embeddings=40960, rms_norm_eps=1e-6,
             tie_word_embeddings=False, num_experts=16, num_experts_per_tok=8, moe_intermediate_size=64,
             intermediate_size=256, decoder_sparse_step=1, norm_topk_prob=True, num_hidden_layers=LAYERS),
        features=("qk-norm", "MoE (top-8 routing)"),
        notes="16 experts of width 64 (the model has 128 of width 768): attention is unchanged"),
    Architecture(
        "phi-3-mini-4k", "Phi-3", "microsoft/Phi-3-mini-4k-instruct", "phi3", "Phi3ForCausalLM",
        dict(hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
             max_position_embeddings=4096, original_max_position_embeddings=4096, sliding_window=None,
             rms_norm_eps=1e-5, tie_word_embeddings=False, intermediate_size=512, num_hidden_layers=LAYERS),
        features=("fused qkv_proj", "head_dim 96", "MHA"),
        notes="sliding_window None: the published config says 2047, but SGLang 0.5.17 serves Phi3ForCausalLM "
              "as Llama, with full attention, so calibration does the same"),
    Architecture(
        "glm-4-9b-0414", "GLM-4", "THUDM/GLM-4-9B-0414", "glm4", "Glm4ForCausalLM",
        dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
             partial_rotary_factor=0.5, attention_bias=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
             max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
             intermediate_size=512, num_hidden_layers=LAYERS),
        features=("partial rotary 0.5", "q/k/v bias", "16 query heads per KV head")),
    Architecture(
        "glm-4.7", "GLM-4.7", "zai-org/GLM-4.7", "glm4_moe", "Glm4MoeForCausalLM",
        dict(hidden_size=5120, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
             partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
             max_position_embeddings=202752, rms_norm_eps=1e-5, tie_word_embeddings=False,
             n_routed_experts=16, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=64,
             first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
             intermediate_size=256, num_hidden_layers=LAYERS),
        features=("12 query heads per KV head", "partial rotary 0.5", "qk-norm", "q/k/v bias",
                  "MoE (first layer dense)"),
        notes="16 routed experts of width 64 (the model has 160 of width 1536); layer 0 dense, layer 1 MoE"),
    Architecture(
        "glm-4.5-air", "GLM-4.5-Air", "zai-org/GLM-4.5-Air", "glm4_moe", "Glm4MoeForCausalLM",
        dict(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
             partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
             max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
             n_routed_experts=16, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=64,
             first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
             intermediate_size=256, num_hidden_layers=LAYERS),
        features=("12 query heads per KV head", "partial rotary 0.5", "no qk-norm", "q/k/v bias",
                  "MoE (first layer dense)"),
        notes="the GLM-4.x MoE geometry without qk-norm; 16 routed experts of width 64 (the model has 128 "
              "of width 1408)"),
    Architecture(
        "gemma-2b", "Gemma", "google/gemma-2b", "gemma", "GemmaForCausalLM",
        dict(hidden_size=2048, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, hidden_act="gelu_pytorch_tanh",
             max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
             intermediate_size=512, num_hidden_layers=LAYERS),
        features=("head_dim 256", "one KV head (MQA)", "tied embeddings"),
        notes="Gemma 1 has no sliding window (Gemma 2/3 do); SGLang 0.5.17 serves it from models/gemma.py"),
)

LAYER_PATTERN_ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "qwen3-next-80b-a3b", "Qwen3-Next", "Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next",
        "Qwen3NextForCausalLM",
        dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
             full_attention_interval=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
             tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
             shared_expert_intermediate_size=64, intermediate_size=256, decoder_sparse_step=1,
             norm_topk_prob=True, num_hidden_layers=8),
        features=("hybrid: Gated DeltaNet linear attention, full attention every 4th layer",
                  "gated attention output", "qk-norm", "partial rotary 0.25", "head_dim 256", "MoE"),
        notes="8 layers (the model has 48) so that both kinds appear: full attention at 3 and 7; linear "
              "attention heads 2 key / 4 value (the model has 16 / 32) and 8 experts of width 64 (512 of "
              "512): attention does not see them",
        full_attention_layers=(3, 7)),
    Architecture(
        "gpt-oss-20b", "gpt-oss", "openai/gpt-oss-20b", "gpt_oss", "GptOssForCausalLM",
        dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
             sliding_window=128, attention_bias=True,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
             max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
             num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, num_hidden_layers=4),
        features=("alternating sliding (window 128) / full layers", "learned attention sinks",
                  "8 query heads per KV head", "q/k/v bias", "rope_type yarn", "MoE"),
        notes="4 layers (the model has 24): sliding at 0 and 2, full at 1 and 3; 4 experts of width 64 "
              "(the model has 32 of width 2880)",
        full_attention_layers=(1, 3)),
    Architecture(
        "gemma-3-1b", "Gemma-3", "google/gemma-3-1b-it", "gemma3_text", "Gemma3ForCausalLM",
        dict(hidden_size=1152, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
             sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
             hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, rms_norm_eps=1e-6,
             tie_word_embeddings=True, intermediate_size=512, num_hidden_layers=6),
        features=("5 sliding (window 512) : 1 full layers", "qk-norm", "head_dim 256", "one KV head (MQA)",
                  "two RoPE bases (local 10k, global 1M)"),
        notes="6 layers (the model has 26): sliding 0-4, full at 5",
        full_attention_layers=(5,)),
)

ALL_ARCHITECTURES = ARCHITECTURES + LAYER_PATTERN_ARCHITECTURES
BY_NAME = {a.name: a for a in ALL_ARCHITECTURES}


def get(name: str) -> Architecture:
    if name not in BY_NAME:
        raise ValueError(f"unknown architecture {name!r} (choose from {', '.join(BY_NAME)})")
    return BY_NAME[name]


def build_tokenizer():
    """A byte-level BPE tokenizer of TOKENIZER_VOCAB tokens, trained in-process on fixed stdlib
    source (offline, deterministic for a Python version); token 0 is ``<|endoftext|>`` (BOS/EOS/pad)."""
    import importlib
    import inspect

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [inspect.getsource(importlib.import_module(m)) for m in TOKENIZER_TEXT_MODULES]
    tok.train_from_iterator(texts, trainer)
    eos = SPECIAL_TOKENS[0]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eos, eos_token=eos, pad_token=eos)


def hf_config(arch: Architecture, vocab_size: int):
    """The transformers config object of ``arch`` (architectures set, BOS/EOS/pad = token 0)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(arch.model_type, vocab_size=vocab_size, bos_token_id=0, eos_token_id=0,
                                pad_token_id=0, architectures=[arch.architecture], **arch.config)


def build_model(arch: Architecture, vocab_size: int, seed: int = 0):
    """Random-weight float32 causal LM of ``arch`` (eval mode): HF init, seeded, q/k/v biases
    (where the architecture has them) drawn N(0, BIAS_STD^2)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(arch, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
    if type(model).__name__ != arch.architecture:
        raise ValueError(f"{arch.name}: transformers built {type(model).__name__}, expected {arch.architecture}")
    return model.eval()


def build_model_dir(arch: Architecture | str, out_dir: str, seed: int = 0) -> str:
    """Write a complete local HF model folder for ``arch`` into ``out_dir`` (created):
    config.json, random weights in bfloat16 (like the published checkpoints) and the
    in-process tokenizer. Returns ``out_dir``."""
    import torch

    arch = get(arch) if isinstance(arch, str) else arch
    tok = build_tokenizer()
    model = build_model(arch, len(tok), seed)
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    _restore_dropped_keys(arch, out_dir)
    return str(out_dir)


# config keys a row states that transformers 5 folds into others when it saves (full_attention_interval
# into layer_types), while the published config.json carries them and SGLang 0.5.17 reads only them
# (its Qwen3NextConfig derives the full-attention layers from full_attention_interval alone)
KEYS_SGLANG_READS = ("full_attention_interval",)


def _restore_dropped_keys(arch: Architecture, out_dir: str) -> None:
    import json

    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    missing = {k: arch.config[k] for k in KEYS_SGLANG_READS if k in arch.config and k not in cfg}
    if missing:
        cfg.update(missing)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
