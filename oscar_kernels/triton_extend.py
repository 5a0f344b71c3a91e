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
With ``ExtendConfig.prefix_read="bf16"`` a fourth launch first materialises every
request's hybrid prefix as BF16 rows (triton_materialize), so that the prefix is unpacked
once per call instead of once per block of rows, and the attention is BF16 throughout.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
import triton
import triton.language as tl

from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation
from .triton_common import (INTERPRET, check_cache_layout, check_last_dim_contiguous, group_scale_args,
                            half_keys, head_index, needs_int64_slots, pair_views)
from .triton_decode import rotate_tokens
from .triton_materialize import MAX_MATERIALIZED_TOKENS, prefix_offsets, triton_materialize_prefix
from .triton_hybrid_attn import (bf16_range, fresh_dot, int2_finish, int2_query, int2_range, int2_state, mm,
                                 online_softmax, request_layout, store_pairs)


@triton.jit
def _extend_kernel(qr_ptr, sq_t, sq_h, knew_ptr, vnew_ptr, sn_t, sn_h,
                   rows_ptr, pre_ptr, qo_ptr, r2t_ptr, r2t_stride, sop_ptr, pos_of_ptr, page_size, vf_ptr,
                   kpk_ptr, vpk_ptr, spk_s, spk_h, ksc_ptr, vsc_ptr, ssc_s, ssc_h, ssc_g,
                   kgs_ptr, vgs_ptr, sgs_s, sgs_h,
                   ksink_ptr, vsink_ptr, ssk_c, ssk_p, ssk_h,
                   kring_ptr, vring_ptr, srg_r, srg_c, srg_h,
                   kpre_ptr, vpre_ptr, spre_t, spre_h, pre_off_ptr,
                   o_ptr, so_t, so_h, qk_scale,
                   GQ: tl.constexpr, GQP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
                   GK: tl.constexpr, GV: tl.constexpr, S: tl.constexpr, W: tl.constexpr, BN: tl.constexpr,
                   BN_BF16: tl.constexpr, PAIR: tl.constexpr, MAGIC: tl.constexpr,
                   USE_DOT: tl.constexpr, INTERP: tl.constexpr, SLOT64: tl.constexpr,
                   HALF: tl.constexpr, BF16_PREFIX: tl.constexpr):
    """Grid (cdiv(max_extend_len, BM), B, H); writes o' (rotated space, float32) to o_ptr.

    BF16_PREFIX: the prefix was materialised (triton_materialize) as BF16 rows
    kpre/vpre[pre_off[b] + t]; one [R, D] accumulator runs over them and the new tokens.
    Otherwise two phases keep the live state small: (1) the INT2 prefix with plane
    accumulators, normalised and parked in o_ptr's rows; (2) the BF16 parts (sinks, ring,
    causal new tokens) with one [R, D] accumulator, then the log-sum-exp merge with the
    parked part."""
    mb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    qo_lo = tl.load(qo_ptr + b).to(tl.int64)
    e = tl.load(qo_ptr + b + 1).to(tl.int64) - qo_lo
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
        o_vec = o_ptr + tok * so_t + hq * so_h  # [R] row pointers of o'
        q_vec = qr_ptr + tok * sq_t + hq * sq_h
        m_i = tl.full([R], float("-inf"), tl.float32)
        l_i = tl.zeros([R], tl.float32)
        acc = tl.zeros([R, D], tl.float32)
        if BF16_PREFIX:
            q = tl.load(q_vec[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
            pre = tl.load(pre_off_ptr + b).to(tl.int64) * spre_t + h * spre_h
            m_i, l_i, acc = bf16_range(q, m_i, l_i, acc, kpre_ptr + pre, vpre_ptr + pre, spre_t,
                                       0, tl.load(pre_ptr + b).to(tl.int64), 0, qk_scale, BN_BF16, D,
                                       USE_DOT, INTERP)
        else:
            row, n, c, s_b, ring_lo = request_layout(b, rows_ptr, pre_ptr, r2t_ptr, r2t_stride, sop_ptr,
                                                     pos_of_ptr, page_size, vf_ptr, S, W)
            # ---- phase 1: INT2 history [s_b, ring_lo) (transposed pair tiles)
            qops, qsums = int2_query(q_vec, rmask, qk_scale, D, GK, MAGIC, HALF)
            hh = head_index(h, SLOT64)
            st = int2_range(qops, qsums, int2_state(R, D, GV), s_b, ring_lo, r2t_ptr + row * r2t_stride,
                            kpk_ptr, vpk_ptr, spk_s, hh * spk_h, ksc_ptr, vsc_ptr, ssc_s, ssc_g, hh * ssc_h,
                            kgs_ptr, vgs_ptr, sgs_s, hh * sgs_h, qk_scale, BN, D, GK, GV, PAIR, MAGIC, USE_DOT, INTERP,
                            SLOT64, HALF)
            outs, m2, l2 = int2_finish(st, D, GV, MAGIC)
            store_pairs(o_vec, rmask, outs, D)
            # ---- phase 2: BF16 sinks, ring, then the new tokens causally
            q = tl.load(q_vec[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
            if S > 0:
                cs = tl.maximum(c, 0) * ssk_c + h * ssk_h
                m_i, l_i, acc = bf16_range(q, m_i, l_i, acc, ksink_ptr + cs, vsink_ptr + cs, ssk_p,
                                           0, s_b, 0, qk_scale, BN_BF16, D, USE_DOT, INTERP)
            if W > 0:
                rr = row * srg_r + h * srg_h
                m_i, l_i, acc = bf16_range(q, m_i, l_i, acc, kring_ptr + rr, vring_ptr + rr, srg_c,
                                           ring_lo, n, W, qk_scale, BN_BF16, D, USE_DOT, INTERP)
        nb = tl.arange(0, BN_BF16)
        kv_new = h * sn_h
        for j0 in range(0, tl.minimum(e, m0 + BM), BN_BF16):
            j = j0 + nb
            jmask = j < e
            joff = (qo_lo + j) * sn_t + kv_new
            k = tl.load(knew_ptr + joff[None, :] + d[:, None], mask=jmask[None, :], other=0.0)
            s = mm(q, k, tl.zeros([R, BN_BF16], tl.float32), USE_DOT, INTERP) * qk_scale
            causal = jmask[None, :] & (j[None, :] <= tq[:, None])
            p, alpha, m_i, l_i = online_softmax(s, causal, m_i, l_i)
            v = tl.load(vnew_ptr + joff[:, None] + d[None, :], mask=jmask[:, None], other=0.0)
            acc = fresh_dot(p.to(tl.bfloat16), v, acc, alpha[:, None], USE_DOT, INTERP)
        if BF16_PREFIX:  # every row attends to its own token at least: l_i > 0
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        else:
            # ---- merge the parked INT2 part (written by other threads of this program)
            tl.debug_barrier()
            o2 = tl.load(o_vec[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
            m = tl.maximum(m_i, m2)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            f1 = tl.exp2(m_i - m_safe)
            f2 = tl.exp2(m2 - m_safe) * l2
            den = l_i * f1 + f2
            den = tl.where(den > 0, den, 1.0)
            o = (acc * f1[:, None] + o2 * f2[:, None]) / den[:, None]
            tl.debug_barrier()
        tl.store(o_vec[:, None] + d[None, :], o, mask=rmask[:, None])


@dataclass
class ExtendConfig:
    """Launch parameters of the extend kernel."""

    block_rows: int = 64  # query rows (tokens x query heads of a KV head) per program
    block_n: int = 32  # INT2 prefix tokens per step
    block_n_bf16: int = 32  # BF16 (sink / ring / new) tokens per step
    num_warps: int = 8  # (64 rows, 32-token steps, 8 warps: no register spills on sm_90)
    num_stages: int = 2
    magic_unpack: bool = True
    half_keys: bool = True  # as DecodeConfig.half_keys
    use_dot: bool = True
    fp32_precision: str = "ieee"
    # how the prefix is read: "int2" (unpacked in every program, nothing materialised) or
    # "bf16" (materialised once per call by triton_materialize: sum(prefix) x H x D x 4 bytes
    # of scratch, then BF16 flash attention)
    prefix_read: str = "int2"
    materialize_block: int = 64  # prefix tokens per materialising program
    # "bf16" only while a call's prefixes sum to at most this many tokens; larger calls read INT2
    max_materialized_tokens: int = MAX_MATERIALIZED_TOKENS


PREFIX_READS = ("int2", "bf16")

# Tiles per prefix read, timed on the H200 (extend_h200.json, one layer, 8,192 new tokens over
# prefixes of 0 / 32k / 120k tokens). INT2 read (64 rows, 32-token steps): 2 stages 6.4 / 42.7 /
# 157.0 ms against 7.1 / 52.3 / 272.1 with 1 stage; 16-token steps or 32 rows are slower (64-token
# INT2 steps spill on sm_90). BF16 read: 128 rows, 64-token steps, 3 stages 3.2 / 14.7 / 46.3 ms,
# against 3.5 / 18.0 / 60.8 with 2 stages, 3.3 / 16.3 / 55.5 with 128-token steps and 2 stages,
# and 6.8 / 56.6 / 218.6 with the INT2 read's tiles. Each read keeps its own tiles: the BF16
# read's spill 284 bytes in the INT2 read on sm_90.
BF16_READ_TILES = dict(block_rows=128, block_n_bf16=64, num_stages=3)
INT2_READ_TILES = {k: getattr(ExtendConfig, k) for k in BF16_READ_TILES}  # ExtendConfig's defaults


def check_prefix_read(prefix_read: str) -> None:
    if prefix_read not in PREFIX_READS:
        raise ValueError(f"prefix_read {prefix_read!r}: choose from {', '.join(PREFIX_READS)}")


def extend_config(prefix_read: str = "int2") -> ExtendConfig:
    """The default ExtendConfig of a prefix read, with that read's tiles."""
    check_prefix_read(prefix_read)
    return ExtendConfig(prefix_read=prefix_read, **(BF16_READ_TILES if prefix_read == "bf16" else {}))


def triton_extend(q: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor, layer: HybridLayerCache,
                  index: HybridCacheIndex, rotation: LayerRotation, req_to_token: torch.Tensor,
                  rows: torch.Tensor, prefix_lens: torch.Tensor, qo_indptr: torch.Tensor,
                  max_extend_len: int, sm_scale: float, out: torch.Tensor | None = None,
                  q_rot_buffer: torch.Tensor | None = None, o_rot_buffer: torch.Tensor | None = None,
                  config: ExtendConfig | None = None, prefix_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """Extend attention (api.extend_attention semantics): q [T, Hq, D] unrotated; k_rot,
    v_rot [T, H, D] bf16 rotated new keys/values; returns o [T, Hq, D] un-rotated.
    ``max_extend_len`` must be >= every qo_indptr[b+1] - qo_indptr[b] (host int, no sync).
    ``prefix_lens_host``: prefix_lens as host ints, for ``prefix_read="bf16"`` (without
    it the lengths are read back from the device: one sync)."""
    cfg = config or ExtendConfig()
    check_prefix_read(cfg.prefix_read)
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
    if out is None:
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    check_last_dim_contiguous("out", out)
    if t == 0 or b == 0 or max_extend_len <= 0:
        return out
    if q_rot_buffer is None:
        q_rot_buffer = torch.empty(t, hq, d, dtype=torch.bfloat16, device=q.device)
    if o_rot_buffer is None:
        o_rot_buffer = torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
    q_rot = rotate_tokens(q, rotation.k_rot.contiguous(), q_rot_buffer[:t], cfg.fp32_precision)
    o_rot = o_rot_buffer[:t]
    gq = hq // h
    gqp = triton.next_power_of_2(gq)
    lay = layer
    gs = group_scale_args(lay)
    host = None
    if cfg.prefix_read == "bf16":
        host = prefix_lens.tolist() if prefix_lens_host is None else prefix_lens_host
    bf16_prefix = host is not None and sum(host) <= cfg.max_materialized_tokens
    if cfg.prefix_read == "bf16" and not bf16_prefix:  # prefixes above the scratch cap: INT2 read
        cfg = replace(cfg, **INT2_READ_TILES)
    if bf16_prefix:
        pre_off = prefix_offsets(prefix_lens)
        k_pre, v_pre = triton_materialize_prefix(lay, index, req_to_token, rows, prefix_lens, host,
                                                 block_tokens=cfg.materialize_block, offsets=pre_off)
    else:  # unused pointers (never read)
        k_pre = v_pre = k_rot
        pre_off = prefix_lens
    bm = max(1, cfg.block_rows // gqp)
    grid = (triton.cdiv(max_extend_len, bm), b, h)
    _extend_kernel[grid](
        q_rot, q_rot.stride(0), q_rot.stride(1), k_rot, v_rot, k_rot.stride(0), k_rot.stride(1),
        rows, prefix_lens, qo_indptr, req_to_token, req_to_token.stride(0),
        index.sink_slot_of_page, index.page_of_sink_slot, index.page_size, index.ring_valid_from,
        *pair_views(lay),
        lay.k_scales, lay.v_scales, lay.k_scales.stride(0), lay.k_scales.stride(1), lay.k_scales.stride(2),
        *gs[:4],
        lay.k_sink, lay.v_sink, lay.k_sink.stride(0), lay.k_sink.stride(1), lay.k_sink.stride(2),
        lay.k_ring, lay.v_ring, lay.k_ring.stride(0), lay.k_ring.stride(1), lay.k_ring.stride(2),
        k_pre, v_pre, k_pre.stride(0), k_pre.stride(1), pre_off,
        o_rot, o_rot.stride(0), o_rot.stride(1), sm_scale * 1.4426950408889634,
        GQ=gq, GQP=gqp, BM=bm, D=d, GK=lay.key_group_size, GV=lay.value_group_size, S=lay.sink_tokens, W=lay.recent_window,
        BN=cfg.block_n, BN_BF16=cfg.block_n_bf16, PAIR=gs[4], MAGIC=cfg.magic_unpack,
        USE_DOT=cfg.use_dot, INTERP=INTERPRET, SLOT64=needs_int64_slots(lay),
        HALF=half_keys(cfg.half_keys, cfg.magic_unpack, lay), BF16_PREFIX=bf16_prefix, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return rotate_tokens(o_rot, rotation.v_rot.contiguous(), out, cfg.fp32_precision, transpose=True)
