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
With ``var_out`` also var[off_b + t, h, g] = scale_g^2 of the key's group g at INT2 positions,
0 at the BF16 ones: the key debias of the attention that reads the rows (reference module doc).
The PyTorch twin is reference.reference_materialize_prefix (reference.hybrid_kv per request).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .hybrid_cache import HybridCacheIndex, HybridLayerCache
from .triton_common import (bf16_side_args, check_cache_layout, code_args, head_index, needs_int64_slots, scale_args,
                            sink_index_args)
from .triton_hybrid_attn import request_layout


@triton.jit
def _copy_rows(src_ptr, row_off, d, mask, dst_ptr, dst_off):
    """dst[dst_off + d] = src[row_off + d] for the rows in mask ([BT] offsets, d [D])."""
    x = tl.load(src_ptr + row_off[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    tl.store(dst_ptr + dst_off[:, None] + d[None, :], x, mask=mask[:, None])


@triton.jit
def _dequant_rows(codes_ptr, scales_ptr, slot, code_head_off, scale_head_off, stride_code_slot, stride_scale_slot,
                  stride_scale_group, mask, dst_ptr, dst_off, D: tl.constexpr, G: tl.constexpr, FP8: tl.constexpr):
    """dst[dst_off + c] = bf16(min_g + code_c * scale_g) for the INT2 rows in mask."""
    Q: tl.constexpr = D // 4
    j = tl.arange(0, Q)
    byte = tl.load(codes_ptr + slot[:, None] * stride_code_slot + code_head_off + j[None, :], mask=mask[:, None],
                   other=0)
    byte = byte.to(tl.int32)
    for i in tl.static_range(4):
        ch = i * Q + j
        code = ((byte >> (2 * i)) & 3).to(tl.float32)
        base = scales_ptr + slot[:, None] * stride_scale_slot + scale_head_off + (ch // G)[None, :] * stride_scale_group
        sc = tl.load(base, mask=mask[:, None], other=0)
        mn = tl.load(base + 1, mask=mask[:, None], other=0)
        if FP8:  # float8_e4m3fn viewed as uint8 (the interpreter does not load float8)
            sc = sc.to(tl.int8, bitcast=True).to(tl.float8e4nv, bitcast=True)
            mn = mn.to(tl.int8, bitcast=True).to(tl.float8e4nv, bitcast=True)
        x = mn.to(tl.float32) + code * sc.to(tl.float32)
        tl.store(dst_ptr + dst_off[:, None] + ch[None, :], x.to(tl.bfloat16), mask=mask[:, None])


@triton.jit
def _materialize_kernel(rows_ptr, prefix_lens_ptr, offsets_ptr,
                        req_to_token_ptr, stride_req_to_token_row, sink_slot_of_page_ptr, page_of_sink_slot_ptr,
                        page_size, ring_valid_from_ptr,
                        k_codes_ptr, v_codes_ptr, stride_code_slot, stride_code_head,
                        k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_head, stride_scale_group,
                        k_sink_ptr, v_sink_ptr, stride_sink_slot, stride_sink_pos, stride_sink_head,
                        k_ring_ptr, v_ring_ptr, stride_ring_row, stride_ring_cell, stride_ring_head,
                        k_out_ptr, v_out_ptr, stride_out_token, stride_out_head,
                        var_ptr, stride_var_token, stride_var_head,
                        D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, S: tl.constexpr,
                        W: tl.constexpr, BT: tl.constexpr, FP8: tl.constexpr, SLOT64: tl.constexpr,
                        VAR: tl.constexpr):
    """Grid (cdiv(max prefix, BT), B, H): positions [BT * pid0, BT * (pid0 + 1)) of request
    b's prefix, KV head h (module doc)."""
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    row, n, c, s_b, ring_lo = request_layout(b, rows_ptr, prefix_lens_ptr, req_to_token_ptr, stride_req_to_token_row,
                                             sink_slot_of_page_ptr, page_of_sink_slot_ptr, page_size,
                                             ring_valid_from_ptr, S, W)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    if tl.program_id(0) * BT < n:
        d = tl.arange(0, D)
        valid = t < n
        dst = (tl.load(offsets_ptr + b) + t).to(tl.int64) * stride_out_token + h * stride_out_head
        # INT2 history
        in_int2 = valid & (t >= s_b) & (t < ring_lo)
        slot = tl.load(req_to_token_ptr + row * stride_req_to_token_row + t, mask=in_int2, other=0)
        if SLOT64:
            slot = slot.to(tl.int64)
        hh = head_index(h, SLOT64)
        _dequant_rows(k_codes_ptr, k_scales_ptr, slot, hh * stride_code_head, hh * stride_scale_head,
                      stride_code_slot, stride_scale_slot, stride_scale_group, in_int2, k_out_ptr, dst, D, GK, FP8)
        _dequant_rows(v_codes_ptr, v_scales_ptr, slot, hh * stride_code_head, hh * stride_scale_head,
                      stride_code_slot, stride_scale_slot, stride_scale_group, in_int2, v_out_ptr, dst, D, GV, FP8)
        if VAR:  # the keys' scale^2 per group, 0 at the BF16 positions
            vdst = var_ptr + (tl.load(offsets_ptr + b) + t).to(tl.int64) * stride_var_token + h * stride_var_head
            for g in tl.static_range(D // GK):
                sc = tl.load(k_scales_ptr + slot * stride_scale_slot + hh * stride_scale_head + g * stride_scale_group,
                             mask=in_int2, other=0)
                if FP8:
                    sc = sc.to(tl.int8, bitcast=True).to(tl.float8e4nv, bitcast=True)
                sc = sc.to(tl.float32)
                tl.store(vdst + g, tl.where(in_int2, sc * sc, 0.0), mask=valid)
        if S > 0:  # BF16 sinks
            in_sink = valid & (t < s_b)
            src = tl.maximum(c, 0) * stride_sink_slot + t.to(tl.int64) * stride_sink_pos + h * stride_sink_head
            _copy_rows(k_sink_ptr, src, d, in_sink, k_out_ptr, dst)
            _copy_rows(v_sink_ptr, src, d, in_sink, v_out_ptr, dst)
        if W > 0:  # BF16 ring cells
            in_ring = valid & (t >= ring_lo)
            src = row * stride_ring_row + (t % W).to(tl.int64) * stride_ring_cell + h * stride_ring_head
            _copy_rows(k_ring_ptr, src, d, in_ring, k_out_ptr, dst)
            _copy_rows(v_ring_ptr, src, d, in_ring, v_out_ptr, dst)


# Largest sum of prefix lengths one call materialises (scratch 4 x H x D bytes per token:
# 1 GiB for 8 KV heads of dim 128); callers read INT2 above it
MAX_MATERIALIZED_TOKENS = 262144
MATERIALIZE_BLOCK_TOKENS = 64  # prefix tokens per program


def prefix_offsets(prefix_lens: torch.Tensor) -> torch.Tensor:
    """off_b = sum_{b' < b} prefix_lens[b'] (int64, on the device, no sync)."""
    lens = prefix_lens.to(torch.int64)
    return torch.cumsum(lens, 0) - lens


def triton_materialize_prefix(layer: HybridLayerCache, index: HybridCacheIndex, req_to_token: torch.Tensor,
                              rows: torch.Tensor, prefix_lens: torch.Tensor, prefix_lens_host: Sequence[int],
                              k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
                              offsets: torch.Tensor | None = None, var_out: torch.Tensor | None = None):
    """(k, v) bf16 [sum L_b, H, D]: the prefixes of the requests, request after request
    (module doc). ``prefix_lens_host`` holds the same lengths as host ints (no sync);
    ``offsets``: prefix_offsets(prefix_lens) when the caller has it already; ``var_out``
    float32 [>= sum L_b, H, D/G_K]: also the keys' scale^2 rows (module doc), returned third."""
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
    if var_out is not None and (var_out.shape[0] < total or var_out.shape[1:] != (h, d // layer.key_group_size)
                                or var_out.dtype != torch.float32 or var_out.stride(-1) != 1):
        raise ValueError(f"var_out {tuple(var_out.shape)} {var_out.dtype} must be float32 >= "
                         f"({total}, {h}, {d // layer.key_group_size}) with a contiguous last dimension")
    out = (k_out[:total], v_out[:total]) + ((var_out[:total],) if var_out is not None else ())
    b = rows.shape[0]
    if longest == 0 or b == 0:
        return out
    fp8 = layer.k_scales.dtype == torch.float8_e4m3fn
    ks, vs, *scale_strides = scale_args(layer)
    if fp8:  # float8 read as uint8 (the interpreter does not load float8); the strides stay
        ks, vs = ks.view(torch.uint8), vs.view(torch.uint8)
    grid = (triton.cdiv(longest, MATERIALIZE_BLOCK_TOKENS), b, h)
    _materialize_kernel[grid](
        rows, prefix_lens, prefix_offsets(prefix_lens) if offsets is None else offsets,
        *sink_index_args(index, req_to_token), index.ring_valid_from,
        *code_args(layer), ks, vs, *scale_strides, *bf16_side_args(layer),
        k_out, v_out, k_out.stride(0), k_out.stride(1),
        *((var_out, var_out.stride(0), var_out.stride(1)) if var_out is not None else (k_out, 0, 0)),
        D=d, GK=layer.key_group_size, GV=layer.value_group_size, S=layer.sink_tokens, W=layer.recent_window,
        BT=MATERIALIZE_BLOCK_TOKENS, FP8=fp8, SLOT64=needs_int64_slots(layer), VAR=var_out is not None, num_warps=4,
    )
    return out
