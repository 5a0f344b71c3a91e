"""Triton store kernel: rotate + clip + INT2-quantise + pack new tokens into the hybrid
cache, and write their BF16 sink / ring copies, in one launch (no host sync).

For each new token t (position p, request row r, slot s) and KV head h, for X in {K, V}:
    x'   = x_t @ R_X[h]                       (float32; rotated, unclipped)
    x_c  = clamp(x', clip_min_X[h], clip_max_X[h])
    per group g of G channels (G = G_K for K, G_V for V): lo = min x_c, scale = (max x_c - lo) / 3, both cast to the
    scale dtype, code = clamp(floor((x_c - lo) / scale + 1/2), 0, 3)  (0 when scale == 0)
    packed[s, h, j] = sum_i code[i*D/4 + j] << 2i          (plane-major, see int2.py)
    scales[s, h, g] = (scale, lo)
    sink[c, p, h]   = bf16(x')  if p < S and the first page of row r owns sink slot c
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
from .triton_common import (SCALE_TL_DTYPES, check_cache_layout, check_last_dim_contiguous, head_index, mma_f32,
                            sink_slot_of_row, to_scale_dtype)


@triton.jit
def _store_one(x_ptr, sx_t, sx_h, rot_ptr, cmin_ptr, cmax_ptr,
               pk_ptr, spk_s, spk_h, sc_ptr, ssc_s, ssc_h, ssc_g,
               sink_ptr, ssk_c, ssk_p, ssk_h, ring_ptr, srg_r, srg_c, srg_h,
               out_ptr, so_t, so_h,
               h, tok, tmask, slot, pos, row, end, sink_c,
               D: tl.constexpr, G: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
               BLOCK_T: tl.constexpr, KB: tl.constexpr, SCALE_DTYPE: tl.constexpr,
               WRITE_INT2: tl.constexpr, WRITE_RING: tl.constexpr, WRITE_ROT: tl.constexpr,
               PRECISION: tl.constexpr):
    """Write one of K / V for a block of tokens of KV head ``h`` (see module doc)."""
    d = tl.arange(0, D)
    kb = tl.arange(0, KB)
    xrow = x_ptr + tok.to(tl.int64)[:, None] * sx_t + h * sx_h
    rot = rot_ptr + h.to(tl.int64) * D * D
    xr = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    for c0 in tl.static_range(0, D, KB):
        xs = tl.load(xrow + c0 + kb[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        rs = tl.load(rot + (c0 + kb)[:, None] * D + d[None, :]).to(tl.float32)
        xr = mma_f32(xs, rs, xr, PRECISION)
    xb = xr.to(tl.bfloat16)
    if WRITE_ROT:
        tl.store(out_ptr + tok.to(tl.int64)[:, None] * so_t + h * so_h + d[None, :], xb,
                 mask=tmask[:, None])
    if WRITE_INT2:
        cmin = tl.load(cmin_ptr + h * D + d).to(tl.float32)
        cmax = tl.load(cmax_ptr + h * D + d).to(tl.float32)
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
        tl.store(pk_ptr + slot64[:, None] * spk_s + hh * spk_h + q[None, :], packed,
                 mask=tmask[:, None])
        g = tl.arange(0, NG)
        sc_row = sc_ptr + slot64[:, None] * ssc_s + hh * ssc_h + g[None, :] * ssc_g
        tl.store(sc_row, scale_q, mask=tmask[:, None])
        tl.store(sc_row + 1, lo_q, mask=tmask[:, None])
        if S > 0:
            m = tmask & (pos < S) & (sink_c >= 0)
            dst = sink_ptr + tl.maximum(sink_c, 0)[:, None] * ssk_c + pos.to(tl.int64)[:, None] * ssk_p
            tl.store(dst + h * ssk_h + d[None, :], xb, mask=m[:, None])
    if WRITE_RING:
        if W > 0:
            m = tmask & (pos >= end - W)
            cell = (pos % W).to(tl.int64)
            dst = ring_ptr + row.to(tl.int64)[:, None] * srg_r + cell[:, None] * srg_c
            tl.store(dst + h * srg_h + d[None, :], xb, mask=m[:, None])


@triton.jit(do_not_specialize=["T"])  # one compilation for every token count
def _store_kernel(k_ptr, sk_t, sk_h, v_ptr, sv_t, sv_h,
                  slots_ptr, pos_ptr, rows_ptr, ends_ptr, T,
                  r2t_ptr, r2t_stride, sop_ptr, pos_of_ptr, page_size,
                  krot_ptr, vrot_ptr, kcmin_ptr, kcmax_ptr, vcmin_ptr, vcmax_ptr,
                  kpk_ptr, vpk_ptr, spk_s, spk_h,
                  ksc_ptr, vsc_ptr, ssc_s, ssc_h, ssc_g,
                  ksink_ptr, vsink_ptr, ssk_c, ssk_p, ssk_h,
                  kring_ptr, vring_ptr, srg_r, srg_c, srg_h,
                  kout_ptr, vout_ptr, so_t, so_h,
                  D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
                  BLOCK_T: tl.constexpr, KB: tl.constexpr, SCALE_DTYPE: tl.constexpr,
                  WRITE_INT2: tl.constexpr, WRITE_RING: tl.constexpr, WRITE_ROT: tl.constexpr,
                  PRECISION: tl.constexpr, KV_PROGRAMS: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T), H, KV_PROGRAMS): BLOCK_T new tokens of one KV head; K and V
    in separate programs (KV_PROGRAMS = 2: half the dependent chain of loads and dots per
    program, which is what a decode step's few tokens wait on), or K then V in one (1)."""
    h = tl.program_id(1)
    kv = tl.program_id(2)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < T
    slot = tl.load(slots_ptr + tok, mask=tmask, other=0)
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    row = tl.load(rows_ptr + tok, mask=tmask, other=0).to(tl.int64)
    end = tl.load(ends_ptr + tok, mask=tmask, other=0).to(tl.int64)
    if S > 0 and WRITE_INT2:
        sink_c = sink_slot_of_row(row, r2t_ptr, r2t_stride, sop_ptr, pos_of_ptr, page_size)
    else:
        sink_c = tl.full([BLOCK_T], -1, tl.int64)
    if kv == 0:
        _store_one(k_ptr, sk_t, sk_h, krot_ptr, kcmin_ptr, kcmax_ptr, kpk_ptr, spk_s, spk_h,
                   ksc_ptr, ssc_s, ssc_h, ssc_g, ksink_ptr, ssk_c, ssk_p, ssk_h,
                   kring_ptr, srg_r, srg_c, srg_h, kout_ptr, so_t, so_h,
                   h, tok, tmask, slot, pos, row, end, sink_c,
                   D, GK, S, W, BLOCK_T, KB, SCALE_DTYPE, WRITE_INT2, WRITE_RING, WRITE_ROT, PRECISION)
    if kv == KV_PROGRAMS - 1:
        _store_one(v_ptr, sv_t, sv_h, vrot_ptr, vcmin_ptr, vcmax_ptr, vpk_ptr, spk_s, spk_h,
                   vsc_ptr, ssc_s, ssc_h, ssc_g, vsink_ptr, ssk_c, ssk_p, ssk_h,
                   vring_ptr, srg_r, srg_c, srg_h, vout_ptr, so_t, so_h,
                   h, tok, tmask, slot, pos, row, end, sink_c,
                   D, GV, S, W, BLOCK_T, KB, SCALE_DTYPE, WRITE_INT2, WRITE_RING, WRITE_ROT, PRECISION)


def triton_store(layer: HybridLayerCache, index: HybridCacheIndex, rotation: LayerRotation,
                 req_to_token: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 seq_ends: torch.Tensor, write_int2: bool = True, write_ring: bool = True,
                 rotated_out: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                 block_t: int = 16, k_block: int = 32, num_warps: int = 8,
                 precision: str | None = None, kv_programs: int = 2) -> None:
    """Launch the store kernel (shapes as in api.store_kv). ``precision`` is the float32
    tl.dot input precision of the rotation (default "tf32x3", three TF32 products, float32-
    level error: codes match the PyTorch reference except on rounding ties, as with "ieee").
    ``kv_programs``: 2 = K and V in separate programs, 1 = one program writes both.
    Defaults timed on the H200 (kernels_h200.json round 6, one decode step's store, one
    layer): tf32x3 with 8 warps 7.7 us at batch 1 and 6.7 at batch 64, against 10.0 / 8.3
    with ieee and 4 warps (8 warps alone: 8.6 / 7.4; tf32x3 alone: 9.9 / 8.1)."""
    if kv_programs not in (1, 2):
        raise ValueError(f"kv_programs must be 1 or 2, not {kv_programs}")
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
    rot = [x.contiguous() for x in (rotation.k_rot, rotation.v_rot, rotation.k_clip_min,
                                    rotation.k_clip_max, rotation.v_clip_min, rotation.v_clip_max)]
    if rotated_out is not None:
        ko, vo = rotated_out
        if ko.shape != k.shape or vo.shape != k.shape or ko.stride() != vo.stride():
            raise ValueError("rotated_out buffers must match k's shape and share strides")
        check_last_dim_contiguous("rotated_out", ko)
    else:
        ko = vo = k  # never written (WRITE_ROT=False)
    lay = layer
    check_cache_layout(lay)
    grid = (triton.cdiv(t, block_t), h, kv_programs)
    _store_kernel[grid](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        slots, positions, rows, seq_ends, t,
        req_to_token, req_to_token.stride(0), index.sink_slot_of_page, index.page_of_sink_slot,
        index.page_size,
        *rot,
        lay.k_packed, lay.v_packed, lay.k_packed.stride(0), lay.k_packed.stride(1),
        lay.k_scales, lay.v_scales, lay.k_scales.stride(0), lay.k_scales.stride(1), lay.k_scales.stride(2),
        lay.k_sink, lay.v_sink, lay.k_sink.stride(0), lay.k_sink.stride(1), lay.k_sink.stride(2),
        lay.k_ring, lay.v_ring, lay.k_ring.stride(0), lay.k_ring.stride(1), lay.k_ring.stride(2),
        ko, vo, ko.stride(0), ko.stride(1),
        D=d, GK=gk, GV=gv, S=lay.sink_tokens, W=lay.recent_window, BLOCK_T=block_t, KB=min(k_block, d),
        SCALE_DTYPE=SCALE_TL_DTYPES[lay.k_scales.dtype],
        WRITE_INT2=bool(write_int2), WRITE_RING=bool(write_ring), WRITE_ROT=rotated_out is not None,
        PRECISION=precision or "tf32x3", KV_PROGRAMS=kv_programs, num_warps=num_warps,
    )
