"""Triton kernel: the hybrid prefix of every extend request as plain BF16 rows (rotated space).

Extend attention with a long prefix (chunked prefill of a long prompt, a long radix hit)
reads every prefix token once per block of new-token rows. Reading INT2 there means
unpacking each prefix token again for every block (hundreds of times for an 8k chunk);
materialising the prefix once per layer and chunk turns the rest into BF16 flash
attention. For request b (prefix length n = L_b, read rule of hybrid_cache) and position
t < n, KV head h:

    out[off_b + t, h, :] = sink[c_b, t, h, :]                      t <  S_b
                         = min_g + code_t,c * scale_g  (bf16)      S_b <= t < ring_lo
                         = ring[row_b, t mod W, h, :]              ring_lo <= t < n

with off_b = sum_{b' < b} L_b', code and (scale, min) of group g = c // G of the slot (G = G_K for keys, G_V for values)
req_to_token[row_b, t] (int2 module doc: plane i of byte j holds channel i*D/4 + j).
The PyTorch twin is reference.reference_materialize_prefix (reference.hybrid_kv per request).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .hybrid_cache import HybridCacheIndex, HybridLayerCache
from .triton_common import check_cache_layout, head_index, needs_int64_slots
from .triton_hybrid_attn import request_layout


@triton.jit
def _copy_rows(src_ptr, row_off, d, mask, dst_ptr, dst_off):
    """dst[dst_off + d] = src[row_off + d] for the rows in mask ([BT] offsets, d [D])."""
    x = tl.load(src_ptr + row_off[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    tl.store(dst_ptr + dst_off[:, None] + d[None, :], x, mask=mask[:, None])


@triton.jit
def _dequant_rows(pk_ptr, sc_ptr, slot, hoff_pk, hoff_sc, s_pk, s_sc, s_grp, mask, dst_ptr, dst_off,
                  D: tl.constexpr, G: tl.constexpr, FP8: tl.constexpr):
    """dst[dst_off + c] = bf16(min_g + code_c * scale_g) for the INT2 rows in mask."""
    Q: tl.constexpr = D // 4
    j = tl.arange(0, Q)
    byte = tl.load(pk_ptr + slot[:, None] * s_pk + hoff_pk + j[None, :], mask=mask[:, None], other=0)
    byte = byte.to(tl.int32)
    for i in tl.static_range(4):
        ch = i * Q + j
        code = ((byte >> (2 * i)) & 3).to(tl.float32)
        base = sc_ptr + slot[:, None] * s_sc + hoff_sc + (ch // G)[None, :] * s_grp
        sc = tl.load(base, mask=mask[:, None], other=0)
        mn = tl.load(base + 1, mask=mask[:, None], other=0)
        if FP8:  # float8_e4m3fn viewed as uint8 (the interpreter does not load float8)
            sc = sc.to(tl.int8, bitcast=True).to(tl.float8e4nv, bitcast=True)
            mn = mn.to(tl.int8, bitcast=True).to(tl.float8e4nv, bitcast=True)
        x = mn.to(tl.float32) + code * sc.to(tl.float32)
        tl.store(dst_ptr + dst_off[:, None] + ch[None, :], x.to(tl.bfloat16), mask=mask[:, None])


@triton.jit
def _materialize_kernel(rows_ptr, pre_ptr, off_ptr, r2t_ptr, r2t_stride, sop_ptr, pos_of_ptr, page_size, vf_ptr,
                        kpk_ptr, vpk_ptr, s_pk, s_pk_h, ksc_ptr, vsc_ptr, s_sc, s_sc_h, s_grp,
                        ksink_ptr, vsink_ptr, ssk_c, ssk_p, ssk_h,
                        kring_ptr, vring_ptr, srg_r, srg_c, srg_h,
                        kout_ptr, vout_ptr, so_t, so_h,
                        D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, S: tl.constexpr,
                        W: tl.constexpr, BT: tl.constexpr, FP8: tl.constexpr, SLOT64: tl.constexpr):
    """Grid (cdiv(max prefix, BT), B, H): positions [BT * pid0, BT * (pid0 + 1)) of request
    b's prefix, KV head h (module doc)."""
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    row, n, c, s_b, ring_lo = request_layout(b, rows_ptr, pre_ptr, r2t_ptr, r2t_stride, sop_ptr,
                                             pos_of_ptr, page_size, vf_ptr, S, W)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    if tl.program_id(0) * BT < n:
        d = tl.arange(0, D)
        valid = t < n
        dst = (tl.load(off_ptr + b) + t).to(tl.int64) * so_t + h * so_h
        # INT2 history
        in_int2 = valid & (t >= s_b) & (t < ring_lo)
        slot = tl.load(r2t_ptr + row * r2t_stride + t, mask=in_int2, other=0)
        if SLOT64:
            slot = slot.to(tl.int64)
        hh = head_index(h, SLOT64)
        _dequant_rows(kpk_ptr, ksc_ptr, slot, hh * s_pk_h, hh * s_sc_h, s_pk, s_sc, s_grp, in_int2,
                      kout_ptr, dst, D, GK, FP8)
        _dequant_rows(vpk_ptr, vsc_ptr, slot, hh * s_pk_h, hh * s_sc_h, s_pk, s_sc, s_grp, in_int2,
                      vout_ptr, dst, D, GV, FP8)
        if S > 0:  # BF16 sinks
            in_sink = valid & (t < s_b)
            src = tl.maximum(c, 0) * ssk_c + t.to(tl.int64) * ssk_p + h * ssk_h
            _copy_rows(ksink_ptr, src, d, in_sink, kout_ptr, dst)
            _copy_rows(vsink_ptr, src, d, in_sink, vout_ptr, dst)
        if W > 0:  # BF16 ring cells
            in_ring = valid & (t >= ring_lo)
            src = row * srg_r + (t % W).to(tl.int64) * srg_c + h * srg_h
            _copy_rows(kring_ptr, src, d, in_ring, kout_ptr, dst)
            _copy_rows(vring_ptr, src, d, in_ring, vout_ptr, dst)


# Largest sum of prefix lengths one call materialises (scratch 4 x H x D bytes per token:
# 1 GiB for 8 KV heads of dim 128); callers read INT2 above it
MAX_MATERIALIZED_TOKENS = 262144


def prefix_offsets(prefix_lens: torch.Tensor) -> torch.Tensor:
    """off_b = sum_{b' < b} prefix_lens[b'] (int64, on the device, no sync)."""
    lens = prefix_lens.to(torch.int64)
    return torch.cumsum(lens, 0) - lens


def triton_materialize_prefix(layer: HybridLayerCache, index: HybridCacheIndex, req_to_token: torch.Tensor,
                              rows: torch.Tensor, prefix_lens: torch.Tensor, prefix_lens_host: Sequence[int],
                              k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
                              block_tokens: int = 64, offsets: torch.Tensor | None = None):
    """(k, v) bf16 [sum L_b, H, D]: the prefixes of the requests, request after request
    (module doc). ``prefix_lens_host`` holds the same lengths as host ints (no sync);
    ``offsets``: prefix_offsets(prefix_lens) when the caller has it already."""
    check_cache_layout(layer)
    h, d = layer.num_kv_heads, layer.head_dim
    total = int(sum(prefix_lens_host))
    longest = int(max(prefix_lens_host, default=0))
    if k_out is None:
        k_out = torch.empty(total, h, d, dtype=torch.bfloat16, device=layer.k_packed.device)
    if v_out is None:
        v_out = torch.empty_like(k_out)
    if k_out.shape[0] < total or k_out.shape[1:] != (h, d) or v_out.shape != k_out.shape \
            or k_out.stride() != v_out.stride() or k_out.stride(-1) != 1:
        raise ValueError(f"k_out/v_out {tuple(k_out.shape)}/{tuple(v_out.shape)} must be >= ({total}, {h}, {d}) "
                         "with shared strides and a contiguous last dimension")
    b = rows.shape[0]
    if longest == 0 or b == 0:
        return k_out[:total], v_out[:total]
    fp8 = layer.k_scales.dtype == torch.float8_e4m3fn
    ks, vs = (layer.k_scales.view(torch.uint8), layer.v_scales.view(torch.uint8)) if fp8 else \
        (layer.k_scales, layer.v_scales)
    grid = (triton.cdiv(longest, block_tokens), b, h)
    _materialize_kernel[grid](
        rows, prefix_lens, prefix_offsets(prefix_lens) if offsets is None else offsets, req_to_token,
        req_to_token.stride(0),
        index.sink_slot_of_page, index.page_of_sink_slot, index.page_size, index.ring_valid_from,
        layer.k_packed, layer.v_packed, layer.k_packed.stride(0), layer.k_packed.stride(1),
        ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        layer.k_sink, layer.v_sink, layer.k_sink.stride(0), layer.k_sink.stride(1), layer.k_sink.stride(2),
        layer.k_ring, layer.v_ring, layer.k_ring.stride(0), layer.k_ring.stride(1), layer.k_ring.stride(2),
        k_out, v_out, k_out.stride(0), k_out.stride(1),
        D=d, GK=layer.key_group_size, GV=layer.value_group_size, S=layer.sink_tokens, W=layer.recent_window, BT=block_tokens, FP8=fp8,
        SLOT64=needs_int64_slots(layer), num_warps=4,
    )
    return k_out[:total], v_out[:total]
