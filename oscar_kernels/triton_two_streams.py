"""Decode's INT2 range as two token streams in one score tile (GQA ratio R/2).

With Hq/H = 4 query heads per KV head the tensor-core tiles of triton_hybrid_attn have 8
columns of which 4 are padding, so half of every score / softmax / weight operation of a
block works on zeros. Here a block of BN positions is two streams of BN/2 (s = 0: the first
half, s = 1: the second) sharing one [BN/2, 8] tile, column c = 2 r + s for query head r:

    S[t, 2r + s] = sum_i scale_{t_s,i} (q'_r,i . c_{t_s,i}) + min_{t_s,i} sum(q'_r,i),
    t_s = p0 + s BN/2 + t,

computed as two chained dots per plane, the codes of stream s against q' operands that are
zero in the columns of the other stream (the same tensor-core work as one [BN, 8] tile). The
per-token scales of the two streams are joined into the column pairs (2r, 2r + 1) that one
thread holds in the tensor-core layout, so no select is needed. Each column keeps its own
online-softmax state (m, l, sums), and P@V takes w masked to the stream's columns:

    acc^T[:, 2r + s] = sum_t codes_s^T w[t, 2r + s],

and int2_two_streams_finish merges the two streams of each head like two splits:

    m = max(m_0, m_1), l = sum_s l_s 2^(m_s - m), o = sum_s o_s l_s 2^(m_s - m) / l.

Same algebra and offsets as triton_hybrid_attn; keys in one group per plane (G = D/4, the
calibration default), values in groups of a plane or more, magic unpack, tensor cores.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_hybrid_attn import (_block_slots, code_offset, fold16, fresh_dot, group_count, group_scales, load_or0,
                                 mm, online_softmax_t, opaque, plane_step, setk, unpack_pair)


@triton.jit
def pair_columns(x0, x1, R: tl.constexpr):
    """[N] vectors of the two streams -> [N, R] tile with column 2 r + s = x_s (every head r)."""
    xs = tl.join(x0, x1)  # [N, 2]
    return tl.reshape(tl.broadcast_to(xs[:, None, :], [xs.shape[0], R // 2, 2]), [xs.shape[0], R])


@triton.jit
def stream_of_column(R: tl.constexpr):
    """[R] stream index s = c % 2 of each column c."""
    return tl.arange(0, R) % 2


@triton.jit
def _ts_scores(slot0, slot1, mask0, mask1, qops0, qops1, qg, kpk_ptr, spk_s, hoff_pk, kgs_ptr, sgs_s, hoff_gs,
               R: tl.constexpr, MASKED: tl.constexpr, BH2: tl.constexpr, D: tl.constexpr, GK: tl.constexpr,
               PAIR: tl.constexpr, MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr,
               HALF: tl.constexpr):
    """Scores [BH2, R] (base 2, scaled; -inf where masked) of the two streams' positions."""
    DH: tl.constexpr = D // 8
    KP: tl.constexpr = D // 8 if D >= 128 else 16
    NG: tl.constexpr = 4  # one key group per plane (G = D/4)
    kp = tl.arange(0, KP)
    if MASKED:
        kmask0 = mask0[:, None] & (kp < DH)[None, :]
        kmask1 = mask1[:, None] & (kp < DH)[None, :]
    else:
        kmask0 = (kp < DH)[None, :] if KP > DH else None
        kmask1 = kmask0
    kt0 = load_or0(kpk_ptr + slot0[:, None] * spk_s + hoff_pk + kp[None, :], kmask0)
    kt1 = load_or0(kpk_ptr + slot1[:, None] * spk_s + hoff_pk + kp[None, :], kmask1)
    for g in tl.static_range(NG):
        ce, co = unpack_pair(kt0, g, MAGIC, INTERP, HALF)
        d = mm(ce, qops0[2 * g], tl.zeros([BH2, R], tl.float32), USE_DOT, INTERP)
        d = mm(co, qops0[2 * g + 1], d, USE_DOT, INTERP)
        ce, co = unpack_pair(kt1, g, MAGIC, INTERP, HALF)
        d = mm(ce, qops1[2 * g], d, USE_DOT, INTERP)
        d = mm(co, qops1[2 * g + 1], d, USE_DOT, INTERP)
        sc0, mn0 = group_scales(kgs_ptr, slot0, hoff_gs, sgs_s, g, mask0, PAIR, INTERP)
        sc1, mn1 = group_scales(kgs_ptr, slot1, hoff_gs, sgs_s, g, mask1, PAIR, INTERP)
        # d = (OFF / STEP_g) sum(q'_g) + q'_g . c: the offset leaves with the min
        off = code_offset(MAGIC, HALF) / plane_step(g, MAGIC, HALF)
        sc = pair_columns(sc0, sc1, R)
        mn = pair_columns(mn0 - off * sc0, mn1 - off * sc1, R)
        if g == 0:
            s = d * sc + mn * qg[g][None, :]
        else:
            s = d * sc + s
            s = mn * qg[g][None, :] + s
    if MASKED:
        s = tl.where(pair_columns(mask0, mask1, R), s, float("-inf"))
    return s


@triton.jit
def _ts_accumulate(st, s, slot0, slot1, mask0, mask1, vpk_ptr, spk_s, hoff_pk, vgs_ptr, sgs_s, hoff_gs,
                   MASKED: tl.constexpr, BH2: tl.constexpr, D: tl.constexpr, GV: tl.constexpr,
                   PAIR: tl.constexpr, MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """Online softmax of the block's scores over its positions (axis 0, per column) and the
    P@V dots of both streams, w masked to each stream's columns."""
    DH: tl.constexpr = D // 8
    NG: tl.constexpr = group_count(D, GV)
    PG: tl.constexpr = 4 // NG
    R: tl.constexpr = s.shape[1]
    m_i, l_t, pm, wsum, acc = st
    dh = tl.arange(0, DH)
    vt0 = load_or0(vpk_ptr + slot0[None, :] * spk_s + hoff_pk + dh[:, None], mask0[None, :] if MASKED else None)
    vt1 = load_or0(vpk_ptr + slot1[None, :] * spk_s + hoff_pk + dh[:, None], mask1[None, :] if MASKED else None)
    p, alpha, m_new, l_t = online_softmax_t(s, m_i, l_t)
    ones = tl.full([16, BH2], 1.0, tl.float32).to(tl.bfloat16)
    stream1 = (stream_of_column(R) == 1)[None, :]
    for g in tl.static_range(NG):
        sc0, mn0 = group_scales(vgs_ptr, slot0, hoff_gs, sgs_s, g, mask0, PAIR, INTERP)
        sc1, mn1 = group_scales(vgs_ptr, slot1, hoff_gs, sgs_s, g, mask1, PAIR, INTERP)
        w = (p * pair_columns(sc0, sc1, R)).to(tl.bfloat16)
        pm = setk(pm, g, pm[g] * alpha[None, :] + fold16(p * pair_columns(mn0, mn1, R)))
        wsum = setk(wsum, g, fresh_dot(ones, w, wsum[g], alpha[None, :], USE_DOT, INTERP))
        w0 = tl.where(stream1, 0.0, w).to(tl.bfloat16)
        w1 = tl.where(stream1, w, 0.0).to(tl.bfloat16)
        for j in tl.static_range(PG):
            acc = _v_streams(acc, vt0, vt1, w0, w1, alpha, g * PG + j, MAGIC, USE_DOT, INTERP)
    return m_new, l_t, pm, wsum, acc


@triton.jit
def _v_streams(acc, vt0, vt1, w0, w1, alpha, i: tl.constexpr, MAGIC: tl.constexpr, USE_DOT: tl.constexpr,
               INTERP: tl.constexpr):
    """acc with plane i's even / odd tiles rescaled by alpha plus codes_0^T @ w_0 + codes_1^T
    @ w_1 (one chain from zero per tile)."""
    DH: tl.constexpr = vt0.shape[0]
    R: tl.constexpr = w0.shape[1]
    ce0, co0 = unpack_pair(vt0, i, MAGIC, INTERP, False)
    ce1, co1 = unpack_pair(vt1, i, MAGIC, INTERP, False)
    zero = tl.zeros([DH, R], tl.float32)
    de = opaque(mm(ce1, w1, mm(ce0, w0, zero, USE_DOT, INTERP), USE_DOT, INTERP), INTERP)
    do = opaque(mm(co1, w1, mm(co0, w0, zero, USE_DOT, INTERP), USE_DOT, INTERP), INTERP)
    acc = setk(acc, 2 * i, acc[2 * i] * alpha[None, :] + de)
    return setk(acc, 2 * i + 1, acc[2 * i + 1] * alpha[None, :] + do)


@triton.jit
def int2_two_streams_range(qops0, qops1, qsums, st, lo, hi, r2t_row, kpk_ptr, vpk_ptr, spk_s, hoff_pk,
                           kgs_ptr, vgs_ptr, sgs_s, hoff_gs, BN: tl.constexpr, D: tl.constexpr,
                           GK: tl.constexpr, GV: tl.constexpr, PAIR: tl.constexpr, MAGIC: tl.constexpr,
                           USE_DOT: tl.constexpr, INTERP: tl.constexpr, SLOT64: tl.constexpr,
                           HALF: tl.constexpr):
    """int2_range for two streams: blocks of BN positions [p0, p0 + BN), stream s the half
    from p0 + s BN/2. qops_s: the q' operands of stream s (int2_query with the other stream's
    columns masked), qsums: the columns' sums over both (every column its own head)."""
    BH2: tl.constexpr = BN // 2
    qg = ()  # min multiplier sum(q'_g) of each one-plane key group
    for g in tl.static_range(4):
        qg = qg + (qsums[g] * plane_step(g, MAGIC, HALF),)
    hi_full = lo + (hi - lo) // BN * BN
    slot0_n = _block_slots(lo, hi, r2t_row, True, BH2, SLOT64)
    slot1_n = _block_slots(lo + BH2, hi, r2t_row, True, BH2, SLOT64)
    for p0 in range(lo, hi_full, BN):
        slot0 = slot0_n
        slot1 = slot1_n
        slot0_n = _block_slots(p0 + BN, hi, r2t_row, True, BH2, SLOT64)
        slot1_n = _block_slots(p0 + BN + BH2, hi, r2t_row, True, BH2, SLOT64)
        s = _ts_scores(slot0, slot1, None, None, qops0, qops1, qg, kpk_ptr, spk_s, hoff_pk, kgs_ptr, sgs_s,
                       hoff_gs, st[0].shape[0], False, BH2, D, GK, PAIR, MAGIC, USE_DOT, INTERP, HALF)
        st = _ts_accumulate(st, s, slot0, slot1, None, None, vpk_ptr, spk_s, hoff_pk, vgs_ptr, sgs_s, hoff_gs,
                            False, BH2, D, GV, PAIR, MAGIC, USE_DOT, INTERP)
    if hi_full < hi:
        pos = hi_full + tl.arange(0, BH2)
        mask0 = pos < hi
        mask1 = (pos + BH2) < hi
        s = _ts_scores(slot0_n, slot1_n, mask0, mask1, qops0, qops1, qg, kpk_ptr, spk_s, hoff_pk, kgs_ptr,
                       sgs_s, hoff_gs, st[0].shape[0], True, BH2, D, GK, PAIR, MAGIC, USE_DOT, INTERP, HALF)
        st = _ts_accumulate(st, s, slot0_n, slot1_n, mask0, mask1, vpk_ptr, spk_s, hoff_pk, vgs_ptr, sgs_s,
                            hoff_gs, True, BH2, D, GV, PAIR, MAGIC, USE_DOT, INTERP)
    return st


@triton.jit
def merge_column_pairs(x):
    """[..., R] -> ([..., R/2], [..., R/2]): the stream-0 and stream-1 columns of each head."""
    shape: tl.constexpr = x.shape
    if len(shape) == 1:
        return tl.split(tl.reshape(x, [shape[0] // 2, 2]))
    else:
        return tl.split(tl.reshape(x, [shape[0], shape[1] // 2, 2]))


@triton.jit
def int2_two_streams_finish(st, D: tl.constexpr, GV: tl.constexpr, MAGIC: tl.constexpr):
    """(outs, m, l) per query head (R/2 columns): the two streams' normalised tiles (as
    int2_finish) merged with their softmax weights."""
    NG: tl.constexpr = group_count(D, GV)
    PG: tl.constexpr = 4 // NG
    OFF: tl.constexpr = 128.0 if MAGIC else 0.0
    m_i, l_t, pm, wsum, acc = st
    l = tl.sum(l_t, 0)
    m0, m1 = merge_column_pairs(m_i)
    l0, l1 = merge_column_pairs(l)
    m = tl.maximum(m0, m1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    e0 = tl.exp2(m0 - m_safe)  # each stream's weight in the head's common frame
    e1 = tl.exp2(m1 - m_safe)
    lh = l0 * e0 + l1 * e1
    inv = 1.0 / tl.where(lh > 0, lh, 1.0)
    outs = ()
    for i in tl.static_range(4):
        for e in tl.static_range(2):
            a = acc[2 * i + e]
            a = ((a - OFF * (tl.sum(wsum[i // PG], 0) * (1.0 / 16))[None, :]) * (1.0 / plane_step(i, MAGIC, False))
                 + tl.sum(pm[i // PG], 0)[None, :])
            a0, a1 = merge_column_pairs(a)  # sums (not yet normalised) of the two streams
            outs = outs + ((a0 * e0[None, :] + a1 * e1[None, :])
                           * inv[None, :],)
    return outs, m, lh
