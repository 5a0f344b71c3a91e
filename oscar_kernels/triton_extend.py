"""Triton extend (prefill / chunked prefill) attention over the hybrid cache.

Request b owns new tokens qo_indptr[b]:qo_indptr[b+1] (e_b of them) after a cached prefix
of L_b = prefix_lens[b] positions. New token i (query q_i, position L_b + i) attends to
    the prefix, read by the hybrid rule with n = L_b:
        sink [0, S_b) (BF16), INT2 [S_b, ring_lo), ring [ring_lo, L_b) (BF16),
    and causally to the new tokens j <= i (BF16 k', v' from the store's rotated_out).
Program (m, b, h) serves BLOCK_M new tokens x the Hq/H query heads of KV head h (rows
r = token * GQP + head), flash-attention style with one running (max, sum) per row; the
INT2 part uses the plane algebra of triton_hybrid_attn. Three launches: q' = q R_K,
the attention (o' in float32), o = o' R_V^T (the rotation kernels of triton_decode).
With ``prefix_read="bf16"`` a fourth launch first materialises the prefixes as BF16 rows
(triton_materialize says why). Each read has its own tuned tiles (EXTEND_TILES).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation
from .triton_common import (INTERPRET, bf16_side_args, check_cache_layout, check_last_dim_contiguous, group_scale_args,
                            head_index, mma, needs_int64_slots, pair_views, scale_args, sink_index_args)
from .triton_decode import LOG2E, check_sinks, rotate_tokens
from .triton_hybrid_attn import (bf16_range, fresh_dot, int2_finish, int2_query, int2_range, int2_state,
                                 key_noise_query, online_softmax, request_layout, store_pairs)
from .triton_materialize import MAX_MATERIALIZED_TOKENS, prefix_offsets, triton_materialize_prefix


@triton.jit
def _extend_kernel(q_rot_ptr, stride_q_token, stride_q_head, k_new_ptr, v_new_ptr, stride_new_token, stride_new_head,
                   rows_ptr, prefix_lens_ptr, qo_indptr_ptr,
                   req_to_token_ptr, stride_req_to_token_row, sink_slot_of_page_ptr, page_of_sink_slot_ptr,
                   page_size, ring_valid_from_ptr,
                   k_pairs_ptr, v_pairs_ptr, stride_pair_slot, stride_pair_head,
                   k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_head, stride_scale_group,
                   k_scale_pairs_ptr, v_scale_pairs_ptr, stride_scale_pair_slot, stride_scale_pair_head,
                   k_sink_ptr, v_sink_ptr, stride_sink_slot, stride_sink_pos, stride_sink_head,
                   k_ring_ptr, v_ring_ptr, stride_ring_row, stride_ring_cell, stride_ring_head,
                   k_prefix_ptr, v_prefix_ptr, stride_prefix_token, stride_prefix_head, prefix_offsets_ptr,
                   var_prefix_ptr, stride_var_token, stride_var_head,
                   o_ptr, stride_o_token, stride_o_head, qk_scale, sinks_ptr,
                   GQ: tl.constexpr, GQP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
                   GK: tl.constexpr, GV: tl.constexpr, S: tl.constexpr, W: tl.constexpr, BN: tl.constexpr,
                   BN_BF16: tl.constexpr, PAIR: tl.constexpr, INTERP: tl.constexpr, SLOT64: tl.constexpr,
                   BF16_PREFIX: tl.constexpr, HAS_SINK: tl.constexpr = False, DEBIAS: tl.constexpr = False):
    """Grid (cdiv(max_extend_len, BM), B, H); writes o' (rotated space, float32) to o_ptr.

    BF16_PREFIX: the prefix was materialised (triton_materialize) as BF16 rows
    k/v_prefix[prefix_offsets[b] + t]; one [R, D] accumulator runs over them and the new tokens.
    Otherwise two phases keep the live state small: (1) the INT2 prefix with plane
    accumulators, normalised and parked in o_ptr's rows; (2) the BF16 parts (sinks, ring,
    causal new tokens) with one [R, D] accumulator, then the log-sum-exp merge with the
    parked part. HAS_SINK: each query head's learned sink logit sinks_ptr[hq] (natural units)
    joins every row's denominator, with no value (gpt-oss). DEBIAS: the INT2 keys' debias
    (triton_hybrid_attn module doc); with BF16_PREFIX from the materialised prefix's scale^2
    rows var_prefix (row of k/v_prefix, stride_var_token / stride_var_head, group g at + g)."""
    HALF: tl.constexpr = GK >= D // 4  # key codes unpack as float16 when a key group spans a plane
    mb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    qo_lo = tl.load(qo_indptr_ptr + b).to(tl.int64)
    e = tl.load(qo_indptr_ptr + b + 1).to(tl.int64) - qo_lo
    m0 = mb * BM
    if m0 < e:
        R: tl.constexpr = BM * GQP
        r = tl.arange(0, R)
        tq = m0 + r // GQP  # new-token index of each row
        gg = r % GQP
        rmask = (gg < GQ) & (tq < e)
        tok = qo_lo + tq
        hq = (h * GQ + gg).to(tl.int64)
        d = tl.arange(0, D)
        o_vec = o_ptr + tok * stride_o_token + hq * stride_o_head  # [R] row pointers of o'
        q_vec = q_rot_ptr + tok * stride_q_token + hq * stride_q_head
        m_i = tl.full([R], float("-inf"), tl.float32)
        l_i = tl.zeros([R], tl.float32)
        acc = tl.zeros([R, D], tl.float32)
        if BF16_PREFIX:
            q = tl.load(q_vec[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
            off = tl.load(prefix_offsets_ptr + b).to(tl.int64)
            pre = off * stride_prefix_token + h * stride_prefix_head
            qv = key_noise_query(q_vec, rmask, qk_scale, D, GK, DEBIAS)
            m_i, l_i, acc = bf16_range(q, m_i, l_i, acc, k_prefix_ptr + pre, v_prefix_ptr + pre, stride_prefix_token,
                                       0, tl.load(prefix_lens_ptr + b).to(tl.int64), 0, qk_scale, BN_BF16, D, INTERP,
                                       qv, var_prefix_ptr + off * stride_var_token + h * stride_var_head,
                                       stride_var_token)
        else:
            row, n, c, s_b, ring_lo = request_layout(b, rows_ptr, prefix_lens_ptr, req_to_token_ptr,
                                                     stride_req_to_token_row, sink_slot_of_page_ptr,
                                                     page_of_sink_slot_ptr, page_size, ring_valid_from_ptr, S, W)
            # ---- phase 1: INT2 history [s_b, ring_lo) (transposed pair tiles)
            qops, qsums = int2_query(q_vec, rmask, qk_scale, D, GK, HALF)
            qv = key_noise_query(q_vec, rmask, qk_scale, D, GK, DEBIAS)
            hh = head_index(h, SLOT64)
            st = int2_range(qops, qsums, qv, int2_state(R, D, GV), s_b, ring_lo,
                            req_to_token_ptr + row * stride_req_to_token_row,
                            k_pairs_ptr, v_pairs_ptr, stride_pair_slot, hh * stride_pair_head,
                            k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_group, hh * stride_scale_head,
                            k_scale_pairs_ptr, v_scale_pairs_ptr, stride_scale_pair_slot, hh * stride_scale_pair_head,
                            BN, D, GK, GV, PAIR, INTERP, SLOT64, HALF, False, DEBIAS)
            outs, m2, l2 = int2_finish(st, D, GV)
            store_pairs(o_vec, rmask, outs, D)
            # ---- phase 2: BF16 sinks, ring, then the new tokens causally
            q = tl.load(q_vec[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
            if S > 0:
                cs = tl.maximum(c, 0) * stride_sink_slot + h * stride_sink_head
                m_i, l_i, acc = bf16_range(q, m_i, l_i, acc, k_sink_ptr + cs, v_sink_ptr + cs, stride_sink_pos,
                                           0, s_b, 0, qk_scale, BN_BF16, D, INTERP, (), k_sink_ptr, 0)
            if W > 0:
                rr = row * stride_ring_row + h * stride_ring_head
                m_i, l_i, acc = bf16_range(q, m_i, l_i, acc, k_ring_ptr + rr, v_ring_ptr + rr, stride_ring_cell,
                                           ring_lo, n, W, qk_scale, BN_BF16, D, INTERP, (), k_ring_ptr, 0)
        nb = tl.arange(0, BN_BF16)
        kv_new = h * stride_new_head
        for j0 in range(0, tl.minimum(e, m0 + BM), BN_BF16):
            j = j0 + nb
            jmask = j < e
            joff = (qo_lo + j) * stride_new_token + kv_new
            k = tl.load(k_new_ptr + joff[None, :] + d[:, None], mask=jmask[None, :], other=0.0)
            s = mma(q, k, tl.zeros([R, BN_BF16], tl.float32), INTERP) * qk_scale
            causal = jmask[None, :] & (j[None, :] <= tq[:, None])
            p, alpha, m_i, l_i = online_softmax(s, causal, m_i, l_i)
            v = tl.load(v_new_ptr + joff[:, None] + d[None, :], mask=jmask[:, None], other=0.0)
            acc = fresh_dot(p.to(tl.bfloat16), v, acc, alpha[:, None], INTERP)
        s2 = tl.full([R], float("-inf"), tl.float32)
        if HAS_SINK:
            s2 = tl.load(sinks_ptr + hq, mask=rmask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        if BF16_PREFIX:  # every row attends to its own token at least: l_i > 0
            m = tl.maximum(m_i, s2)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            f1 = tl.exp2(m_i - m_safe)
            den = l_i * f1 + tl.exp2(s2 - m_safe)
            o = acc * f1[:, None] / tl.where(den > 0, den, 1.0)[:, None]
        else:
            # ---- merge the parked INT2 part (written by other threads of this program)
            tl.debug_barrier()
            o2 = tl.load(o_vec[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
            m = tl.maximum(tl.maximum(m_i, m2), s2)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            f1 = tl.exp2(m_i - m_safe)
            f2 = tl.exp2(m2 - m_safe) * l2
            den = l_i * f1 + f2 + tl.exp2(s2 - m_safe)
            den = tl.where(den > 0, den, 1.0)
            o = (acc * f1[:, None] + o2 * f2[:, None]) / den[:, None]
            tl.debug_barrier()
        tl.store(o_vec[:, None] + d[None, :], o, mask=rmask[:, None])


@dataclass(frozen=True)
class ExtendTiles:
    """How the extend kernel is launched for one prefix read."""

    block_rows: int  # query rows (tokens x query heads of a KV head) per program
    block_n: int  # INT2 prefix tokens per step
    block_n_bf16: int  # BF16 (sink / ring / materialised prefix / new) tokens per step
    num_stages: int


# The tuned tiles of each prefix read (H200; figures in benchmarks/DECODE_KERNEL_LOG.md), no
# register spills on sm_90 with either; each read keeps its own: the BF16 read's tiles spill
# in the INT2 read, and 64-token INT2 steps spill
EXTEND_TILES = {"int2": ExtendTiles(block_rows=64, block_n=32, block_n_bf16=32, num_stages=2),
                "bf16": ExtendTiles(block_rows=128, block_n=32, block_n_bf16=64, num_stages=3)}
PREFIX_READS = tuple(EXTEND_TILES)
EXTEND_WARPS = 8  # both reads
# the BF16 read's 3-stage 128-row tiles need 256 KiB of shared memory at D = 256 (sm_90 has 227)
MAX_BF16_TILE_HEAD_DIM = 128


def extend_tiles(bf16_prefix: bool, head_dim: int) -> ExtendTiles:
    """The tiles of one extend launch: the BF16 read's own up to MAX_BF16_TILE_HEAD_DIM, else the
    INT2 read's (they fit sm_90's shared memory at D = 256)."""
    return EXTEND_TILES["bf16" if bf16_prefix and head_dim <= MAX_BF16_TILE_HEAD_DIM else "int2"]


def check_prefix_read(prefix_read: str) -> None:
    """How extend reads a cached prefix: "int2" (unpacked in every program, nothing
    materialised) or "bf16" (materialised once per call by triton_materialize, sum(prefix) x
    H x D x 4 bytes of scratch, then BF16 flash attention; calls whose prefixes sum to more
    than MAX_MATERIALIZED_TOKENS read INT2)."""
    if prefix_read not in PREFIX_READS:
        raise ValueError(f"prefix_read {prefix_read!r}: choose from {', '.join(PREFIX_READS)}")


@dataclass(frozen=True)
class ExtendLaunch:
    """How one extend batch runs (plan_extend_launch): resolved once per batch, shared by
    every layer's call (T new tokens, B requests)."""

    bf16_prefix: bool  # prefixes materialised as BF16 rows first ("bf16" read and they fit the cap)
    tiles: ExtendTiles
    max_extend_len: int  # host int >= every request's new tokens
    prefix_lens_host: tuple[int, ...]  # [B] host ints
    prefix_offsets: torch.Tensor | None  # int64 [B]: request b's first materialised row (bf16_prefix)
    q_rot: torch.Tensor  # bf16 [T, Hq, D] rotated queries
    o_rot: torch.Tensor  # float32 [T, Hq, D] attention output before the un-rotation
    k_prefix: torch.Tensor | None  # bf16 [sum L_b, H, D] materialised prefixes (bf16_prefix)
    v_prefix: torch.Tensor | None
    var_prefix: torch.Tensor | None  # float32 [sum L_b, H, D/G_K]: their keys' scale^2 (bf16_prefix, key_debias)


def plan_extend_launch(prefix_lens: torch.Tensor, prefix_lens_host: Sequence[int] | None, max_extend_len: int,
                       num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       prefix_read: str = "int2", key_groups: int = 0) -> ExtendLaunch:
    """Resolve an extend batch: the prefix read (a "bf16" read whose prefixes sum to more
    than MAX_MATERIALIZED_TOKENS reads INT2), its tiles and scratch. ``prefix_lens_host``:
    prefix_lens as host ints (None: read back from the device, one sync, "bf16" only);
    ``key_groups``: the keys' groups per head (D / G_K) when the read debiases them, else 0."""
    check_prefix_read(prefix_read)
    host = None
    if prefix_read == "bf16":
        host = prefix_lens.tolist() if prefix_lens_host is None else list(prefix_lens_host)
    bf16_prefix = host is not None and sum(host) <= MAX_MATERIALIZED_TOKENS
    dev, t, hq, d = prefix_lens.device, num_tokens, num_q_heads, head_dim
    k_pre = v_pre = var_pre = offsets = None
    if bf16_prefix:
        k_pre = torch.empty(sum(host), num_kv_heads, d, dtype=torch.bfloat16, device=dev)
        v_pre = torch.empty_like(k_pre)
        if key_groups:
            var_pre = torch.empty(sum(host), num_kv_heads, key_groups, dtype=torch.float32, device=dev)
        offsets = prefix_offsets(prefix_lens)
    return ExtendLaunch(
        bf16_prefix=bf16_prefix, tiles=extend_tiles(bf16_prefix, d),
        max_extend_len=int(max_extend_len), prefix_lens_host=tuple(int(n) for n in host or ()),
        prefix_offsets=offsets, q_rot=torch.empty(t, hq, d, dtype=torch.bfloat16, device=dev),
        o_rot=torch.empty(t, hq, d, dtype=torch.float32, device=dev), k_prefix=k_pre, v_prefix=v_pre,
        var_prefix=var_pre)


def triton_extend(q: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor, layer: HybridLayerCache,
                  index: HybridCacheIndex, rotation: LayerRotation, req_to_token: torch.Tensor,
                  rows: torch.Tensor, prefix_lens: torch.Tensor, qo_indptr: torch.Tensor,
                  max_extend_len: int, sm_scale: float, out: torch.Tensor | None = None,
                  prefix_read: str = "int2", prefix_lens_host: Sequence[int] | None = None,
                  launch: ExtendLaunch | None = None, sinks: torch.Tensor | None = None,
                  key_debias: bool = False) -> torch.Tensor:
    """Extend attention (reference.reference_extend between the rotations): q [T, Hq, D] unrotated; k_rot,
    v_rot [T, H, D] bf16 rotated new keys/values; returns o [T, Hq, D] un-rotated.
    ``sinks``: [Hq] learned sink logits (any float dtype) or None; ``key_debias``: the INT2
    keys' debias (reference module doc; a ``launch`` must then be planned with key_groups).
    ``max_extend_len`` must be >= every qo_indptr[b+1] - qo_indptr[b] (host int, no sync).
    ``launch``: the batch's resolved launch (plan_extend_launch); else resolved here from
    ``prefix_read`` (check_prefix_read) and ``prefix_lens_host`` (prefix_lens as host ints,
    for the "bf16" read; without it the lengths are read back from the device: one sync)."""
    t, hq, d = q.shape
    h = layer.num_kv_heads
    if d != layer.head_dim or hq % h or k_rot.shape != (t, h, d) or v_rot.shape != (t, h, d):
        raise ValueError(f"q {tuple(q.shape)} / k_rot {tuple(k_rot.shape)} / v_rot {tuple(v_rot.shape)} "
                         f"do not fit the cache (H={h}, D={layer.head_dim})")
    if d < 64 or d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two >= 64 for the Triton kernels")
    b = rows.shape[0]
    if prefix_lens.shape != (b,) or qo_indptr.shape != (b + 1,):
        raise ValueError(f"prefix_lens must be ({b},) and qo_indptr ({b + 1},)")
    if k_rot.stride() != v_rot.stride():
        raise ValueError("k_rot and v_rot must share strides")
    check_cache_layout(layer)
    for name, x in (("k_rot", k_rot), ("v_rot", v_rot), ("req_to_token", req_to_token)):
        check_last_dim_contiguous(name, x)
    check_sinks(sinks, hq)
    if out is None:
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    check_last_dim_contiguous("out", out)
    if t == 0 or b == 0 or max_extend_len <= 0:
        return out
    if launch is None:
        launch = plan_extend_launch(prefix_lens, prefix_lens_host, max_extend_len, t, hq, h, d, prefix_read,
                                    d // layer.key_group_size if key_debias else 0)
    elif launch.q_rot.shape != (t, hq, d):
        raise ValueError(f"launch planned for q {tuple(launch.q_rot.shape)}, got {tuple(q.shape)}")
    elif launch.bf16_prefix and key_debias and (launch.var_prefix is None
                                                or launch.var_prefix.shape[2] < d // layer.key_group_size):
        raise ValueError("key_debias needs a launch planned with key_groups >= this layer's D / G_K "
                         "(the prefix keys' scale^2 rows)")
    q_rot = rotate_tokens(q, rotation.k_rot.contiguous(), launch.q_rot)
    o_rot = launch.o_rot
    gq = hq // h
    gqp = triton.next_power_of_2(gq)
    tiles = launch.tiles
    if launch.bf16_prefix:
        pre_off = launch.prefix_offsets
        # this layer's groups (a launch is planned for the layer with the most: keys' groups may differ per layer)
        var_pre = launch.var_prefix[:, :, :d // layer.key_group_size] if key_debias else None
        k_pre, v_pre = triton_materialize_prefix(layer, index, req_to_token, rows, prefix_lens, launch.prefix_lens_host,
                                                 k_out=launch.k_prefix, v_out=launch.v_prefix, offsets=pre_off,
                                                 var_out=var_pre)[:2]
    else:  # unused pointers (never read)
        k_pre = v_pre = k_rot
        var_pre = None
        pre_off = prefix_lens
    var_args = (var_pre, var_pre.stride(0), var_pre.stride(1)) if var_pre is not None else (o_rot, 0, 0)
    bm = max(1, tiles.block_rows // gqp)
    scale_pairs = group_scale_args(layer)
    _extend_kernel[(triton.cdiv(launch.max_extend_len, bm), b, h)](
        q_rot, q_rot.stride(0), q_rot.stride(1), k_rot, v_rot, k_rot.stride(0), k_rot.stride(1),
        rows, prefix_lens, qo_indptr, *sink_index_args(index, req_to_token), index.ring_valid_from,
        *pair_views(layer), *scale_args(layer), *scale_pairs[:4], *bf16_side_args(layer),
        k_pre, v_pre, k_pre.stride(0), k_pre.stride(1), pre_off, *var_args,
        o_rot, o_rot.stride(0), o_rot.stride(1), sm_scale * LOG2E, o_rot if sinks is None else sinks,
        GQ=gq, GQP=gqp, BM=bm, D=d, GK=layer.key_group_size, GV=layer.value_group_size, S=layer.sink_tokens,
        W=layer.recent_window, BN=tiles.block_n, BN_BF16=tiles.block_n_bf16, PAIR=scale_pairs[4], INTERP=INTERPRET,
        SLOT64=needs_int64_slots(layer), BF16_PREFIX=launch.bf16_prefix, HAS_SINK=sinks is not None,
        DEBIAS=key_debias, num_warps=EXTEND_WARPS,
        num_stages=tiles.num_stages,
    )
    return rotate_tokens(o_rot, rotation.v_rot.contiguous(), out, transpose=True)
