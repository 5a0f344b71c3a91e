"""Triton building blocks of attention over the hybrid BF16/INT2 cache (decode and extend).

All attention runs in the rotated space with base-2 online softmax: scores are
``s = (q' . k') * sm_scale * log2(e)`` and a running (max m, sum l) per query row.

INT2 algebra (plane i = channels [i D/4, (i+1) D/4), packed in bits 2i..2i+1 of byte j):
with one quantisation group per plane (G >= D/4) and k^_c = min + code_c * scale,
    q'.k^_t            = sum_i scale_{t,i} (q'_i . c_{t,i}) + min_{t,i} sum(q'_i)
    sum_t p_t v^_t |_i = (p * scale_i) @ C_i + sum_t p_t min_{t,i}
so raw codes (exact in bf16) go straight into tensor-core dots; the planes of one group
(G = D: all four) share one dot chain and one scale. With the "magic" unpack a code c is
produced as the bf16 value 128 + c (bits 0x4300 | c: shift, and, two byte permutes per four
codes, no int->float conversion) and the constant 128 is removed through the same min/sum
terms. For G < D/4 codes are dequantised per channel (scale gathered per channel).

Orientation (chosen from sm_90 SASS, tests/aot_sm90.py): scores are computed transposed,
s^T [tokens, rows] = codes [tokens, D/4] @ q'^T, so the unpacked K codes are the tensor-core
A operand straight from registers; V codes are loaded transposed [D/4, tokens] so that the
byte transpose (not a bf16 one) goes through shared memory, and acc^T [D/4, rows] +=
codes^T @ w. Token sums (softmax denominator, min corrections) are kept as [tokens, rows]
tiles and reduced once at the end instead of every step.
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


# bf16 bit pattern 0x4300 | c is 128 + c (c < 128): four 2-bit codes (one per byte, at bit
# SHIFT) become four bf16 values 128 + code with one shift, one and and two byte permutes.
_PLANE_ASM_0: tl.constexpr = tl.constexpr(
    "{ .reg .b32 t; and.b32 t, $2, 0x03030303; "
    "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }")
_PLANE_ASM_1: tl.constexpr = tl.constexpr(
    "{ .reg .b32 t; shr.b32 t, $2, 2; and.b32 t, t, 0x03030303; "
    "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }")
_PLANE_ASM_2: tl.constexpr = tl.constexpr(
    "{ .reg .b32 t; shr.b32 t, $2, 4; and.b32 t, t, 0x03030303; "
    "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }")
_PLANE_ASM_3: tl.constexpr = tl.constexpr(
    "{ .reg .b32 t; shr.b32 t, $2, 6; and.b32 t, t, 0x03030303; "
    "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }")


@triton.jit
def plane_codes(packed, i: tl.constexpr, MAGIC: tl.constexpr, INTERP: tl.constexpr):
    """Codes of plane i of a packed uint8 tile [BN, D/4] as bf16 [BN, D/4] (channel
    i*D/4 + j in column j); 128 + code when MAGIC (no int->float conversion on the GPU)."""
    if MAGIC and not INTERP:
        if i == 0:
            asm: tl.constexpr = _PLANE_ASM_0
        elif i == 1:
            asm: tl.constexpr = _PLANE_ASM_1
        elif i == 2:
            asm: tl.constexpr = _PLANE_ASM_2
        else:
            asm: tl.constexpr = _PLANE_ASM_3
        return tl.inline_asm_elementwise(asm, "=r,=r,r", [packed], dtype=tl.bfloat16,
                                         is_pure=True, pack=4)
    else:
        c = ((packed >> (2 * i)) & 3).to(tl.float32)
        if MAGIC:
            c = c + 128.0
        return c.to(tl.bfloat16)


@triton.jit
def load_packed(pk_ptr, slot, hoff, mask, DQ: tl.constexpr, s_slot):
    """Packed codes of a block of slots: uint8 [BN, D/4]."""
    j = tl.arange(0, DQ)
    return tl.load(pk_ptr + slot[:, None] * s_slot + hoff + j[None, :], mask=mask[:, None], other=0)


@triton.jit
def load_packed_t(pk_ptr, slot, hoff, mask, DQ: tl.constexpr, s_slot):
    """Packed codes of a block of slots, transposed: uint8 [D/4, BN] (for P@V operands)."""
    j = tl.arange(0, DQ)
    return tl.load(pk_ptr + slot[None, :] * s_slot + hoff + j[:, None], mask=mask[None, :], other=0)


@triton.jit
def online_softmax(s, mask2d, m_i, l_i):
    """Masked base-2 online-softmax step over axis 1; safe for rows with every score
    masked. Returns (p, alpha, m_new, l_new) with acc_new = acc * alpha + p @ v."""
    s = tl.where(mask2d, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def group_scales(sc_ptr, slot, hoff, s_slot, g: tl.constexpr, mask, PAIR: tl.constexpr):
    """(scale, min) float32 [BN] of group g of a block of slots. PAIR (tl.float16 /
    tl.bfloat16, else None): the 16-bit scales are addressed as int32 (scale, min) pairs,
    one load per token (strides in int32 units)."""
    if PAIR is not None:
        x = tl.load(sc_ptr + slot * s_slot + hoff + g, mask=mask, other=0)
        sc = (x & 0xFFFF).to(tl.int16).to(PAIR, bitcast=True)
        mn = (x >> 16).to(tl.int16).to(PAIR, bitcast=True)
        return sc.to(tl.float32), mn.to(tl.float32)
    else:
        base = sc_ptr + slot * s_slot + hoff + 2 * g
        return (tl.load(base, mask=mask, other=0.0).to(tl.float32),
                tl.load(base + 1, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def channel_dequant(codes, i: tl.constexpr, sc_ptr, slot, hoff, s_grp, s_slot, mask,
                    DQ: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr):
    """Dequantise plane i per channel (G < D/4): bf16 [BN, D/4] = min_g + code * scale_g."""
    grp = (i * DQ + tl.arange(0, DQ)) // G
    base = sc_ptr + slot[:, None] * s_slot + hoff + grp[None, :] * s_grp
    sc = tl.load(base, mask=mask[:, None], other=0.0).to(tl.float32)
    mn = tl.load(base + 1, mask=mask[:, None], other=0.0).to(tl.float32)
    return (mn + (codes.to(tl.float32) - OFF) * sc).to(tl.bfloat16)


@triton.jit
def load_q_plane(q_vec, rmask, i: tl.constexpr, D: tl.constexpr):
    """q'^T of plane i: [D/4, R] bf16 and its column sums (float32 [R]); ``q_vec``: [R]
    pointers to the q' rows."""
    DQ: tl.constexpr = D // 4
    qt = tl.load(q_vec[None, :] + (i * DQ + tl.arange(0, DQ))[:, None], mask=rmask[None, :], other=0.0)
    return qt, tl.sum(qt.to(tl.float32), 0)


@triton.jit
def finish_plane(acc, corr, inv, G: tl.constexpr, DQ: tl.constexpr):
    """Normalised o'^T [D/4, R] of a plane: (acc + sum over tokens of corr) * inv."""
    if G >= DQ:
        acc = acc + tl.sum(corr, 0)[None, :]
    return acc * inv[None, :]


@triton.jit
def _k_plane(s, qt, kt, i: tl.constexpr, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask,
             DQ: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr, MAGIC: tl.constexpr,
             USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """s^T [BN, R] + codes_i . q'_i (G >= D/4: raw codes; else dequantised k_i . q'_i)."""
    c = plane_codes(kt, i, MAGIC, INTERP)
    if G < DQ:
        c = channel_dequant(c, i, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF)
    return mm(c, qt, s, USE_DOT, INTERP)


@triton.jit
def _v_plane(acc, w, vt, i: tl.constexpr, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask,
             DQ: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr, MAGIC: tl.constexpr,
             USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc_i^T [D/4, R] + codes_i^T w (or dequantised v_i^T p when G < D/4). The packed
    tile is transposed *before* unpacking, so the code pairs along tokens that the tensor
    core needs come out of the unpack directly (the transpose moves bytes, not bf16)."""
    if G < DQ:
        c = plane_codes(tl.trans(vt), i, MAGIC, INTERP)
        c = tl.trans(channel_dequant(c, i, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF))
    else:
        c = plane_codes(vt, i, MAGIC, INTERP)
    return mm(c, w, acc, USE_DOT, INTERP)


@triton.jit
def int2_range(qt0, qt1, qt2, qt3, qs0, qs1, qs2, qs3, m_i, l_t, a0, a1, a2, a3,
               k0, k1, k2, k3, lo, hi, r2t_row, kpk_ptr, vpk_ptr, spk_s, hoff_pk,
               ksc_ptr, vsc_ptr, ssc_s, ssc_g, hoff_sc, kgs_ptr, vgs_ptr, sgs_s, hoff_gs, qk_scale,
               BN: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PAIR: tl.constexpr,
               MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """Attend R query rows to INT2 positions [lo, hi) (slots r2t_row[pos]).

    Transposed orientation: scores s^T [BN, R]; plane accumulators a_i^T [D/4, R]; running
    max m_i [R]; token tiles [BN, R]: l_t (sum of p) and, per quantisation group g (when
    G >= D/4, NG = D/G groups of 4/NG planes), k_g (p * min_g - OFF * w_g with
    w_g = bf16(p * scale_g) the weights of the P@V dots), summed over tokens by the caller.
    qt_i / qs_i: q'^T of plane i and its column sums (load_q_plane). ksc/vsc (element
    strides ssc_*) address the scales per channel group (G < D/4); kgs/vgs (strides sgs_s,
    hoff_gs) per group as in group_scales (the same tensors, as int32 pairs when PAIR)."""
    DQ: tl.constexpr = D // 4
    NG: tl.constexpr = D // G if G >= DQ else 1
    PG: tl.constexpr = 4 // NG  # planes per group
    OFF: tl.constexpr = 128.0 if MAGIC else 0.0
    nb = tl.arange(0, BN)
    for p0 in range(lo, hi, BN):
        pos = p0 + nb
        mask = pos < hi
        slot = tl.load(r2t_row + pos, mask=mask, other=0).to(tl.int64)
        kt = load_packed(kpk_ptr, slot, hoff_pk, mask, DQ, spk_s)
        vt = load_packed_t(vpk_ptr, slot, hoff_pk, mask, DQ, spk_s)
        # ---- scores: per group, dot over its planes, then scale / min terms
        zero = tl.zeros([BN, qt0.shape[1]], tl.float32)
        if G >= DQ:
            d0 = _k_plane(zero, qt0, kt, 0, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
            if PG >= 2:
                d0 = _k_plane(d0, qt1, kt, 1, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                              MAGIC, USE_DOT, INTERP)
            if PG == 4:
                d0 = _k_plane(d0, qt2, kt, 2, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                              MAGIC, USE_DOT, INTERP)
                d0 = _k_plane(d0, qt3, kt, 3, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                              MAGIC, USE_DOT, INTERP)
            sc, mn = group_scales(kgs_ptr, slot, hoff_gs, sgs_s, 0, mask, PAIR)
            qs = qs0
            if PG >= 2:
                qs = qs + qs1
            if PG == 4:
                qs = qs + qs2 + qs3
            s = d0 * sc[:, None] + (mn - OFF * sc)[:, None] * qs[None, :]
            if NG >= 2:  # group 1: planes 2, 3 (NG = 2) or plane 1 (NG = 4)
                if NG == 2:
                    d1 = _k_plane(zero, qt2, kt, 2, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G,
                                  OFF, MAGIC, USE_DOT, INTERP)
                    d1 = _k_plane(d1, qt3, kt, 3, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G,
                                  OFF, MAGIC, USE_DOT, INTERP)
                    qs = qs2 + qs3
                else:
                    d1 = _k_plane(zero, qt1, kt, 1, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G,
                                  OFF, MAGIC, USE_DOT, INTERP)
                    qs = qs1
                sc, mn = group_scales(kgs_ptr, slot, hoff_gs, sgs_s, 1, mask, PAIR)
                s += d1 * sc[:, None] + (mn - OFF * sc)[:, None] * qs[None, :]
            if NG == 4:
                d2 = _k_plane(zero, qt2, kt, 2, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G,
                              OFF, MAGIC, USE_DOT, INTERP)
                sc, mn = group_scales(kgs_ptr, slot, hoff_gs, sgs_s, 2, mask, PAIR)
                s += d2 * sc[:, None] + (mn - OFF * sc)[:, None] * qs2[None, :]
                d3 = _k_plane(zero, qt3, kt, 3, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G,
                              OFF, MAGIC, USE_DOT, INTERP)
                sc, mn = group_scales(kgs_ptr, slot, hoff_gs, sgs_s, 3, mask, PAIR)
                s += d3 * sc[:, None] + (mn - OFF * sc)[:, None] * qs3[None, :]
        else:
            s = _k_plane(zero, qt0, kt, 0, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                         MAGIC, USE_DOT, INTERP)
            s = _k_plane(s, qt1, kt, 1, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                         MAGIC, USE_DOT, INTERP)
            s = _k_plane(s, qt2, kt, 2, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                         MAGIC, USE_DOT, INTERP)
            s = _k_plane(s, qt3, kt, 3, ksc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                         MAGIC, USE_DOT, INTERP)
        # ---- online softmax over the token axis (0)
        s = tl.where(mask[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        m_i = m_new
        l_t = l_t * alpha[None, :] + p
        a0 = a0 * alpha[None, :]
        a1 = a1 * alpha[None, :]
        a2 = a2 * alpha[None, :]
        a3 = a3 * alpha[None, :]
        # ---- values: per group weights w_g = bf16(p * scale_g)
        if G >= DQ:
            sc, mn = group_scales(vgs_ptr, slot, hoff_gs, sgs_s, 0, mask, PAIR)
            w = (p * sc[:, None]).to(tl.bfloat16)
            k0 = k0 * alpha[None, :] + (p * mn[:, None] - OFF * w.to(tl.float32))
            a0 = _v_plane(a0, w, vt, 0, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
            if NG == 4:
                sc, mn = group_scales(vgs_ptr, slot, hoff_gs, sgs_s, 1, mask, PAIR)
                w = (p * sc[:, None]).to(tl.bfloat16)
                k1 = k1 * alpha[None, :] + (p * mn[:, None] - OFF * w.to(tl.float32))
            a1 = _v_plane(a1, w, vt, 1, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
            if NG >= 2:
                sc, mn = group_scales(vgs_ptr, slot, hoff_gs, sgs_s, NG // 2, mask, PAIR)
                w = (p * sc[:, None]).to(tl.bfloat16)
                if NG == 2:
                    k1 = k1 * alpha[None, :] + (p * mn[:, None] - OFF * w.to(tl.float32))
                else:
                    k2 = k2 * alpha[None, :] + (p * mn[:, None] - OFF * w.to(tl.float32))
            a2 = _v_plane(a2, w, vt, 2, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
            if NG == 4:
                sc, mn = group_scales(vgs_ptr, slot, hoff_gs, sgs_s, 3, mask, PAIR)
                w = (p * sc[:, None]).to(tl.bfloat16)
                k3 = k3 * alpha[None, :] + (p * mn[:, None] - OFF * w.to(tl.float32))
            a3 = _v_plane(a3, w, vt, 3, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
        else:
            pb = p.to(tl.bfloat16)
            a0 = _v_plane(a0, pb, vt, 0, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
            a1 = _v_plane(a1, pb, vt, 1, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
            a2 = _v_plane(a2, pb, vt, 2, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
            a3 = _v_plane(a3, pb, vt, 3, vsc_ptr, slot, hoff_sc, ssc_g, ssc_s, mask, DQ, G, OFF,
                          MAGIC, USE_DOT, INTERP)
    return m_i, l_t, a0, a1, a2, a3, k0, k1, k2, k3


@triton.jit
def plane_corr(k0, k1, k2, k3, i: tl.constexpr, NG: tl.constexpr):
    """The correction tile of plane i's group."""
    g: tl.constexpr = (i * NG) // 4
    if g == 0:
        return k0
    elif g == 1:
        return k1
    elif g == 2:
        return k2
    else:
        return k3


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
