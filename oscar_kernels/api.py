"""The kernel API that sglang_ext calls (one function per kernel, explicit metadata).

Tensors (all on one device; T new tokens, B requests, H KV heads, Hq query heads with
Hq % H == 0, D head_dim (a power of two >= 64 for the Triton path), G_K / G_V the keys' /
values' INT2 group sizes):
  k, v          [T, H, D]    bf16, unrotated new keys/values (last dim contiguous)
  q             [B|T, Hq, D] bf16, unrotated queries (last dim contiguous)
  slots         [T]  int32/int64  pool slot of each new token
  positions     [T]  int     position of each new token in its sequence
  rows          [T] (store) or [B] (attention)  int  request row (req_to_token row)
  seq_ends      [T]  int     sequence length of the token's request after this batch
  req_to_token  [R, max_context] int32  slot of position j of row r
  seq_lens      [B]  int     cached length n incl. the token being decoded (n >= 1)
  prefix_lens   [B]  int     cached prefix length L of each extend request
  qo_indptr     [B+1] int    new tokens of request b are rows qo_indptr[b]:qo_indptr[b+1]
  max_extend_len  host int >= max_b (qo_indptr[b+1] - qo_indptr[b]) (no device sync)
Cache (hybrid_cache.HybridLayerCache): k/v_packed uint8 [slots, H, D/4]; k_scales
[slots, H, D/G_K, 2] and v_scales [slots, H, D/G_V, 2] (scale, min), float16 / bfloat16 /
float32 / float8_e4m3fn, with the same strides (allocate_layer: views of one tensor;
any strides with a unit last one, allocate_layer's are head-major: [H, slots, ...] storage);
k/v_sink bf16 [C, S, H, D];
k/v_ring bf16 [R, W, H, D]. Rotation (LayerRotation): k/v_rot float32 [H, D, D], clips
float32 [H, D]. Index: sink_slot_of_page int32 [pages], page_of_sink_slot int32 [C],
ring_valid_from int32 [R].
Outputs are unrotated (o = o' R_V^T) in ``out``'s dtype (q.dtype when out is None); q is
rotated inside (q' = q R_K).

Dispatch: the Triton kernels run when the tensors are on CUDA, or everywhere when the
environment variable OSCAR_FORCE_TRITON=1 (CPU tests under TRITON_INTERPRET=1); otherwise
the PyTorch reference runs (the CPU path and the oracle in tests). The Triton modules are
imported lazily, so the reference path never needs a working Triton.
"""
from __future__ import annotations

import os

import torch

from . import reference as ref
from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation


def use_triton(t: torch.Tensor) -> bool:
    """True when calls with tensors like ``t`` go to the Triton kernels."""
    return t.is_cuda or os.environ.get("OSCAR_FORCE_TRITON", "0") == "1"


def _rotate_queries(q: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    return ref.rotate(q, ref.expand_gqa(rot, q.shape[1]))


def make_decode_workspace(max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          device, config=None):
    """Scratch for decode_attention(workspace=...): allocate once (before CUDA-graph
    capture) for the largest batch; ``config`` is a triton_decode.DecodeConfig."""
    from .triton_decode import DecodeWorkspace
    return DecodeWorkspace(max_batch, num_q_heads, num_kv_heads, head_dim, device, config)


def batch_invariant_decode_config(max_context: int, max_batch: int, num_q_heads: int, head_dim: int):
    """triton_decode.batch_invariant_config: a DecodeConfig for make_decode_workspace under
    which a request's decode output does not depend on the batch (deterministic inference)."""
    from .triton_decode import batch_invariant_config
    return batch_invariant_config(max_context, max_batch, num_q_heads, head_dim)


def flashinfer_import_error() -> ImportError | None:
    """Why flashinfer (FlashInfer's extend, a GPU dependency of sglang) does not import, or None."""
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        return e
    return None


def make_flashinfer_extend(device):
    """A FlashInferExtend (flashinfer_extend) for extend_attention(flashinfer=...): plan it
    per batch with host lengths, then pass it to every layer's call."""
    from .flashinfer_extend import FlashInferExtend
    return FlashInferExtend(device)


def store_kv(layer: HybridLayerCache, index: HybridCacheIndex, rotation: LayerRotation,
             req_to_token: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             positions: torch.Tensor, rows: torch.Tensor, seq_ends: torch.Tensor, *,
             write_int2: bool = True, write_ring: bool = True,
             rotated_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate, clip, quantise and pack new tokens; write sinks and ring cells (see
    reference.reference_store for the rules). ``rotated_out=(k_rot, v_rot)``, bf16
    [T, H, D] buffers, receive the rotated unclipped k', v' (extend needs them)."""
    if use_triton(k):
        from .triton_store import triton_store
        triton_store(layer, index, rotation, req_to_token, k, v, slots, positions, rows, seq_ends,
                     write_int2, write_ring, rotated_out)
        return
    k_rot, v_rot = ref.reference_store(layer, index, rotation, req_to_token, k, v, slots,
                                       positions, rows, seq_ends, write_int2, write_ring)
    if rotated_out is not None:
        rotated_out[0].copy_(k_rot)
        rotated_out[1].copy_(v_rot)


def decode_attention(q: torch.Tensor, layer: HybridLayerCache, index: HybridCacheIndex,
                     rotation: LayerRotation, req_to_token: torch.Tensor, rows: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float,
                     out: torch.Tensor | None = None, *, workspace=None, launch=None) -> torch.Tensor:
    """One query token per request over its hybrid cache; returns o [B, Hq, D].
    ``workspace`` (make_decode_workspace) makes the Triton path allocation-free; ``launch``
    (its ``launch(batch)``) is the batch's resolved launch, shared by every layer."""
    if use_triton(q):
        from .triton_decode import triton_decode
        return triton_decode(q, layer, index, rotation, req_to_token, rows, seq_lens, sm_scale,
                             out=out, workspace=workspace, launch=launch)
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
                     out: torch.Tensor | None = None, *, prefix_read: str = "int2",
                     prefix_lens_host=None, flashinfer=None, launch=None) -> torch.Tensor:
    """New tokens attend to their hybrid prefix and causally to themselves (k_rot, v_rot
    from store_kv's rotated_out). Returns o [T, Hq, D]. ``prefix_read`` (Triton path):
    "int2" unpacks the prefix inside the attention, "bf16" materialises it first
    (triton_materialize; ``prefix_lens_host``, the prefix lengths as host ints, avoids a
    device sync); ``flashinfer``: a FlashInferExtend planned for this batch
    (make_flashinfer_extend), which then does the attention over the materialised prefix
    (CUDA; batches whose prefixes exceed its scratch cap take the Triton path). All compute
    the reference's result. ``launch`` (triton_extend.plan_extend_launch) is the batch's
    resolved Triton launch, shared by every layer (it carries its prefix read)."""
    if flashinfer is not None and flashinfer.fits and q.is_cuda:
        return flashinfer.run(q, k_rot, v_rot, layer, index, rotation, req_to_token, rows, prefix_lens, out=out)
    if use_triton(q):
        from .triton_extend import extend_config, triton_extend
        return triton_extend(q, k_rot, v_rot, layer, index, rotation, req_to_token, rows,
                             prefix_lens, qo_indptr, max_extend_len, sm_scale, out=out,
                             config=extend_config(prefix_read), prefix_lens_host=prefix_lens_host,
                             launch=launch)
    o_rot = ref.reference_extend(_rotate_queries(q, rotation.k_rot), k_rot, v_rot, layer, index,
                                 req_to_token, rows, prefix_lens, qo_indptr, sm_scale)
    o = ref.rotate(o_rot, ref.expand_gqa(rotation.v_rot, q.shape[1]).transpose(-1, -2))
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
