"""INT2 history of two KV heads in one program (decode stage 1, DecodeConfig.pair_heads).

With few query heads per KV head (GQ <= R/2, e.g. 4 of R = 8 tensor-core columns) half of
every transposed score tile s^T [BN, R] of triton_hybrid_attn is padding, and every per-score
operation (scale FMAs, exponentials, weights) runs on it. Here rows r < R/2 are the query
heads of KV head h0 and rows r >= R/2 those of h1 = h0 + 1 (row r: head r // (R/2), query head
r % (R/2) of it), so the columns are real:

    s^T [BN, R] = sum_i C_i(h0) @ q'_i(h0) + C_i(h1) @ q'_i(h1)

where q'_i(hj) is the (plane, parity) operand of int2_query with the other head's rows zeroed
(block-diagonal along the columns). A group's (scale, min) differ per head: the tile is viewed
as [BN, 2, R/2] (tl.reshape of the dot's layout costs nothing) and scaled by the [BN, 2]
pairs of the two heads (one layout conversion for both). Values: acc^T [D/8, R] += C_i(h0)^T
@ w(h0) + C_i(h1)^T @ w(h1) with w(hj) the weights of the other head's columns zeroed. Per
step BN tokens of two heads: the bytes of 2 BN tokens of one head with the score tiles of BN.
Everything else (offsets, truncation-free accumulation, the state) as triton_hybrid_attn.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_hybrid_attn import (_block_slots, code_offset, fold16, group_count, group_scales,
                                 key_group_terms, load_or0, load_q_pair, mm, online_softmax_t, opaque, plane_step,
                                 setk, unpack_pair)


@triton.jit
def pair_query(q_vec, rmask, qk_scale, D: tl.constexpr, G: tl.constexpr, MAGIC: tl.constexpr,
               HALF: tl.constexpr):
    """(ops, sums): ops[j] the 8 q' operands of int2_query (index 2 i + e) with only head j's
    rows (r // (R/2) == j) kept, the other rows zero; sums per plane over all rows, [R]."""
    R: tl.constexpr = rmask.shape[0]
    KP: tl.constexpr = D // 8 if D >= 128 else 16
    r = tl.arange(0, R)
    ops = ()
    for j in tl.static_range(2):
        keep = rmask & (r // (R // 2) == j)
        head = ()
        for i in tl.static_range(4):
            for e in tl.static_range(2):
                head = head + (load_q_pair(q_vec, keep, qk_scale, i, e, D, KP, G, MAGIC, HALF),)
        ops = ops + (head,)
    sums = ()
    for i in tl.static_range(4):
        sums = sums + (tl.sum(ops[0][2 * i].to(tl.float32) + ops[0][2 * i + 1].to(tl.float32)
                              + ops[1][2 * i].to(tl.float32) + ops[1][2 * i + 1].to(tl.float32), 0),)
    return ops, sums


@triton.jit
def _pair_scales(gs_ptr, slot, hoff, s_slot, g: tl.constexpr, mask, PAIR: tl.constexpr, INTERP: tl.constexpr):
    """(scale, min) [BN, 2] of group g for the two heads (head offsets hoff = (h0, h1))."""
    sc0, mn0 = group_scales(gs_ptr, slot, hoff[0], s_slot, g, mask, PAIR, INTERP)
    sc1, mn1 = group_scales(gs_ptr, slot, hoff[1], s_slot, g, mask, PAIR, INTERP)
    return tl.join(sc0, sc1), tl.join(mn0, mn1)


@triton.jit
def _pair_scores(slot, p0, hi, ops, c0, qg, kpk_ptr, spk_s, hoff_pk, kgs_ptr, sgs_s, hoff_gs,
                 R: tl.constexpr, MASKED: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, GK: tl.constexpr,
                 PAIR: tl.constexpr, MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr,
                 HALF: tl.constexpr):
    """Scores s^T [BN, R] (base 2, scaled; -inf at masked positions) of the BN positions from
    p0 for both heads (hoff_pk / hoff_gs: (h0, h1) offsets). Keys' groups of a plane or more."""
    DH: tl.constexpr = D // 8
    KP: tl.constexpr = D // 8 if D >= 128 else 16
    NG_K: tl.constexpr = group_count(D, GK)
    PG_K: tl.constexpr = 4 // NG_K
    HR: tl.constexpr = R // 2
    kp = tl.arange(0, KP)
    if MASKED:
        mask = (p0 + tl.arange(0, BN)) < hi
        kmask = mask[:, None] & (kp < DH)[None, :]
    else:
        mask = None
        kmask = (kp < DH)[None, :] if KP > DH else None
    rows = slot[:, None] * spk_s + kp[None, :]
    kt0 = load_or0(kpk_ptr + rows + hoff_pk[0], kmask)  # [BN, KP] int16
    kt1 = load_or0(kpk_ptr + rows + hoff_pk[1], kmask)
    for g in tl.static_range(NG_K):
        if PG_K == 1:
            d = tl.zeros([BN, R], tl.float32)
        else:
            d = c0[g]
        for j in tl.static_range(PG_K):  # plane g PG_K + j
            ce, co = unpack_pair(kt0, g * PG_K + j, MAGIC, INTERP, HALF)
            d = mm(ce, ops[0][2 * (g * PG_K + j)], d, USE_DOT, INTERP)
            d = mm(co, ops[0][2 * (g * PG_K + j) + 1], d, USE_DOT, INTERP)
            ce, co = unpack_pair(kt1, g * PG_K + j, MAGIC, INTERP, HALF)
            d = mm(ce, ops[1][2 * (g * PG_K + j)], d, USE_DOT, INTERP)
            d = mm(co, ops[1][2 * (g * PG_K + j) + 1], d, USE_DOT, INTERP)
        sc, mn = _pair_scales(kgs_ptr, slot, hoff_gs, sgs_s, g, mask, PAIR, INTERP)
        if PG_K == 1:  # as triton_hybrid_attn._int2_scores: the offset leaves with the min
            mn = mn - (code_offset(MAGIC, HALF) / plane_step(g, MAGIC, HALF)) * sc
        d3 = tl.reshape(d, [BN, 2, HR])
        q3 = tl.reshape(qg[g], [2, HR])
        if g == 0:
            s3 = d3 * sc[:, :, None] + mn[:, :, None] * q3[None, :, :]
        else:
            s3 = d3 * sc[:, :, None] + s3
            s3 = mn[:, :, None] * q3[None, :, :] + s3
    s = tl.reshape(s3, [BN, R])
    if MASKED:
        s = tl.where(mask[:, None], s, float("-inf"))
    return s


@triton.jit
def _pair_accumulate(st, s, slot, p0, hi, vpk_ptr, spk_s, hoff_pk, vgs_ptr, sgs_s, hoff_gs,
                     MASKED: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, GV: tl.constexpr,
                     PAIR: tl.constexpr, MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """The value half of a step for both heads: online softmax of s^T [BN, R] over the tokens,
    then per (plane, parity) tile acc^T += C(h0)^T @ w(h0) + C(h1)^T @ w(h1), the pair of dots
    started from zero and added with one FMA (triton_hybrid_attn.fresh_dot). Values' groups
    of a plane or more."""
    DH: tl.constexpr = D // 8
    NG_V: tl.constexpr = group_count(D, GV)
    PG_V: tl.constexpr = 4 // NG_V
    m_i, l_t, pm, wsum, acc = st
    R: tl.constexpr = m_i.shape[0]
    HR: tl.constexpr = R // 2
    dh = tl.arange(0, DH)
    if MASKED:
        mask = (p0 + tl.arange(0, BN)) < hi
        vmask = mask[None, :]
    else:
        mask = None
        vmask = None
    cols = slot[None, :] * spk_s + dh[:, None]
    vt0 = load_or0(vpk_ptr + cols + hoff_pk[0], vmask)  # [DH, BN] int16
    vt1 = load_or0(vpk_ptr + cols + hoff_pk[1], vmask)
    p, alpha, m_new, l_t = online_softmax_t(s, m_i, l_t)
    second = (tl.arange(0, R) >= HR)[None, :]
    ones = tl.full([16, BN], 1.0, tl.float32).to(tl.bfloat16)
    p3 = tl.reshape(p, [BN, 2, HR])
    zero = tl.zeros([BN, R], tl.bfloat16)
    for g in tl.static_range(NG_V):
        sc, mn = _pair_scales(vgs_ptr, slot, hoff_gs, sgs_s, g, mask, PAIR, INTERP)
        w = tl.reshape(p3 * sc[:, :, None], [BN, R]).to(tl.bfloat16)
        pm = setk(pm, g, pm[g] * alpha[None, :] + fold16(tl.reshape(p3 * mn[:, :, None], [BN, R])))
        w0 = tl.where(second, zero, w)
        w1 = tl.where(second, w, zero)
        ws = mm(ones, w1, mm(ones, w0, tl.zeros([16, R], tl.float32), USE_DOT, INTERP), USE_DOT, INTERP)
        wsum = setk(wsum, g, wsum[g] * alpha[None, :] + opaque(ws, INTERP))  # each column in one of w0, w1
        for j in tl.static_range(PG_V):  # plane g PG_V + j
            ce0, co0 = unpack_pair(vt0, g * PG_V + j, MAGIC, INTERP, False)
            ce1, co1 = unpack_pair(vt1, g * PG_V + j, MAGIC, INTERP, False)
            za = tl.zeros([DH, R], tl.float32)
            de = mm(ce1, w1, mm(ce0, w0, za, USE_DOT, INTERP), USE_DOT, INTERP)
            do = mm(co1, w1, mm(co0, w0, za, USE_DOT, INTERP), USE_DOT, INTERP)
            acc = setk(acc, 2 * (g * PG_V + j), acc[2 * (g * PG_V + j)] * alpha[None, :] + opaque(de, INTERP))
            acc = setk(acc, 2 * (g * PG_V + j) + 1,
                       acc[2 * (g * PG_V + j) + 1] * alpha[None, :] + opaque(do, INTERP))
    return m_new, l_t, pm, wsum, acc


@triton.jit
def _pair_block(st, slot, p0, hi, ops, c0, qg, kpk_ptr, vpk_ptr, spk_s, hoff_pk, kgs_ptr, vgs_ptr, sgs_s, hoff_gs,
                MASKED: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                PAIR: tl.constexpr, MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr,
                HALF: tl.constexpr):
    """One step of BN positions from p0 for both heads: scores, then softmax and values."""
    R: tl.constexpr = st[0].shape[0]
    s = _pair_scores(slot, p0, hi, ops, c0, qg, kpk_ptr, spk_s, hoff_pk, kgs_ptr, sgs_s, hoff_gs, R, MASKED, BN,
                     D, GK, PAIR, MAGIC, USE_DOT, INTERP, HALF)
    return _pair_accumulate(st, s, slot, p0, hi, vpk_ptr, spk_s, hoff_pk, vgs_ptr, sgs_s, hoff_gs, MASKED, BN,
                            D, GV, PAIR, MAGIC, USE_DOT, INTERP)


@triton.jit
def pair_range(ops, qsums, st, lo, hi, r2t_row, kpk_ptr, vpk_ptr, spk_s, hoff_pk, kgs_ptr, vgs_ptr, sgs_s,
               hoff_gs, BN: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
               PAIR: tl.constexpr, MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr,
               SLOT64: tl.constexpr, HALF: tl.constexpr):
    """triton_hybrid_attn.int2_range for the two heads of a pair (ops / qsums: pair_query;
    hoff_pk / hoff_gs: the (h0, h1) offsets into the codes and the group scales): full
    steps without masks, each loading the next step's slots, then a masked tail."""
    c0, qg = key_group_terms(qsums, st[0].shape[0], BN, D, GK, MAGIC, HALF)
    hi_full = lo + (hi - lo) // BN * BN
    slot_n = _block_slots(lo, hi, r2t_row, True, BN, SLOT64)
    for p0 in range(lo, hi_full, BN):
        slot = slot_n
        slot_n = _block_slots(p0 + BN, hi, r2t_row, True, BN, SLOT64)
        st = _pair_block(st, slot, p0, hi, ops, c0, qg, kpk_ptr, vpk_ptr, spk_s, hoff_pk, kgs_ptr, vgs_ptr, sgs_s,
                         hoff_gs, False, BN, D, GK, GV, PAIR, MAGIC, USE_DOT, INTERP, HALF)
    if hi_full < hi:
        st = _pair_block(st, slot_n, hi_full, hi, ops, c0, qg, kpk_ptr, vpk_ptr, spk_s, hoff_pk, kgs_ptr, vgs_ptr,
                         sgs_s, hoff_gs, True, BN, D, GK, GV, PAIR, MAGIC, USE_DOT, INTERP, HALF)
    return st
