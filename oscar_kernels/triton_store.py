"""Triton store kernel: rotate + clip + INT2-quantise + pack new tokens into the hybrid
cache, and write their BF16 sink / ring copies, in one launch (no host sync).

For each new token t (position p, request row r, slot s) and KV head h, for X in {K, V}:
    x'   = x_t @ R_X[h] - shift_X[h]          (float32; rotated, unclipped; shift_V = 0)
    x_c  = clamp(x', clip_min_X[h], clip_max_X[h])
    per group g of G channels (G = G_K for K, G_V for V): lo = min x_c, scale = (max x_c - lo) / 3, both cast to the
    scale dtype, code = clamp(floor((x_c - lo) / scale + 1/2), 0, 3)  (0 when scale == 0)
    packed[s, h, j] = sum_i code[i*D/4 + j] << 2i          (plane-major, see int2.py)
    scales[s, h, g] = (scale, lo)
    sink[c, p, h]   = bf16(x')  if p < S and the first page of row r owns sink slot c (write_sink)
    ring[r, p % W, h] = bf16(x')  if p >= seq_end_t - W
    rotated_out[t, h] = bf16(x')  (optional; extend attends to these)
Exactly the arithmetic of int2.quantise_rotated / reference.reference_store (IEEE
division, round-to-nearest casts); only the summation order of the rotation differs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation
from .int2 import check_group_size
from .triton_common import (SCALE_TL_DTYPES, bf16_side_args, check_cache_layout, check_last_dim_contiguous, code_args,
                            head_index, scale_args, sink_index_args, sink_slot_of_row, to_scale_dtype)


@triton.jit
def _store_one(x_ptr, stride_x_token, stride_x_head, rot_ptr, shift_ptr, clip_min_ptr, clip_max_ptr,
               codes_ptr, stride_code_slot, stride_code_head,
               scales_ptr, stride_scale_slot, stride_scale_head, stride_scale_group,
               sink_ptr, stride_sink_slot, stride_sink_pos, stride_sink_head,
               ring_ptr, stride_ring_row, stride_ring_cell, stride_ring_head,
               out_ptr, stride_out_token, stride_out_head,
               h, tok, tmask, slot, pos, row, end, sink_c,
               D: tl.constexpr, G: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
               BLOCK_T: tl.constexpr, KB: tl.constexpr, SCALE_DTYPE: tl.constexpr,
               WRITE_INT2: tl.constexpr, WRITE_RING: tl.constexpr, WRITE_ROT: tl.constexpr,
               SHIFT: tl.constexpr, WRITE_SINK: tl.constexpr):
    """Write one of K / V for a block of tokens of KV head ``h`` (see module doc). The rotation's
    float32 dots run as tf32x3 (three TF32 products: float32-level error, so the codes match
    the reference's except on rounding ties)."""
    d = tl.arange(0, D)
    kb = tl.arange(0, KB)
    xrow = x_ptr + tok.to(tl.int64)[:, None] * stride_x_token + h * stride_x_head
    rot = rot_ptr + h.to(tl.int64) * D * D
    xr = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    for c0 in tl.static_range(0, D, KB):
        xs = tl.load(xrow + c0 + kb[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        rs = tl.load(rot + (c0 + kb)[:, None] * D + d[None, :]).to(tl.float32)
        xr = tl.dot(xs, rs, xr, input_precision="tf32x3")
    if SHIFT:
        xr = xr - tl.load(shift_ptr + h * D + d).to(tl.float32)[None, :]
    xb = xr.to(tl.bfloat16)
    if WRITE_ROT:
        tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_out_token + h * stride_out_head + d[None, :], xb,
                 mask=tmask[:, None])
    if WRITE_INT2:
        cmin = tl.load(clip_min_ptr + h * D + d).to(tl.float32)
        cmax = tl.load(clip_max_ptr + h * D + d).to(tl.float32)
        xc = tl.minimum(tl.maximum(xr, cmin[None, :]), cmax[None, :])
        NG: tl.constexpr = D // G
        xg = tl.reshape(xc, [BLOCK_T, NG, G])
        lo = tl.min(xg, axis=2)
        hi = tl.max(xg, axis=2)
        scale_q = to_scale_dtype(tl.math.div_rn(hi - lo, tl.full(hi.shape, 3.0, tl.float32)), SCALE_DTYPE)
        lo_q = to_scale_dtype(lo, SCALE_DTYPE)
        scale_f = scale_q.to(tl.float32)[:, :, None]
        lo_f = lo_q.to(tl.float32)[:, :, None]
        safe = tl.where(scale_f > 0, scale_f, 1.0)
        code = tl.floor(tl.math.div_rn(xg - lo_f, tl.broadcast_to(safe, xg.shape)) + 0.5)
        code = tl.minimum(tl.maximum(code, 0.0), 3.0)
        code = tl.where(scale_f > 0, code, 0.0).to(tl.int32)
        planes = tl.reshape(code, [BLOCK_T, 4, D // 4])
        shift = (tl.arange(0, 4) * 2)[None, :, None]
        packed = tl.sum(planes << shift, axis=1).to(tl.uint8)
        slot64 = slot.to(tl.int64)
        q = tl.arange(0, D // 4)
        hh = head_index(h, True)  # head offsets span head-major buffers: int64
        tl.store(codes_ptr + slot64[:, None] * stride_code_slot + hh * stride_code_head + q[None, :], packed,
                 mask=tmask[:, None])
        g = tl.arange(0, NG)
        sc_row = (scales_ptr + slot64[:, None] * stride_scale_slot + hh * stride_scale_head
                  + g[None, :] * stride_scale_group)
        tl.store(sc_row, scale_q, mask=tmask[:, None])
        tl.store(sc_row + 1, lo_q, mask=tmask[:, None])
    if WRITE_SINK:
        if S > 0:
            m = tmask & (pos < S) & (sink_c >= 0)
            dst = (sink_ptr + tl.maximum(sink_c, 0)[:, None] * stride_sink_slot
                   + pos.to(tl.int64)[:, None] * stride_sink_pos)
            tl.store(dst + h * stride_sink_head + d[None, :], xb, mask=m[:, None])
    if WRITE_RING:
        if W > 0:
            m = tmask & (pos >= end - W)
            cell = (pos % W).to(tl.int64)
            dst = ring_ptr + row.to(tl.int64)[:, None] * stride_ring_row + cell[:, None] * stride_ring_cell
            tl.store(dst + h * stride_ring_head + d[None, :], xb, mask=m[:, None])


@triton.jit(do_not_specialize=["T"])  # one compilation for every token count
def _store_kernel(k_ptr, stride_k_token, stride_k_head, v_ptr, stride_v_token, stride_v_head,
                  slots_ptr, pos_ptr, rows_ptr, ends_ptr, T,
                  req_to_token_ptr, stride_req_to_token_row, sink_slot_of_page_ptr, page_of_sink_slot_ptr, page_size,
                  k_rot_ptr, v_rot_ptr, k_shift_ptr, k_clip_min_ptr, k_clip_max_ptr, v_clip_min_ptr, v_clip_max_ptr,
                  k_codes_ptr, v_codes_ptr, stride_code_slot, stride_code_head,
                  k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_head, stride_scale_group,
                  k_sink_ptr, v_sink_ptr, stride_sink_slot, stride_sink_pos, stride_sink_head,
                  k_ring_ptr, v_ring_ptr, stride_ring_row, stride_ring_cell, stride_ring_head,
                  k_out_ptr, v_out_ptr, stride_out_token, stride_out_head,
                  D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
                  BLOCK_T: tl.constexpr, KB: tl.constexpr, SCALE_DTYPE: tl.constexpr,
                  WRITE_INT2: tl.constexpr, WRITE_RING: tl.constexpr, WRITE_ROT: tl.constexpr,
                  WRITE_SINK: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T), H, 2): BLOCK_T new tokens of one KV head; K (program 0 of
    axis 2) and V (program 1) in separate programs: half the dependent chain of loads and
    dots per program, which is what a decode step's few tokens wait on."""
    h = tl.program_id(1)
    kv = tl.program_id(2)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < T
    slot = tl.load(slots_ptr + tok, mask=tmask, other=0)
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    row = tl.load(rows_ptr + tok, mask=tmask, other=0).to(tl.int64)
    end = tl.load(ends_ptr + tok, mask=tmask, other=0).to(tl.int64)
    if S > 0 and WRITE_SINK:
        sink_c = sink_slot_of_row(row, req_to_token_ptr, stride_req_to_token_row, sink_slot_of_page_ptr,
                                  page_of_sink_slot_ptr, page_size)
    else:
        sink_c = tl.full([BLOCK_T], -1, tl.int64)
    if kv == 0:
        _store_one(k_ptr, stride_k_token, stride_k_head, k_rot_ptr, k_shift_ptr, k_clip_min_ptr, k_clip_max_ptr,
                   k_codes_ptr, stride_code_slot, stride_code_head,
                   k_scales_ptr, stride_scale_slot, stride_scale_head, stride_scale_group,
                   k_sink_ptr, stride_sink_slot, stride_sink_pos, stride_sink_head,
                   k_ring_ptr, stride_ring_row, stride_ring_cell, stride_ring_head,
                   k_out_ptr, stride_out_token, stride_out_head,
                   h, tok, tmask, slot, pos, row, end, sink_c,
                   D, GK, S, W, BLOCK_T, KB, SCALE_DTYPE, WRITE_INT2, WRITE_RING, WRITE_ROT, True, WRITE_SINK)
    if kv == 1:
        _store_one(v_ptr, stride_v_token, stride_v_head, v_rot_ptr, k_shift_ptr, v_clip_min_ptr, v_clip_max_ptr,
                   v_codes_ptr, stride_code_slot, stride_code_head,
                   v_scales_ptr, stride_scale_slot, stride_scale_head, stride_scale_group,
                   v_sink_ptr, stride_sink_slot, stride_sink_pos, stride_sink_head,
                   v_ring_ptr, stride_ring_row, stride_ring_cell, stride_ring_head,
                   v_out_ptr, stride_out_token, stride_out_head,
                   h, tok, tmask, slot, pos, row, end, sink_c,
                   D, GV, S, W, BLOCK_T, KB, SCALE_DTYPE, WRITE_INT2, WRITE_RING, WRITE_ROT, False, WRITE_SINK)


STORE_BLOCK_T = 16  # new tokens per program
STORE_K_BLOCK = 32  # rotation K chunk (larger chunks spill on sm_90)
STORE_WARPS = 8


def triton_store(layer: HybridLayerCache, index: HybridCacheIndex, rotation: LayerRotation,
                 req_to_token: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 seq_ends: torch.Tensor, write_int2: bool = True, write_ring: bool = True,
                 rotated_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 write_sink: bool | None = None) -> None:
    """Launch the store kernel (the rules of reference.reference_store; tensors as in hybrid_attention).
    ``write_sink`` (default: write_int2): write the BF16 sinks of positions < S."""
    t, h, d = k.shape
    if v.shape != k.shape or h != layer.num_kv_heads or d != layer.head_dim:
        raise ValueError(f"k/v shape {tuple(k.shape)}/{tuple(v.shape)} does not match the cache "
                         f"(H={layer.num_kv_heads}, D={layer.head_dim})")
    if rotation.k_rot.shape != (h, d, d) or rotation.v_rot.shape != (h, d, d):
        raise ValueError(f"rotation shape {tuple(rotation.k_rot.shape)} != ({h}, {d}, {d})")
    for name, x in (("slots", slots), ("positions", positions), ("rows", rows), ("seq_ends", seq_ends)):
        if x.shape != (t,):
            raise ValueError(f"{name} must have shape ({t},), got {tuple(x.shape)}")
    if t == 0:
        return
    gk, gv = layer.key_group_size, layer.value_group_size
    check_group_size(d, gk)
    check_group_size(d, gv)
    if d % 16 or d < 32:
        raise ValueError(f"head_dim {d} must be a multiple of 16 and >= 32 for the Triton kernels")
    for name, x in (("k", k), ("v", v), ("req_to_token", req_to_token)):
        check_last_dim_contiguous(name, x)
    rot = [x.contiguous() for x in (rotation.k_rot, rotation.v_rot, rotation.k_shift, rotation.k_clip_min,
                                    rotation.k_clip_max, rotation.v_clip_min, rotation.v_clip_max)]
    if rotated_out is not None:
        ko, vo = rotated_out
        if ko.shape != k.shape or vo.shape != k.shape or ko.stride() != vo.stride():
            raise ValueError("rotated_out buffers must match k's shape and share strides")
        check_last_dim_contiguous("rotated_out", ko)
    else:
        ko = vo = k  # never written (WRITE_ROT=False)
    check_cache_layout(layer)
    _store_kernel[(triton.cdiv(t, STORE_BLOCK_T), h, 2)](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        slots, positions, rows, seq_ends, t, *sink_index_args(index, req_to_token),
        *rot, *code_args(layer), *scale_args(layer), *bf16_side_args(layer),
        ko, vo, ko.stride(0), ko.stride(1),
        D=d, GK=gk, GV=gv, S=layer.sink_tokens, W=layer.recent_window, BLOCK_T=STORE_BLOCK_T,
        KB=min(STORE_K_BLOCK, d), SCALE_DTYPE=SCALE_TL_DTYPES[layer.k_scales.dtype],
        WRITE_INT2=bool(write_int2), WRITE_RING=bool(write_ring), WRITE_ROT=rotated_out is not None,
        WRITE_SINK=bool(write_int2 if write_sink is None else write_sink),
        num_warps=STORE_WARPS,
    )
