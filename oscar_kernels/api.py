"""The kernel API that sglang_ext calls (one function per kernel, explicit metadata).

Tensors (all on one device; T new tokens, B requests, H KV heads, Hq query heads, D head_dim):
  k, v          [T, H, D]   bf16, unrotated new keys/values
  q             [B|T, Hq, D] bf16, unrotated queries
  slots         [T]  int32/int64  pool slot of each new token
  positions     [T]  int     position of each new token in its sequence
  rows          [T] (store) or [B] (attention)  int  request row (req_to_token row)
  seq_ends      [T]  int     sequence length of the token's request after this batch
  req_to_token  [R, max_context] int32  slot of position j of row r
  seq_lens      [B]  int     cached length n incl. the token being decoded
  prefix_lens   [B]  int     cached prefix length L of each extend request
  qo_indptr     [B+1] int    new tokens of request b are rows qo_indptr[b]:qo_indptr[b+1]
Outputs are bf16 and unrotated (o = o' R_V^T); q is rotated inside (q' = q R_K).

This module is the stable surface; each function dispatches to the Triton kernel on CUDA
tensors and to the PyTorch reference otherwise (the reference is the CPU path and the
oracle in tests).
"""
from __future__ import annotations

import torch

from . import reference as ref
from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation


def _rotate_queries(q: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    return ref.rotate(q, ref.expand_gqa(rot, q.shape[1]))


def store_kv(layer: HybridLayerCache, index: HybridCacheIndex, rotation: LayerRotation,
             req_to_token: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             positions: torch.Tensor, rows: torch.Tensor, seq_ends: torch.Tensor, *,
             write_int2: bool = True, write_ring: bool = True,
             rotated_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate, clip, quantise and pack new tokens; write sinks and ring cells (see
    reference.reference_store for the rules). ``rotated_out=(k_rot, v_rot)``, bf16
    [T, H, D] buffers, receive the rotated unclipped k', v' (extend needs them)."""
    k_rot, v_rot = ref.reference_store(layer, index, rotation, req_to_token, k, v, slots,
                                       positions, rows, seq_ends, write_int2, write_ring)
    if rotated_out is not None:
        rotated_out[0].copy_(k_rot)
        rotated_out[1].copy_(v_rot)


def decode_attention(q: torch.Tensor, layer: HybridLayerCache, index: HybridCacheIndex,
                     rotation: LayerRotation, req_to_token: torch.Tensor, rows: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per request over its hybrid cache; returns o [B, Hq, D] bf16."""
    o_rot = ref.reference_decode(_rotate_queries(q, rotation.k_rot), layer, index, req_to_token,
                                 rows, seq_lens, sm_scale)
    o = ref.rotate(o_rot, ref.expand_gqa(rotation.v_rot, q.shape[1]).transpose(-1, -2))
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out


def extend_attention(q: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor,
                     layer: HybridLayerCache, index: HybridCacheIndex, rotation: LayerRotation,
                     req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                     qo_indptr: torch.Tensor, max_extend_len: int, sm_scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens attend to their hybrid prefix and causally to themselves (k_rot, v_rot
    from store_kv's rotated_out). Returns o [T, Hq, D] bf16."""
    o_rot = ref.reference_extend(_rotate_queries(q, rotation.k_rot), k_rot, v_rot, layer, index,
                                 req_to_token, rows, prefix_lens, qo_indptr, sm_scale)
    o = ref.rotate(o_rot, ref.expand_gqa(rotation.v_rot, q.shape[1]).transpose(-1, -2))
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
