"""See exactly what each attention layer of a transformers model computes.

A custom attention function, registered in transformers' ``AttentionInterface`` under
:data:`CAPTURE_ATTN`, runs the model's own SDPA attention unchanged and hands every layer's
tensors to a callback::

    callback(layer_idx, q, k, v, o)
      q [B, Hq,  T, D]  post-RoPE queries (post q-norm for Qwen3)
      k [B, Hkv, T, D]  post-RoPE keys (what the KV cache stores)
      v [B, Hkv, T, D]  values
      o [B, Hq,  T, D]  per-head attention output, before o_proj

Query head h belongs to KV head ``h // (Hq // Hkv)`` (transformers' ``repeat_kv``).
Logits are bit-identical to ``attn_implementation="sdpa"`` (the same function runs).
Works for every model that dispatches attention through ``ALL_ATTENTION_FUNCTIONS``: the
modules are found by what the callback needs (``layer_idx``, ``o_proj``,
``num_key_value_groups``), not by projection names, so fused ``qkv_proj``, partial rotary,
q/k/v biases, qk-norm and MoE blocks need nothing special (:mod:`calibration.architectures`).
A model loaded with ``attn_implementation="eager"`` (gpt-oss: its learned sinks have no SDPA
path in transformers) is wrapped as :data:`CAPTURE_ATTN_EAGER` instead: its own modeling
file's ``eager_attention_forward`` runs, with its eager mask.

Hybrid models (Qwen3-Next's Gated DeltaNet layers, gpt-oss / Gemma-3 sliding layers): only
the model layers passed as ``layers`` (their full-attention layers) report to the callback;
every layer still runs through the same attention function, unchanged. Qwen3-Next gates the
attention output (``o * sigmoid(gate)``) before ``o_proj``; ``o`` is the output before the gate.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

CAPTURE_ATTN = "oscar_capture"
CAPTURE_ATTN_EAGER = "oscar_capture_eager"
Callback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_CALLBACK_ATTR = "_oscar_capture_callback"


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    callback = getattr(module, _CALLBACK_ATTR, None)
    if callback is not None:
        callback(module.layer_idx, query, key, value, out.transpose(1, 2))
    return out, weights


def _capture_eager_attention(module, query, key, value, attention_mask, **kwargs):
    eager = sys.modules[type(module).__module__].eager_attention_forward  # the model's own
    out, weights = eager(module, query, key, value, attention_mask, **kwargs)
    callback = getattr(module, _CALLBACK_ATTR, None)
    if callback is not None:
        callback(module.layer_idx, query, key, value, out.transpose(1, 2))
    return out, weights


def register() -> None:
    """Make ``attn_implementation=CAPTURE_ATTN`` (and ``CAPTURE_ATTN_EAGER``) known to
    transformers (idempotent)."""
    AttentionInterface.register(CAPTURE_ATTN, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_ATTN, sdpa_mask)
    AttentionInterface.register(CAPTURE_ATTN_EAGER, _capture_eager_attention)
    AttentionMaskInterface.register(CAPTURE_ATTN_EAGER, eager_mask)


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention modules, in layer order (those with ``layer_idx`` and ``o_proj``)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")
            and hasattr(m, "num_key_value_groups")]
    if not mods:
        raise ValueError(f"{type(model).__name__}: no attention modules with layer_idx/o_proj found "
                         "(supported: decoder-only models whose attention goes through transformers' "
                         "AttentionInterface, e.g. Llama, Mistral, Qwen2/3, Qwen3-MoE, Phi-3, GLM-4, Gemma)")
    return sorted(mods, key=lambda m: m.layer_idx)


def full_attention_modules(model, layers: Sequence[int]) -> list[torch.nn.Module]:
    """The attention modules of model layers ``layers`` (its full-attention layers), in that
    order; a layer without one is a ValueError (one line)."""
    by_layer = {m.layer_idx: m for m in attention_modules(model)}
    lack = [l for l in layers if l not in by_layer]
    if lack:
        raise ValueError(f"{type(model).__name__}: no attention module with layer_idx/o_proj found for the "
                         f"full-attention layer(s) {', '.join(map(str, lack))} named by its config "
                         f"(attention modules found at layers {', '.join(map(str, sorted(by_layer))) or 'none'})")
    return [by_layer[l] for l in layers]


@contextmanager
def capture_attention(model, callback: Callback, layers: Sequence[int] | None = None):
    """Within the block every forward of ``model`` calls ``callback`` once per layer of
    ``layers`` (model layer indices; None: every attention module)."""
    register()
    before = model.config._attn_implementation
    mods = attention_modules(model) if layers is None else full_attention_modules(model, layers)
    model.set_attn_implementation(CAPTURE_ATTN_EAGER if before == "eager" else CAPTURE_ATTN)
    for m in mods:
        setattr(m, _CALLBACK_ATTR, callback)
    try:
        yield
    finally:
        for m in mods:
            if hasattr(m, _CALLBACK_ATTR):
                delattr(m, _CALLBACK_ATTR)
        model.set_attn_implementation(before)


def group_by_kv_head(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, T, D] -> [Hkv, B * (Hq/Hkv) * T, D]: the rows each KV head's query heads see."""
    b, hq, t, d = x.shape
    rep = hq // num_kv_heads
    return x.reshape(b, num_kv_heads, rep, t, d).permute(1, 0, 2, 3, 4).reshape(num_kv_heads, -1, d)
