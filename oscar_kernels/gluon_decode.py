"""Stage 1 of the decode over the INT2 history as a warp-specialised Gluon kernel (sm_90).

Same partial as ``triton_decode._decode_stage1``'s INT2 programs (sp >= 1) for eight KV
heads of one request and split per CTA (they read the same positions, so their slots are
shared), computed by two partitions:

- scores (worker, 4 warps, two KV heads per warp): the score tile [tokens, 8] of a warp
  holds both heads' query rows (4 each, at most 4 query heads per KV head): the keys'
  codes of the two heads side by side along the dot's K axis against block-diagonal q'
  operands, so no column of the tile is padding. Per key group g (one per plane, the fp16
  magic unpack of ``triton_hybrid_attn``)
      s^T[t, c] = sum_g sc_{t,g} (c_{t,g} . q'_{g,c}) + (mn_{t,g} - OFF/STEP_g sc_{t,g}) qg_{g,c}
  with each column's head's (scale, min') pair; positions >= hi masked; base-2 online
  softmax over the block's tokens; it hands w = fp16(p * sc_v * W_SCALE) [tokens, 8] and
  alpha = 2^(m_old - m_new) [8] to the values partition through a shared-memory ring guarded
  by mbarriers, and keeps l = sum p and pm = sum p mn_v.
- values (default, 8 warps, one KV head per warp): issues every copy (slot indices three
  blocks ahead; codes and scale words two blocks ahead, cp.async), converts each block's
  float8 (scale, min) pairs once per token into float32 records one block ahead of the
  scores partition, and per block
      acc_i <- acc_i * alpha + C_i^T @ w        (8 (plane, parity) tiles [D/8, 8 columns],
  the four columns of the other head of its pair unused), then
  o~ = ((acc_i - OFF sum w) / (STEP_i W_SCALE) + pm) / l.

W_SCALE keeps the float16 weights p * scale in range (p <= 1, scale <= 448: at most
28,672; weights below float16's subnormals, 6e-8, are dropped: relative to the block's
largest weight, which is at least scale_min * 64, such a weight is negligible).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier, mma_v2

from .triton_common import INTERPRET, float8_words_view, needs_int64_slots

JV = gl.constexpr(8)  # KV heads per CTA: one per warp of the values partition
JS = gl.constexpr(4)  # warps of the scores partition: two KV heads each
W_SCALE = gl.constexpr(64.0)  # the float16 P@V weights are p * scale * W_SCALE (see module doc)
# scores partition: [JS, BN, 8] score tiles, column c = (head 2 w + c // 4, query row c % 4)
MMA_S = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
DOT_AS = gl.constexpr(gl.DotOperandLayout(0, MMA_S, 2))
DOT_BS = gl.constexpr(gl.DotOperandLayout(1, MMA_S, 2))
# the same tiles viewed as [JS, BN, 2 (head of the pair), 4 (query row)]
MMA4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 8, 0, 0], [0, 16, 0, 0], [0, 32, 0, 0]],
    lane_bases=[[0, 0, 0, 2], [0, 0, 1, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 64, 2, 4]))
PAIR4 = gl.constexpr(gl.SliceLayout(3, MMA4))  # [JS, BN, 2]: per token and head of the pair
STATE4 = gl.constexpr(gl.SliceLayout(1, MMA4))  # [JS, 2, 4]: per column
# [JS, BN, 2, 2] (scale, min) pairs of each token and head of the pair, held by the threads
# of the columns of that head (PAIR4 plus the pair in one thread: one 8-byte load per row)
PAIRS_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 8, 0, 0], [0, 16, 0, 0], [0, 32, 0, 0]],
    lane_bases=[[0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 64, 2, 2]))
# values partition: [JV, D/8, 8] accumulator tiles
MMA_V = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[8, 1, 1], instr_shape=[1, 16, 8]))
DOT_AV = gl.constexpr(gl.DotOperandLayout(0, MMA_V, 2))
DOT_BV = gl.constexpr(gl.DotOperandLayout(1, MMA_V, 2))
COLS_V = gl.constexpr(gl.SliceLayout(1, MMA_V))  # [JV, 8]
# cp.async (values partition, 8 warps): V code rows [JV, BN, 16] int16, 16 bytes per thread;
# K code rows of head pairs [JS, BN, 32] (int16 16 * h + p: byte pair p of head 2 w + h)
V_CODES_CP = gl.constexpr(gl.BlockedLayout([1, 1, 8], [1, 16, 2], [8, 1, 1], [2, 1, 0]))
K_CODES_CP = gl.constexpr(gl.BlockedLayout([1, 1, 8], [1, 8, 4], [4, 2, 1], [2, 1, 0]))
# scale words [4 JV, BN] (row k JV + j: word k of head j's records; k < 3 used) and the
# [JV, BN] planes converted from them: tokens t and t + 32 per thread, one warp per head
WORDS_CP = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [8, 1], [1, 0]))
# cp.async of a block's [BN] slot indices: 16 bytes per thread
SLOTS_CP = gl.constexpr(gl.BlockedLayout([4], [32], [8], [0]))
K_CODES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 4, [2, 1, 0]))
V_CODES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 2, 4, [2, 1, 0]))
PAIR_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
SLOT_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
FLAT_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
W_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
COL_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))

# fp16 magic unpack of plane i's even / odd bytes: 1024 + 4^i code (see triton_hybrid_attn),
# keys and values alike
_HALF0 = gl.constexpr("{ .reg .b32 t, k; mov.b32 k, 0x64006400; lop3.b32 $0, $2, 0x00030003, k, 0xEA; "
                      "shr.b32 t, $2, 8; lop3.b32 $1, t, 0x00030003, k, 0xEA; }")
_HALF1 = gl.constexpr("{ .reg .b32 t, k; mov.b32 k, 0x64006400; lop3.b32 $0, $2, 0x000C000C, k, 0xEA; "
                      "shr.b32 t, $2, 8; lop3.b32 $1, t, 0x000C000C, k, 0xEA; }")
_HALF2 = gl.constexpr("{ .reg .b32 t, k; mov.b32 k, 0x64006400; lop3.b32 $0, $2, 0x00300030, k, 0xEA; "
                      "shr.b32 t, $2, 8; lop3.b32 $1, t, 0x00300030, k, 0xEA; }")
_HALF3 = gl.constexpr("{ .reg .b32 t, k; mov.b32 k, 0x64006400; lop3.b32 $0, $2, 0x00C000C0, k, 0xEA; "
                      "shr.b32 t, $2, 8; lop3.b32 $1, t, 0x00C000C0, k, 0xEA; }")
# two float8_e4m3fn (scale, min) pairs in the 32 bits from bit $6 of the 64-bit ($5:$4)
# -> four float32 (scale, min of the low pair, then of the high pair)
_FP8_TWO_PAIRS = gl.constexpr(
    "{ .reg .b32 h, g, w; .reg .b16 a, c, lo, hi; shf.r.wrap.b32 w, $4, $5, $6; mov.b32 {a, c}, w; "
    "cvt.rn.f16x2.e4m3x2 h, a; cvt.rn.f16x2.e4m3x2 g, c; mov.b32 {lo, hi}, h; cvt.f32.f16 $0, lo; "
    "cvt.f32.f16 $1, hi; mov.b32 {lo, hi}, g; cvt.f32.f16 $2, lo; cvt.f32.f16 $3, hi; }")


@gluon.jit
def _unpack_codes(x, i: gl.constexpr):
    """int16 byte pairs -> float16 (even, odd) codes of plane i: 1024 + 4^i code."""
    if i == 0:
        asm: gl.constexpr = _HALF0
    elif i == 1:
        asm: gl.constexpr = _HALF1
    elif i == 2:
        asm: gl.constexpr = _HALF2
    else:
        asm: gl.constexpr = _HALF3
    return gl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)


@gluon.jit
def _two_pairs(lo_word, hi_word, shift):
    return gl.inline_asm_elementwise(_FP8_TWO_PAIRS, "=r,=r,=r,=r,r,r,r", [lo_word, hi_word, shift],
                                     dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)


@gluon.jit
def _key_step(i: gl.constexpr):
    if i == 0:
        return 1.0
    elif i == 1:
        return 4.0
    elif i == 2:
        return 16.0
    else:
        return 64.0


@gluon.jit
def _request_split(b, sp, rows_ptr, lens_ptr, r2t_ptr, r2t_stride, sop_ptr, pos_of_ptr, page_size, vf_ptr,
                   NS, MIN_CHUNK: gl.constexpr, S: gl.constexpr, W: gl.constexpr, BN: gl.constexpr):
    """(row, lo, hi): request b's table row and INT2 split sp of [S_b, ring_lo)
    (triton_hybrid_attn.request_layout and triton_decode.int2_split)."""
    row = gl.load(rows_ptr + b).to(gl.int64)
    n = gl.load(lens_ptr + b).to(gl.int64)
    if S > 0:
        first = gl.load(r2t_ptr + row * r2t_stride).to(gl.int64)
        page = first // page_size
        c = gl.load(sop_ptr + page).to(gl.int64)
        owner = gl.load(pos_of_ptr + gl.maximum(c, 0)).to(gl.int64)
        s_b = gl.where((c >= 0) & (owner == page), gl.minimum(n, S), 0)
    else:
        s_b = n * 0
    if W > 0:
        vf = gl.load(vf_ptr + row).to(gl.int64)
        ring_lo = gl.minimum(gl.maximum(gl.maximum(n - W, vf), s_b), n)
    else:
        ring_lo = n
    length = ring_lo - s_b
    ns = gl.minimum(gl.maximum((length + MIN_CHUNK - 1) // MIN_CHUNK, 1), NS)
    chunk = ((length + ns - 1) // ns + BN - 1) // BN * BN
    lo = s_b + sp * chunk
    return row, lo.to(gl.int32), gl.minimum(lo + chunk, ring_lo).to(gl.int32)


@gluon.jit
def _copy_slots(slotbuf, r2t_row, p0, hi, BN: gl.constexpr):
    """cp.async of the slots [BN] of positions p0.. into slotbuf (0 at positions >= hi)."""
    pos = p0 + gl.arange(0, BN, layout=SLOTS_CP)
    async_copy.async_copy_global_to_shared(slotbuf, r2t_row + pos, mask=pos < hi)


@gluon.jit
def _copy_block(kbuf, vbuf, wdbuf, slots, h0, kpk_ptr, vpk_ptr, spk_s, spk_h, kgs_ptr, sgs_s, sgs_h,
                SLOT64: gl.constexpr):
    """cp.async of one block at the slots in shared memory ``slots`` [BN]: the K code rows of
    the head pairs [JS, BN, 32] (kbuf), the V code rows [JV, BN, 16] (vbuf), and the three
    int32 words [3 JV, BN] (row k JV + j: word k of head j) that hold each token's five
    (scale, min) pairs (pair index P = slot sgs_s + h sgs_h, words P >> 1 .. (P >> 1) + 2)."""
    slot_k = slots.load(gl.SliceLayout(0, gl.SliceLayout(2, K_CODES_CP)))
    slot_v = slots.load(gl.SliceLayout(0, gl.SliceLayout(2, V_CODES_CP)))
    slot_w = slots.load(gl.SliceLayout(0, WORDS_CP))
    if SLOT64:
        slot_k = slot_k.to(gl.int64)
        slot_v = slot_v.to(gl.int64)
        slot_w = slot_w.to(gl.int64)
    wk = gl.arange(0, JS, layout=gl.SliceLayout(1, gl.SliceLayout(2, K_CODES_CP)))
    kk = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, K_CODES_CP)))
    head_k = h0 + 2 * wk[:, None, None] + kk[None, None, :] // 16
    async_copy.async_copy_global_to_shared(
        kbuf, kpk_ptr + head_k * spk_h + slot_k[None, :, None] * spk_s + (kk % 16)[None, None, :])
    jv = gl.arange(0, JV, layout=gl.SliceLayout(1, gl.SliceLayout(2, V_CODES_CP)))
    kv = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_CODES_CP)))
    async_copy.async_copy_global_to_shared(
        vbuf, vpk_ptr + (h0 + jv)[:, None, None] * spk_h + slot_v[None, :, None] * spk_s + kv[None, None, :])
    gj = gl.arange(0, 4 * JV, layout=gl.SliceLayout(1, WORDS_CP))
    w0 = (slot_w[None, :] * sgs_s + (h0 + gj % JV)[:, None] * sgs_h) >> 1
    async_copy.async_copy_global_to_shared(wdbuf, kgs_ptr + w0 + (gj // JV)[:, None], mask=(gj < 3 * JV)[:, None])


@gluon.jit
def _convert_scales(wdbuf, fbuf, vsbuf, slots, h0, sgs_s, sgs_h, SLOT64: gl.constexpr):
    """The copied scale words of one block -> float32: in fbuf [JV, BN, 8] each token's
    scale_g, min'_g of the key groups g = 0..3 (min' = min - OFF/STEP_g scale: the fp16
    unpacking offset, see triton_hybrid_attn), in vsbuf [JV, BN, 2] the values' scale
    (times W_SCALE) and min. One token per thread and word."""
    slot_w = slots.load(gl.SliceLayout(0, WORDS_CP))
    if SLOT64:
        slot_w = slot_w.to(gl.int64)
    jw = gl.arange(0, JV, layout=gl.SliceLayout(1, WORDS_CP))
    par = ((slot_w[None, :] * sgs_s + (h0 + jw)[:, None] * sgs_h) & 1).to(gl.int32) * 16
    x0 = wdbuf.slice(0, JV).load(WORDS_CP)
    x1 = wdbuf.slice(JV, JV).load(WORDS_CP)
    x2 = wdbuf.slice(2 * JV, JV).load(WORDS_CP)
    sc0, mn0, sc1, mn1 = _two_pairs(x0, x1, par)
    sc2, mn2, sc3, mn3 = _two_pairs(x1, x2, par)
    sv, mv, _u, _v = _two_pairs(x2, x2, par)
    k01 = gl.join(gl.join(sc0, mn0 - 1024.0 * sc0), gl.join(sc1, mn1 - 256.0 * sc1))
    k23 = gl.join(gl.join(sc2, mn2 - 64.0 * sc2), gl.join(sc3, mn3 - 16.0 * sc3))
    # [JV, BN, (scale, min'), g & 1, g >> 1] -> [JV, BN, 8] in the order (scale_0, min'_0, scale_1, ...)
    fbuf.store(gl.reshape(gl.permute(gl.join(k01, k23), [0, 1, 4, 3, 2]), [JV, sc0.shape[1], 8]))
    vsbuf.store(gl.join(sv * W_SCALE, mv))


@gluon.jit
def _query_operand(qr_ptr, q_base, sqr_h, h0, scale, i: gl.constexpr, e: gl.constexpr, GQ: gl.constexpr):
    """Block-diagonal q'^T operand of (plane i, parity e): [JS, 32, 8] float16, element
    (w, 16 h + p, c) = q'[head 2 w + h, query row c % 4, channel 32 i + 2 p + e] * scale / STEP_i
    where h == c // 4 (and c % 4 < GQ), else 0."""
    w = gl.arange(0, JS, layout=gl.SliceLayout(1, gl.SliceLayout(2, DOT_BS)))
    k = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, DOT_BS)))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, DOT_BS)))
    hq = (h0 + 2 * w[:, None, None] + c[None, None, :] // 4) * GQ + c[None, None, :] % 4
    ptrs = qr_ptr + q_base + hq.to(gl.int64) * sqr_h + (i * 32 + 2 * (k % 16) + e)[None, :, None]
    live = ((k[None, :, None] // 16) == (c[None, None, :] // 4)) & ((c[None, None, :] % 4) < GQ) & (w >= 0)[:, None, None]
    qt = gl.load(ptrs, mask=live, other=0.0)
    return (qt.to(gl.float32) * (scale / _key_step(i))).to(gl.float16)


@gluon.jit
def _column_sums(q_even, q_odd, step: gl.constexpr):
    """The min multiplier of a key group per column, [JS, 2, 4] (STATE4): the sum of what
    its dots see (q'/STEP_g, both parities) times STEP_g."""
    t = gl.sum(q_even.to(gl.float32) + q_odd.to(gl.float32), 1)  # [JS, 8]
    t = gl.convert_layout(t, gl.SliceLayout(1, MMA_S))
    return gl.convert_layout(gl.reshape(t, [JS, 2, 4]), STATE4) * step


@gluon.jit
def _pair_scales(pairs, g: gl.constexpr):
    """(scale, min) [JS, BN, 2] (PAIR4: per token and head of the pair) of group g from a
    [JS, BN, 2, 2 * groups] shared view, one 8-byte load per score row."""
    sc, mn = gl.split(pairs.slice(2 * g, 2, dim=3).load(PAIRS_L))
    return gl.convert_layout(sc, PAIR4, assert_trivial=True), gl.convert_layout(mn, PAIR4, assert_trivial=True)


@gluon.jit
def _score_block(blk, kbuf, fbuf, vsbuf, wbuf, abuf, kready, kfree, wready, wfree, qops, qg, m_i, l_i, pm, lo, hi,
                 MASKED: gl.constexpr, BN: gl.constexpr, NB: gl.constexpr, NW: gl.constexpr):
    """One block of the scores partition: scores, online softmax, the (w, alpha) handoff."""
    st = blk % NB
    mbarrier.wait(kready.index(st), (blk // NB) & 1)
    kc = kbuf.index(st).load(DOT_AS)  # [JS, BN, 32] int16 byte pairs of the head pair
    kp = fbuf.index(st).reshape([JS, 2, BN, 8]).permute([0, 2, 1, 3])  # [JS, BN, 2, 8]
    s = gl.zeros([JS, BN, 2, 4], gl.float32, MMA4)
    for i in gl.static_range(4):
        ce, co = _unpack_codes(kc, i)
        d = mma_v2(ce, qops[2 * i], gl.zeros([JS, BN, 8], gl.float32, MMA_S))
        d = mma_v2(co, qops[2 * i + 1], d)
        d = gl.convert_layout(gl.reshape(d, [JS, BN, 2, 4]), MMA4, assert_trivial=True)
        sc, mn = _pair_scales(kp, i)
        s = d * gl.expand_dims(sc, 3) + s
        s = gl.expand_dims(mn, 3) * gl.expand_dims(qg[i], 1) + s
    sv, mv = _pair_scales(vsbuf.index(st).reshape([JS, 2, BN, 2]).permute([0, 2, 1, 3]), 0)
    mbarrier.arrive(kfree.index(st))
    if MASKED:
        t = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, PAIR4)))
        valid = ((lo + blk * BN + t) < hi)[None, :, None]
        sv = gl.where(valid, sv, 0.0)
        mv = gl.where(valid, mv, 0.0)
        s = gl.where(gl.expand_dims(valid, 3), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    w = (p * gl.expand_dims(sv, 3)).to(gl.float16)
    l_i = l_i * alpha + gl.sum(p, 1)
    pm = pm * alpha + gl.sum(p * gl.expand_dims(mv, 3), 1)
    w = gl.convert_layout(gl.reshape(w, [JS, BN, 8]), MMA_S, assert_trivial=True)
    alpha = gl.reshape(alpha, [JS, 8])
    wb = blk % NW
    mbarrier.wait(wfree.index(wb), ((blk // NW) & 1) ^ 1)
    # each head-pair's tiles twice: row 2 w + h of the [JV, ...] views is head 2 w + h's
    wbuf.index(wb).permute([0, 2, 3, 1]).store(gl.join(w, w))
    abuf.index(wb).permute([0, 2, 1]).store(gl.join(alpha, alpha))
    mbarrier.arrive(wready.index(wb))
    return m_new, l_i, pm


@gluon.jit
def _scores_partition(kbuf, fbuf, vsbuf, wbuf, abuf, finbuf, kready, kfree, wready, wfree, fin,
                      qr_ptr, sqr_b, sqr_h, lo, hi, b, h0, mid_lse_ptr, lse_base, lse_row_stride, qk_scale,
                      GQ: gl.constexpr, BN: gl.constexpr, NB: gl.constexpr, NW: gl.constexpr):
    """Scores of every block of [lo, hi) against the eight heads' q' rows; see module doc."""
    q_base = b * sqr_b
    q00 = _query_operand(qr_ptr, q_base, sqr_h, h0, qk_scale, 0, 0, GQ)
    q01 = _query_operand(qr_ptr, q_base, sqr_h, h0, qk_scale, 0, 1, GQ)
    q10 = _query_operand(qr_ptr, q_base, sqr_h, h0, qk_scale, 1, 0, GQ)
    q11 = _query_operand(qr_ptr, q_base, sqr_h, h0, qk_scale, 1, 1, GQ)
    q20 = _query_operand(qr_ptr, q_base, sqr_h, h0, qk_scale, 2, 0, GQ)
    q21 = _query_operand(qr_ptr, q_base, sqr_h, h0, qk_scale, 2, 1, GQ)
    q30 = _query_operand(qr_ptr, q_base, sqr_h, h0, qk_scale, 3, 0, GQ)
    q31 = _query_operand(qr_ptr, q_base, sqr_h, h0, qk_scale, 3, 1, GQ)
    qops = (q00, q01, q10, q11, q20, q21, q30, q31)
    qg = (_column_sums(q00, q01, 1.0), _column_sums(q10, q11, 4.0), _column_sums(q20, q21, 16.0),
          _column_sums(q30, q31, 64.0))
    m_i = gl.full([JS, 2, 4], float("-inf"), gl.float32, STATE4)
    l_i = gl.zeros([JS, 2, 4], gl.float32, STATE4)
    pm = gl.zeros([JS, 2, 4], gl.float32, STATE4)
    nfull = (hi - lo) // BN
    for blk in range(nfull):
        m_i, l_i, pm = _score_block(blk, kbuf, fbuf, vsbuf, wbuf, abuf, kready, kfree, wready, wfree, qops, qg,
                                    m_i, l_i, pm, lo, hi, False, BN, NB, NW)
    if nfull * BN < hi - lo:
        m_i, l_i, pm = _score_block(nfull, kbuf, fbuf, vsbuf, wbuf, abuf, kready, kfree, wready, wfree, qops, qg,
                                    m_i, l_i, pm, lo, hi, True, BN, NB, NW)
    # the values partition's normalisation (each head pair's row twice), and the partial's lse
    l8 = gl.reshape(l_i, [JS, 8])
    pm8 = gl.reshape(pm, [JS, 8])
    finbuf.index(0).permute([0, 2, 1]).store(gl.join(l8, l8))
    finbuf.index(1).permute([0, 2, 1]).store(gl.join(pm8, pm8))
    mbarrier.arrive(fin)
    lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    w = gl.arange(0, JS, layout=gl.SliceLayout(1, gl.SliceLayout(2, STATE4)))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, STATE4)))
    r = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, STATE4)))
    hq = (2 * w[:, None, None] + h[None, :, None]) * GQ + r[None, None, :]
    gl.store(mid_lse_ptr + lse_base + hq.to(gl.int64) * lse_row_stride, lse,
             mask=(r < GQ)[None, None, :] & (w >= 0)[:, None, None] & (h >= 0)[None, :, None])


@gluon.jit
def _values_partition(kbuf, vbuf, wdbuf, slotbuf, fbuf, vsbuf, wbuf, abuf, finbuf, kready, kfree, wready, wfree,
                      fin, r2t_row, lo, hi, h0, kpk_ptr, vpk_ptr, spk_s, spk_h, kgs_ptr, sgs_s, sgs_h,
                      mid_o_ptr, o_base, o_row_stride,
                      GQ: gl.constexpr, BN: gl.constexpr, NB: gl.constexpr, NW: gl.constexpr, SLOT64: gl.constexpr):
    """Copies of every block (slot indices three blocks ahead, codes and scale words two),
    the scale conversion one block ahead of the scores partition, and the value dots; see
    module doc."""
    za = gl.zeros([JV, 16, 8], gl.float32, MMA_V)
    a00 = za
    a01 = za
    a10 = za
    a11 = za
    a20 = za
    a21 = za
    a30 = za
    a31 = za
    ws = za  # sum of w, as the dot of a ones tile with w (every row the same)
    ones = gl.full([JV, 16, BN], 1.0, gl.float16, DOT_AV)
    nblk = gl.cdiv(hi - lo, BN)
    gl.static_assert(NB == 3, "the copy schedule below assumes three stages")
    # prologue: the slots of blocks 0..2, then the copies of blocks 0 and 1; block 0's scales
    for k in gl.static_range(3):
        _copy_slots(slotbuf.index(k), r2t_row, lo + k * BN, hi, BN)
    async_copy.commit_group()
    async_copy.wait_group(0)
    for k in gl.static_range(2):
        if k < nblk:
            _copy_block(kbuf.index(k), vbuf.index(k), wdbuf.index(k), slotbuf.index(k), h0, kpk_ptr, vpk_ptr,
                        spk_s, spk_h, kgs_ptr, sgs_s, sgs_h, SLOT64)
        async_copy.commit_group()
    async_copy.wait_group(1)
    if nblk > 0:
        _convert_scales(wdbuf.index(0), fbuf.index(0), vsbuf.index(0), slotbuf.index(0), h0, sgs_s, sgs_h, SLOT64)
        mbarrier.arrive(kready.index(0))
    for blk in range(nblk):
        # landed: everything issued one iteration ago (block blk + 1's codes and words,
        # block blk + 2's slots)
        async_copy.wait_group(0)
        nxt = blk + 2
        if nxt < nblk:
            # stage nxt % 3: free once the scores partition has read block nxt - 3
            mbarrier.wait(kfree.index(nxt % NB), ((nxt // NB) & 1) ^ 1)
            _copy_block(kbuf.index(nxt % NB), vbuf.index(nxt % NB), wdbuf.index(nxt % NB), slotbuf.index(nxt % 4),
                        h0, kpk_ptr, vpk_ptr, spk_s, spk_h, kgs_ptr, sgs_s, sgs_h, SLOT64)
        if nxt + 1 < nblk:
            _copy_slots(slotbuf.index((nxt + 1) % 4), r2t_row, lo + (nxt + 1) * BN, hi, BN)
        async_copy.commit_group()
        if blk + 1 < nblk:
            _convert_scales(wdbuf.index((blk + 1) % NB), fbuf.index((blk + 1) % NB), vsbuf.index((blk + 1) % NB),
                            slotbuf.index((blk + 1) % 4), h0, sgs_s, sgs_h, SLOT64)
            mbarrier.arrive(kready.index((blk + 1) % NB))
        vc = vbuf.index(blk % NB).permute([0, 2, 1]).load(DOT_AV)  # [JV, 16, BN] int16
        wb = blk % NW
        mbarrier.wait(wready.index(wb), (blk // NW) & 1)
        w = wbuf.index(wb).reshape([JV, BN, 8]).load(DOT_BV)  # [JV, BN, 8] float16
        alpha = gl.expand_dims(abuf.index(wb).reshape([JV, 8]).load(COLS_V), 1)
        mbarrier.arrive(wfree.index(wb))
        zero = gl.zeros([JV, 16, 8], gl.float32, MMA_V)
        ws = ws * alpha + mma_v2(ones, w, zero)
        ce, co = _unpack_codes(vc, 0)
        a00 = a00 * alpha + mma_v2(ce, w, zero)
        a01 = a01 * alpha + mma_v2(co, w, zero)
        ce, co = _unpack_codes(vc, 1)
        a10 = a10 * alpha + mma_v2(ce, w, zero)
        a11 = a11 * alpha + mma_v2(co, w, zero)
        ce, co = _unpack_codes(vc, 2)
        a20 = a20 * alpha + mma_v2(ce, w, zero)
        a21 = a21 * alpha + mma_v2(co, w, zero)
        ce, co = _unpack_codes(vc, 3)
        a30 = a30 * alpha + mma_v2(ce, w, zero)
        a31 = a31 * alpha + mma_v2(co, w, zero)
    mbarrier.wait(fin, 0)
    l_i = gl.expand_dims(finbuf.index(0).reshape([JV, 8]).load(COLS_V), 1)
    pm = gl.expand_dims(finbuf.index(1).reshape([JV, 8]).load(COLS_V), 1)
    off = gl.expand_dims(gl.sum(ws, 1), 1) * (1024.0 / 16)  # OFF * sum(w)
    inv = 1.0 / gl.where(l_i > 0, l_i, 1.0)
    jo = gl.arange(0, JV, layout=gl.SliceLayout(1, gl.SliceLayout(1, MMA_V)))
    po = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA_V)))
    co = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA_V)))
    # warp j's head is column half j % 2 of its pair's tiles
    hq = (h0 + jo[:, None]) * GQ + co[None, :] % 4
    rows = o_base + hq.to(gl.int64) * o_row_stride  # [JV, 8]
    base = gl.expand_dims(rows, 1) + (2 * po)[None, :, None]
    own = ((co[None, :] // 4) == (jo[:, None] % 2)) & ((co[None, :] % 4) < GQ)
    omask = gl.expand_dims(own, 1) & (lo < hi)
    gl.store(mid_o_ptr + base + 0, ((a00 - off) * (1.0 / W_SCALE) + pm) * inv, mask=omask)
    gl.store(mid_o_ptr + base + 1, ((a01 - off) * (1.0 / W_SCALE) + pm) * inv, mask=omask)
    gl.store(mid_o_ptr + base + 32, ((a10 - off) * (0.25 / W_SCALE) + pm) * inv, mask=omask)
    gl.store(mid_o_ptr + base + 33, ((a11 - off) * (0.25 / W_SCALE) + pm) * inv, mask=omask)
    gl.store(mid_o_ptr + base + 64, ((a20 - off) * (0.0625 / W_SCALE) + pm) * inv, mask=omask)
    gl.store(mid_o_ptr + base + 65, ((a21 - off) * (0.0625 / W_SCALE) + pm) * inv, mask=omask)
    gl.store(mid_o_ptr + base + 96, ((a30 - off) * (0.015625 / W_SCALE) + pm) * inv, mask=omask)
    gl.store(mid_o_ptr + base + 97, ((a31 - off) * (0.015625 / W_SCALE) + pm) * inv, mask=omask)


@gluon.jit(do_not_specialize=["NS"])
def _int2_stage1_ws(qr_ptr, sqr_b, sqr_h, rows_ptr, lens_ptr, r2t_ptr, r2t_stride,
                    sop_ptr, pos_of_ptr, page_size, vf_ptr,
                    kpk_ptr, vpk_ptr, spk_s, spk_h, kgs_ptr, sgs_s, sgs_h,
                    mid_o_ptr, mid_lse_ptr, qk_scale, NS, MIN_CHUNK: gl.constexpr,
                    GQ: gl.constexpr, S: gl.constexpr, W: gl.constexpr,
                    BN: gl.constexpr, NB: gl.constexpr, NW: gl.constexpr, SLOT64: gl.constexpr = True,
                    RELEASE: gl.constexpr = False):
    """INT2 partials of (request b, KV heads 8 c .. 8 c + 7, split sp) into mid_o / mid_lse
    at split index sp + 1 (index 0 is the BF16 side's); see the module doc. RELEASE: the
    next kernel, launched with programmatic dependent launch, may start at once."""
    if RELEASE:  # the BF16 side's kernel may start (triton_decode: PDL_LATE)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    b = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * JV
    sp = gl.program_id(2)
    hq_total = gl.num_programs(1) * JV * GQ
    row, lo, hi = _request_split(b, sp, rows_ptr, lens_ptr, r2t_ptr, r2t_stride, sop_ptr, pos_of_ptr, page_size,
                                 vf_ptr, NS, MIN_CHUNK, S, W, BN)
    r2t_row = r2t_ptr + row * r2t_stride
    lse_base = (b * hq_total + h0 * GQ) * (NS + 1) + sp + 1  # index of (b, hq0, sp + 1); hq stride NS + 1
    kbuf = gl.allocate_shared_memory(gl.int16, [NB, JS, BN, 32], K_CODES_SMEM)
    vbuf = gl.allocate_shared_memory(gl.int16, [NB, JV, BN, 16], V_CODES_SMEM)
    wdbuf = gl.allocate_shared_memory(gl.int32, [NB, 4 * JV, BN], FLAT_SMEM)
    slotbuf = gl.allocate_shared_memory(gl.int32, [4, BN], SLOT_SMEM)
    fbuf = gl.allocate_shared_memory(gl.float32, [NB, JV, BN, 8], PAIR_SMEM)
    vsbuf = gl.allocate_shared_memory(gl.float32, [NB, JV, BN, 2], PAIR_SMEM)
    wbuf = gl.allocate_shared_memory(gl.float16, [NW, JS, 2, BN, 8], W_SMEM)
    abuf = gl.allocate_shared_memory(gl.float32, [NW, JS, 2, 8], COL_SMEM)
    finbuf = gl.allocate_shared_memory(gl.float32, [2, JS, 2, 8], COL_SMEM)
    kready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    kfree = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    wready = gl.allocate_shared_memory(gl.int64, [NW, 1], mbarrier.MBarrierLayout())
    wfree = gl.allocate_shared_memory(gl.int64, [NW, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for k in gl.static_range(NB):
        mbarrier.init(kready.index(k), count=1)
        mbarrier.init(kfree.index(k), count=1)
    for k in gl.static_range(NW):
        mbarrier.init(wready.index(k), count=1)
        mbarrier.init(wfree.index(k), count=1)
    mbarrier.init(fin, count=1)
    gl.warp_specialize([
        (_values_partition, (kbuf, vbuf, wdbuf, slotbuf, fbuf, vsbuf, wbuf, abuf, finbuf, kready, kfree, wready,
                             wfree, fin, r2t_row, lo, hi, h0, kpk_ptr, vpk_ptr, spk_s, spk_h, kgs_ptr, sgs_s, sgs_h,
                             mid_o_ptr, lse_base * 128, (NS + 1) * 128, GQ, BN, NB, NW, SLOT64)),
        (_scores_partition, (kbuf, fbuf, vsbuf, wbuf, abuf, finbuf, kready, kfree, wready, wfree, fin,
                             qr_ptr, sqr_b, sqr_h, lo, hi, b, h0, mid_lse_ptr, lse_base, NS + 1, qk_scale,
                             GQ, BN, NB, NW)),
    ], [4], [168])

BLOCK_N = 64  # tokens per block of both partitions
STAGES = 3  # cp.async ring depth (blocks in flight per partition)
HANDOFF = 2  # (w, alpha) buffers between the partitions


def gluon_ws_unsupported(layer, gq: int, device) -> str | None:
    """Why the warp-specialised kernel cannot serve this layer (None: it can): it is built
    for head_dim 128, keys in groups of 32 and values in one group of 128 with
    float8_e4m3fn (scale, min) pairs stored as one record per token (keys' four, then the
    values'), KV heads in eights, at most 4 query heads per KV head, on sm_90 or newer."""
    if INTERPRET or device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return "needs an sm_90+ GPU (no interpreter path)"
    if layer.head_dim != 128 or layer.key_group_size != 32 or layer.value_group_size != 128:
        return (f"needs head_dim 128, key groups 32 and value groups 128 (got {layer.head_dim}, "
                f"{layer.key_group_size}, {layer.value_group_size})")
    ks, vs = layer.k_scales, layer.v_scales
    if ks.dtype != torch.float8_e4m3fn:
        return f"needs float8_e4m3fn scales (got {ks.dtype})"
    if layer.num_kv_heads % 8:
        return f"needs a multiple of 8 KV heads (got {layer.num_kv_heads})"
    if gq > 4:
        return f"needs at most 4 query heads per KV head (got {gq})"
    if (vs.data_ptr() != ks.data_ptr() + 8 or ks.stride() != vs.stride() or ks.stride(0) != 10
            or ks.stride(2) != 2 or float8_words_view(ks) is None):
        return "needs allocate_layer's scale records (five float8 pairs per token and head, 4-byte aligned)"
    return None


def launch_int2_stage1_ws(q_rot, rows, seq_lens, req_to_token, index, layer, mid_o, mid_lse, qk_scale: float,
                          ns: int, min_chunk: int, gq: int, max_registers: int = 168,
                          release: bool = False) -> None:
    """The INT2 partials (split indices 1..ns of mid_o [B, Hq, 1 + ns, D] / mid_lse) of a
    decode: grid (B, H / 8, ns), 12 warps per CTA. Arguments as _decode_stage1's; the BF16
    side (split index 0) is the caller's. ``release``: each CTA lets the next kernel, launched
    with programmatic dependent launch, start (griddepcontrol.launch_dependents)."""
    b = q_rot.shape[0]
    h = layer.num_kv_heads
    ks = layer.k_scales
    kpk, vpk = layer.k_packed.view(torch.int16), layer.v_packed.view(torch.int16)
    _int2_stage1_ws[(b, h // 8, ns)](
        q_rot, q_rot.stride(0), q_rot.stride(1), rows, seq_lens, req_to_token, req_to_token.stride(0),
        index.sink_slot_of_page, index.page_of_sink_slot, index.page_size, index.ring_valid_from,
        kpk, vpk, kpk.stride(0), kpk.stride(1), float8_words_view(ks),
        ks.stride(0) // 2, ks.stride(1) // 2, mid_o, mid_lse, qk_scale, ns,
        MIN_CHUNK=min_chunk, GQ=gq, S=layer.sink_tokens, W=layer.recent_window, BN=BLOCK_N,
        NB=STAGES, NW=HANDOFF, SLOT64=needs_int64_slots(layer), RELEASE=release, num_warps=8, maxnreg=max_registers,
    )

