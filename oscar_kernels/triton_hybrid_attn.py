"""Triton building blocks of attention over the hybrid BF16/INT2 cache (decode and extend).

All attention runs in the rotated space with base-2 online softmax: scores are
``s = (q' . k') * sm_scale * log2(e)`` and a running (max m, sum l) per query row.

INT2 algebra (plane i = channels [i D/4, (i+1) D/4), packed in bits 2i..2i+1 of byte j):
with one quantisation group per plane (G >= D/4) and k^_c = min + code_c * scale,
    q'.k^_t            = sum_i scale_{t,i} (q'_i . c_{t,i}) + min_{t,i} sum(q'_i)
    sum_t p_t v^_t |_i = (p * scale_i) @ C_i + sum_t p_t min_{t,i}
so raw codes (exact in bf16) go straight into tensor-core dots. With the "magic" unpack a
code c is produced as the bf16 value 128 + c (bits 0x4300 | c, no int->float conversion)
and the constant 128 is removed through the same min/sum terms. For G < D/4 codes are
dequantised per channel (scale gathered per channel) before the dot.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import mma, sink_slot_of_row


@triton.jit
def mm(a, b, acc, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b: tensor cores (tl.dot) or CUDA-core broadcast-multiply-reduce."""
    if USE_DOT:
        return mma(a, b, acc, INTERP)
    else:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def unpack_words(w, SHIFT: tl.constexpr, BN: tl.constexpr, NW: tl.constexpr):
    """int32 words [BN, NW] (4 packed bytes each) -> bf16 [BN, 4*NW] = 128 + code of plane
    SHIFT/2, in byte order. (code | 0x4300) is the bf16 bit pattern of 128 + code."""
    x = w >> SHIFT
    lo = (x & 0x00030003) | 0x43004300  # bytes 0, 2 of each word
    hi = ((x >> 8) & 0x00030003) | 0x43004300  # bytes 1, 3
    b0 = (lo & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    b2 = (lo >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    b1 = (hi & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    b3 = (hi >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BN, 4 * NW])


@triton.jit
def plane_codes(tile, i: tl.constexpr, BN: tl.constexpr, DQ: tl.constexpr, MAGIC: tl.constexpr):
    """Codes of plane i as bf16 [BN, DQ] (plus 128 when MAGIC). ``tile`` is the block's
    packed K or V: int32 words [BN, DQ/4] when MAGIC, else uint8 bytes [BN, DQ]."""
    if MAGIC:
        return unpack_words(tile, 2 * i, BN, DQ // 4)
    else:
        return ((tile >> (2 * i)) & 3).to(tl.float32).to(tl.bfloat16)


@triton.jit
def load_packed(pk_ptr, slot, hoff, mask, DQ: tl.constexpr, s_slot, MAGIC: tl.constexpr):
    """Packed codes of a block of slots: uint8 [BN, DQ], or int32 words [BN, DQ/4] (MAGIC)."""
    if MAGIC:
        j = tl.arange(0, DQ // 4)
    else:
        j = tl.arange(0, DQ)
    return tl.load(pk_ptr + slot[:, None] * s_slot + hoff + j[None, :], mask=mask[:, None], other=0)


@triton.jit
def online_softmax(s, mask2d, m_i, l_i):
    """Masked base-2 online-softmax step; safe for rows with every score masked.
    Returns (p, alpha, m_new, l_new) with acc_new = acc * alpha + p @ v."""
    s = tl.where(mask2d, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def plane_scale(sc_ptr, slot, hoff, s_slot, s_grp, mask, i: tl.constexpr,
                DQ: tl.constexpr, G: tl.constexpr):
    """(scale, min) of plane i's group for every token of the block (G >= D/4)."""
    base = sc_ptr + slot * s_slot + hoff + ((i * DQ) // G) * s_grp
    sc = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    mn = tl.load(base + 1, mask=mask, other=0.0).to(tl.float32)
    return sc, mn


@triton.jit
def channel_dequant(codes, sc_ptr, slot, hoff, s_slot, s_grp, mask, i: tl.constexpr,
                    DQ: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr):
    """Dequantise plane i per channel (G < D/4): bf16 [BN, DQ] = min_g + code * scale_g."""
    grp = (i * DQ + tl.arange(0, DQ)) // G
    base = sc_ptr + slot[:, None] * s_slot + hoff + grp[None, :] * s_grp
    sc = tl.load(base, mask=mask[:, None], other=0.0).to(tl.float32)
    mn = tl.load(base + 1, mask=mask[:, None], other=0.0).to(tl.float32)
    return (mn + (codes.to(tl.float32) - OFF) * sc).to(tl.bfloat16)


@triton.jit
def int2_score_plane(s, qi, qsum, kt, ksc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask,
                     i: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                     MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """s [R, BN] + q'_i . k^_{t, plane i} for a block of INT2 keys (packed tile ``kt``)."""
    DQ: tl.constexpr = D // 4
    OFF: tl.constexpr = 128.0 if MAGIC else 0.0
    ci = plane_codes(kt, i, BN, DQ, MAGIC)
    if G >= DQ:
        sc, mn = plane_scale(ksc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, i, DQ, G)
        dots = mm(qi, tl.trans(ci), tl.zeros(s.shape, tl.float32), USE_DOT, INTERP)
        s += dots * sc[None, :] + qsum[:, None] * (mn - OFF * sc)[None, :]
    else:
        ki = channel_dequant(ci, ksc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, i, DQ, G, OFF)
        s = mm(qi, tl.trans(ki), s, USE_DOT, INTERP)
    return s


@triton.jit
def int2_pv_plane(acc, p, alpha, vt, vsc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask,
                  i: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                  MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc_i [R, D/4] * alpha + sum_t p_t v^_{t, plane i} for a block of INT2 values."""
    DQ: tl.constexpr = D // 4
    OFF: tl.constexpr = 128.0 if MAGIC else 0.0
    ci = plane_codes(vt, i, BN, DQ, MAGIC)
    acc = acc * alpha[:, None]
    if G >= DQ:
        sc, mn = plane_scale(vsc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, i, DQ, G)
        w = (p * sc[None, :]).to(tl.bfloat16)
        corr = tl.sum(p * mn[None, :] - OFF * w.to(tl.float32), 1)
        acc = mm(w, ci, acc, USE_DOT, INTERP) + corr[:, None]
    else:
        vi = channel_dequant(ci, vsc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, i, DQ, G, OFF)
        acc = mm(p.to(tl.bfloat16), vi, acc, USE_DOT, INTERP)
    return acc


@triton.jit
def load_q_planes(q_rows, rmask, D: tl.constexpr):
    """q' rows [R, D] (pointers ``q_rows`` [R, 1]) as four planes [R, D/4] + their sums."""
    DQ: tl.constexpr = D // 4
    jq = tl.arange(0, DQ)
    q0 = tl.load(q_rows + jq[None, :], mask=rmask[:, None], other=0.0)
    q1 = tl.load(q_rows + DQ + jq[None, :], mask=rmask[:, None], other=0.0)
    q2 = tl.load(q_rows + 2 * DQ + jq[None, :], mask=rmask[:, None], other=0.0)
    q3 = tl.load(q_rows + 3 * DQ + jq[None, :], mask=rmask[:, None], other=0.0)
    return (q0, q1, q2, q3, tl.sum(q0.to(tl.float32), 1), tl.sum(q1.to(tl.float32), 1),
            tl.sum(q2.to(tl.float32), 1), tl.sum(q3.to(tl.float32), 1))


@triton.jit
def int2_range(q0, q1, q2, q3, qs0, qs1, qs2, qs3, m_i, l_i, a0, a1, a2, a3, lo, hi,
               r2t_row, kpk_ptr, vpk_ptr, spk_s, hoff_pk, ksc_ptr, vsc_ptr, ssc_s, ssc_g, hoff_sc,
               qk_scale, BN: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
               MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """Attend rows (q' planes q0..q3) to INT2 positions [lo, hi) whose slots are
    r2t_row[pos]; updates (m, l) and the four plane accumulators a0..a3 [R, D/4]."""
    DQ: tl.constexpr = D // 4
    nb = tl.arange(0, BN)
    for p0 in range(lo, hi, BN):
        pos = p0 + nb
        mask = pos < hi
        slot = tl.load(r2t_row + pos, mask=mask, other=0).to(tl.int64)
        kt = load_packed(kpk_ptr, slot, hoff_pk, mask, DQ, spk_s, MAGIC)
        s = tl.zeros([a0.shape[0], BN], tl.float32)
        s = int2_score_plane(s, q0, qs0, kt, ksc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, 0,
                             BN, D, G, MAGIC, USE_DOT, INTERP)
        s = int2_score_plane(s, q1, qs1, kt, ksc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, 1,
                             BN, D, G, MAGIC, USE_DOT, INTERP)
        s = int2_score_plane(s, q2, qs2, kt, ksc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, 2,
                             BN, D, G, MAGIC, USE_DOT, INTERP)
        s = int2_score_plane(s, q3, qs3, kt, ksc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, 3,
                             BN, D, G, MAGIC, USE_DOT, INTERP)
        p, alpha, m_i, l_i = online_softmax(s * qk_scale, mask[None, :], m_i, l_i)
        vt = load_packed(vpk_ptr, slot, hoff_pk, mask, DQ, spk_s, MAGIC)
        a0 = int2_pv_plane(a0, p, alpha, vt, vsc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, 0,
                           BN, D, G, MAGIC, USE_DOT, INTERP)
        a1 = int2_pv_plane(a1, p, alpha, vt, vsc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, 1,
                           BN, D, G, MAGIC, USE_DOT, INTERP)
        a2 = int2_pv_plane(a2, p, alpha, vt, vsc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, 2,
                           BN, D, G, MAGIC, USE_DOT, INTERP)
        a3 = int2_pv_plane(a3, p, alpha, vt, vsc_ptr, slot, hoff_sc, ssc_s, ssc_g, mask, 3,
                           BN, D, G, MAGIC, USE_DOT, INTERP)
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def bf16_range(q, m_i, l_i, acc, k_base, v_base, row_stride, lo, hi, MOD: tl.constexpr,
               qk_scale, BN: tl.constexpr, D: tl.constexpr, USE_DOT: tl.constexpr,
               INTERP: tl.constexpr):
    """Attend rows q' [R, D] to BF16 positions [lo, hi) stored at k_base/v_base +
    (pos % MOD if MOD else pos) * row_stride (ring cells or sink rows)."""
    d = tl.arange(0, D)
    nb = tl.arange(0, BN)
    for p0 in range(lo, hi, BN):
        pos = p0 + nb
        mask = pos < hi
        if MOD > 0:
            rowoff = (pos % MOD).to(tl.int64) * row_stride
        else:
            rowoff = pos.to(tl.int64) * row_stride
        k = tl.load(k_base + rowoff[None, :] + d[:, None], mask=mask[None, :], other=0.0)
        s = mm(q, k, tl.zeros([q.shape[0], BN], tl.float32), USE_DOT, INTERP) * qk_scale
        p, alpha, m_i, l_i = online_softmax(s, mask[None, :], m_i, l_i)
        v = tl.load(v_base + rowoff[:, None] + d[None, :], mask=mask[:, None], other=0.0)
        acc = mm(p.to(tl.bfloat16), v, acc * alpha[:, None], USE_DOT, INTERP)
    return m_i, l_i, acc


@triton.jit
def request_layout(b, rows_ptr, lens_ptr, r2t_ptr, r2t_stride, sop_ptr, pos_of_ptr, page_size,
                   vf_ptr, S: tl.constexpr, W: tl.constexpr):
    """(row, n, sink slot c, S_b, ring_lo) of request b for the read rule with n =
    lens[b]: sink [0, S_b), INT2 [S_b, ring_lo), ring [ring_lo, n)."""
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int64)
    if S > 0:
        c = sink_slot_of_row(row, r2t_ptr, r2t_stride, sop_ptr, pos_of_ptr, page_size)
        s_b = tl.where(c >= 0, tl.minimum(n, S), 0)
    else:
        c = row * 0 - 1
        s_b = row * 0
    if W > 0:
        vf = tl.load(vf_ptr + row).to(tl.int64)
        ring_lo = tl.minimum(tl.maximum(tl.maximum(n - W, vf), s_b), n)
    else:
        ring_lo = n
    return row, n, c, s_b, ring_lo
