"""Triton building blocks of attention over the hybrid BF16/INT2 cache (decode and extend).

All attention runs in the rotated space with base-2 online softmax: scores are
``s = (q' . k') * sm_scale * log2(e)`` and a running (max m, sum l) per query row.

INT2 algebra (plane i = channels [i D/4, (i+1) D/4), packed in bits 2i..2i+1 of byte j):
with one quantisation group per plane (G >= D/4; keys and values each have their own G) and k^_c = min + code_c * scale,
    q'.k^_t            = sum_i scale_{t,i} (q'_i . c_{t,i}) + min_{t,i} sum(q'_i)
    sum_t p_t v^_t |_i = (p * scale_i) @ C_i + sum_t p_t min_{t,i}
so raw codes (exact in bf16) go straight into tensor-core dots; the planes of one group
(G = D: all four) share one dot chain and one scale. For G < D/4 codes are dequantised per
channel (scale gathered per channel).

Byte pairs. The packed codes are read as int16 elements: element p of a token's row holds
bytes 2p (low) and 2p + 1 (high), i.e. channels i D/4 + 2p ("even") and i D/4 + 2p + 1
("odd") of every plane i. One LOP3 per output register (the "magic" unpack) turns a
register of two int16 elements into two 16-bit floats:
    V (bf16): 0x4300 | (byte & (3 << 2i)) = 128 + STEP_i * code, STEP = (1, 4, 16, 16)
              (plane 3 is shifted down by 2 first: bit 7 of the low byte is an exponent bit)
    K (fp16, HALF: keys' G >= D/4): 0x6400 | (byte & (3 << 2i)) = 1024 + 4^i * code
              (10-bit mantissa: every field fits in place; q' then goes into the dots as
              float16 too, so it must stay below 65504 in magnitude, as in any fp16 attention)
applied to the register and to the register shifted right by 8 (the odd bytes): 9 (K) or
11 (V) integer instructions per 16 codes, no byte permutes, no int->float conversions.
Each (plane, parity) is one [tokens, D/8] (K) or [D/8, tokens] (V) tile, so the channel
order inside a dot is (2p + e); q' operands are gathered in the same order once per program
and divided by STEP_i (exact), and outputs are stored back to their channels. V stays bf16:
its other operand, w = p * scale, needs bf16's range.

Orientation (chosen from sm_90 SASS, benchmarks/aot_sm90.py): scores are computed transposed,
s^T [tokens, rows] = codes [tokens, D/8] @ q'^T, so the unpacked K codes are the tensor-core
A operand straight from shared memory (ldmatrix); V pairs are loaded transposed
[D/8, tokens] (ldmatrix.trans of 16-bit elements) and acc^T [D/8, rows] += codes^T @ w.

Offset and precision. With w = bf16(p * scale), the P@V dots give
sum_t w_t (OFF + STEP_i c_t); the offset is removed with W = sum_t w_t, itself a dot of a
ones tile with w (the same rounded weights), and the min term sum_t p_t min_t is kept as a
[16, rows] tile (the 16-row slices of each block added) reduced once at the end. Tensor
cores accumulate with truncation, and the offset makes accumulators large relative to the
signal, so every block's dots start
from zero and are added to the running float32 accumulators with ordinary FMAs (no
accumulation chain longer than one block inside the tensor cores). A key group of several
planes starts its chain from -OFF * sum(q'_i / STEP_i), which removes the offset of the scores
inside the dot; a group of one plane (G = D/4, the default) starts from zero and the offset
leaves with the min, once per token: scale * chain + min * sum(q'_g) with
min -> min - (OFF / STEP_g) * scale (no loop-invariant [BN, R] start tiles held in registers).

Key debias (DEBIAS, reference module doc): each INT2 score subtracts half its rounding-noise
variance, sum_g scale_g^2 * qv_g with qv_g = |q'_g|^2 qk_scale^2 / (24 log2 e) per key group g
(key_noise_query, once per program): one FMA per group and score, on scales already loaded.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import mma, sink_slot_of_row


@triton.jit
def opaque(x, INTERP: tl.constexpr):
    """x, through an identity Triton cannot see into (a PTX mov, which ptxas removes): the
    sum acc * alpha + opaque(dot(a, b, 0)) then stays an FMA after the dot instead of being
    combined into dot(a, b, acc * alpha)."""
    if INTERP:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def fresh_dot(a, b, acc, alpha, INTERP: tl.constexpr):
    """acc * alpha + a @ b with the dot started from zero: the tensor cores only sum one
    block (their accumulator starts from the zero register), the running sum is an
    ordinary float32 FMA (Triton would otherwise rewrite it into dot(a, b, acc * alpha), a
    long truncating accumulation chain; see opaque)."""
    return acc * alpha + opaque(mma(a, b, tl.zeros(acc.shape, tl.float32), INTERP), INTERP)


@triton.jit
def setk(t, k: tl.constexpr, v):
    """Tuple t with element k replaced by v."""
    return t[:k] + (v,) + t[k + 1:]


def _unpack_asm(magic: int, mask: int, shift: int = 0) -> tl.constexpr:
    """PTX for one 32-bit register of two int16 elements: $0 = even bytes, $1 = odd bytes
    (shifted right by 8) of one plane, each ``(($2 >> shift) & mask) | magic``: lop3 0xEA =
    (a & b) | c, one instruction per output register (ptxas hoists the magic register)."""
    def out(reg: str, s: int) -> str:
        if s == 0:
            return f"lop3.b32 {reg}, $2, 0x{mask:08X}, k, 0xEA;"
        return f"shr.b32 t, $2, {s}; lop3.b32 {reg}, t, 0x{mask:08X}, k, 0xEA;"
    return tl.constexpr(f"{{ .reg .b32 t, k; mov.b32 k, 0x{magic:08X}; {out('$0', shift)} {out('$1', 8 + shift)} }}")


# the bf16 (magic 0x4300) and float16 (HALF, magic 0x6400) unpacks of planes 0..3 (module doc)
_PAIR_ASM_0: tl.constexpr = _unpack_asm(0x43004300, 0x00030003)
_PAIR_ASM_1: tl.constexpr = _unpack_asm(0x43004300, 0x000C000C)
_PAIR_ASM_2: tl.constexpr = _unpack_asm(0x43004300, 0x00300030)
_PAIR_ASM_3: tl.constexpr = _unpack_asm(0x43004300, 0x00300030, shift=2)
_HALF_ASM_0: tl.constexpr = _unpack_asm(0x64006400, 0x00030003)
_HALF_ASM_1: tl.constexpr = _unpack_asm(0x64006400, 0x000C000C)
_HALF_ASM_2: tl.constexpr = _unpack_asm(0x64006400, 0x00300030)
_HALF_ASM_3: tl.constexpr = _unpack_asm(0x64006400, 0x00C000C0)


@triton.jit
def plane_step(i: tl.constexpr, HALF: tl.constexpr):
    """STEP_i: the unpacked value of code c of plane i is OFF + STEP_i * c (OFF: code_offset)."""
    if i == 0:
        return 1.0
    elif i == 1:
        return 4.0
    elif i == 2 or not HALF:
        return 16.0
    else:
        return 64.0


@triton.jit
def code_offset(HALF: tl.constexpr):
    """OFF of unpack_pair: 128 (bf16) or 1024 (fp16)."""
    return 1024.0 if HALF else 128.0


@triton.jit
def unpack_pair(x, i: tl.constexpr, INTERP: tl.constexpr, HALF: tl.constexpr):
    """int16 tile of byte pairs -> (even, odd) tiles of plane i's codes (low / high byte of
    each element) as OFF + STEP_i * code: bf16 (OFF = 128), or float16 when HALF (OFF = 1024,
    no shift for plane 3). The interpreter computes the same values arithmetically."""
    if not INTERP:
        if HALF:
            if i == 0:
                asm: tl.constexpr = _HALF_ASM_0
            elif i == 1:
                asm: tl.constexpr = _HALF_ASM_1
            elif i == 2:
                asm: tl.constexpr = _HALF_ASM_2
            else:
                asm: tl.constexpr = _HALF_ASM_3
            return tl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=(tl.float16, tl.float16),
                                             is_pure=True, pack=2)
        else:
            if i == 0:
                asm: tl.constexpr = _PAIR_ASM_0
            elif i == 1:
                asm: tl.constexpr = _PAIR_ASM_1
            elif i == 2:
                asm: tl.constexpr = _PAIR_ASM_2
            else:
                asm: tl.constexpr = _PAIR_ASM_3
            return tl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=(tl.bfloat16, tl.bfloat16),
                                             is_pure=True, pack=2)
    else:
        xi = x.to(tl.int32) & 0xFFFF
        ce = ((xi >> (2 * i)) & 3).to(tl.float32)
        co = ((xi >> (8 + 2 * i)) & 3).to(tl.float32)
        ce = code_offset(HALF) + ce * plane_step(i, HALF)
        co = code_offset(HALF) + co * plane_step(i, HALF)
        if HALF:
            return ce.to(tl.float16), co.to(tl.float16)
        else:
            return ce.to(tl.bfloat16), co.to(tl.bfloat16)


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
def load_or0(ptr, mask):
    """tl.load with 0 where ``mask`` is false; no mask when ``mask`` is None."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


# float8_e4m3fn (scale, min) pair in one int16 -> two float32: one cvt of both bytes to
# float16x2 (sm_89+), then each half to float32 (exact: e4m3 values are float16 values)
_FP8_PAIR_ASM: tl.constexpr = tl.constexpr(
    "{ .reg .b32 h; .reg .b16 lo, hi; cvt.rn.f16x2.e4m3x2 h, $2; mov.b32 {lo, hi}, h; "
    "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }")
# ... the pair in bits $3.. of an int32 word ($3 = 0 or 16)
_FP8_WORD_ASM: tl.constexpr = tl.constexpr(
    "{ .reg .b32 h, w; .reg .b16 lo, hi, p, u; shr.b32 w, $2, $3; mov.b32 {p, u}, w; "
    "cvt.rn.f16x2.e4m3x2 h, p; mov.b32 {lo, hi}, h; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }")


@triton.jit
def _fp8_pair_bits(x16):
    """(scale, min) float32 of int32 values holding a float8_e4m3fn pair in bits 0..15."""
    sc = (x16 & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    mn = ((x16 >> 8) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return sc, mn


@triton.jit
def group_scales(pairs_ptr, slot, head_off, stride_slot, g: tl.constexpr, mask, PAIR: tl.constexpr,
                 INTERP: tl.constexpr = False):
    """(scale, min) float32 [BN] of group g of a block of slots, one load per token, addressed
    as triton_common.group_scale_args gives them (PAIR: the 16-bit or float8 dtype of int32 /
    int16 pairs, or of float8_words_view's words: pair i in word i >> 1, bits 16 (i & 1) up;
    None: elements)."""
    if PAIR is not None:
        if PAIR == tl.float8e4nv and pairs_ptr.dtype.element_ty == tl.int32:
            idx = slot * stride_slot + head_off + g
            x = load_or0(pairs_ptr + (idx >> 1), mask)
            sh = (idx & 1).to(tl.int32) * 16
            if INTERP:
                sc, mn = _fp8_pair_bits(x >> sh)
            else:
                sc, mn = tl.inline_asm_elementwise(_FP8_WORD_ASM, "=r,=r,r,r", [x, sh],
                                                   dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
            return sc, mn
        x = load_or0(pairs_ptr + slot * stride_slot + head_off + g, mask)
        if PAIR == tl.float8e4nv and not INTERP:
            sc, mn = tl.inline_asm_elementwise(_FP8_PAIR_ASM, "=r,=r,h", [x], dtype=(tl.float32, tl.float32),
                                               is_pure=True, pack=1)
        elif PAIR == tl.float8e4nv:  # int16 pair of float8 values
            sc, mn = _fp8_pair_bits(x.to(tl.int32))
        else:  # int32 pair of 16-bit values
            sc = (x & 0xFFFF).to(tl.int16).to(PAIR, bitcast=True).to(tl.float32)
            mn = (x >> 16).to(tl.int16).to(PAIR, bitcast=True).to(tl.float32)
        return sc, mn
    else:
        base = pairs_ptr + slot * stride_slot + head_off + 2 * g
        return load_or0(base, mask).to(tl.float32), load_or0(base + 1, mask).to(tl.float32)


@triton.jit
def channel_dequant(c, step, chan, slot2, mask2, scales_ptr, head_off, stride_group, stride_slot,
                    G: tl.constexpr, OFF: tl.constexpr):
    """Dequantise unpacked codes per channel (G < D/4): bf16 min_g + code * scale_g, with
    code = (c - OFF) / step and g = chan // G (chan, slot2, mask2 broadcast against c)."""
    base = scales_ptr + slot2 * stride_slot + head_off + (chan // G) * stride_group
    sc = tl.load(base, mask=mask2, other=0.0).to(tl.float32)
    mn = tl.load(base + 1, mask=mask2, other=0.0).to(tl.float32)
    return (mn + (c.to(tl.float32) - OFF) * (1.0 / step) * sc).to(tl.bfloat16)


@triton.jit
def load_q_pair(q_vec, rmask, scale, i: tl.constexpr, e: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
                G: tl.constexpr, HALF: tl.constexpr):
    """q'^T operand of (plane i, parity e): [KP, R] bf16 (float16 when HALF), element
    (p, r) = q'[r, i D/4 + 2p + e] * scale / STEP_i (no division when G < D/4: dequantised
    codes), zero for p >= D/8. ``q_vec``: [R] pointers to the q' rows; ``scale``: the
    softmax scale (sm_scale log2 e), applied once here instead of to every score."""
    p = tl.arange(0, KP)
    ch = i * (D // 4) + 2 * p + e
    qt = tl.load(q_vec[None, :] + ch[:, None], mask=(p < D // 8)[:, None] & rmask[None, :], other=0.0)
    if G >= D // 4:
        qt = qt.to(tl.float32) * (scale / plane_step(i, HALF))
    else:
        qt = qt.to(tl.float32) * scale
    if HALF:
        qt = qt.to(tl.float16)
    else:
        qt = qt.to(tl.bfloat16)
    return qt


@triton.jit
def int2_query(q_vec, rmask, qk_scale, D: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):
    """(ops, sums): the 8 q' operands of load_q_pair (index 2 i + e), scaled by qk_scale
    (sm_scale log2 e: the dots give base-2 scores directly), and, per plane, the float32
    [R] column sums of its two operands (what the dots see). G: the keys' group size."""
    KP: tl.constexpr = D // 8 if D >= 128 else 16  # dot K >= 16
    q00 = load_q_pair(q_vec, rmask, qk_scale, 0, 0, D, KP, G, HALF)
    q01 = load_q_pair(q_vec, rmask, qk_scale, 0, 1, D, KP, G, HALF)
    q10 = load_q_pair(q_vec, rmask, qk_scale, 1, 0, D, KP, G, HALF)
    q11 = load_q_pair(q_vec, rmask, qk_scale, 1, 1, D, KP, G, HALF)
    q20 = load_q_pair(q_vec, rmask, qk_scale, 2, 0, D, KP, G, HALF)
    q21 = load_q_pair(q_vec, rmask, qk_scale, 2, 1, D, KP, G, HALF)
    q30 = load_q_pair(q_vec, rmask, qk_scale, 3, 0, D, KP, G, HALF)
    q31 = load_q_pair(q_vec, rmask, qk_scale, 3, 1, D, KP, G, HALF)
    sums = (tl.sum(q00.to(tl.float32), 0) + tl.sum(q01.to(tl.float32), 0),
            tl.sum(q10.to(tl.float32), 0) + tl.sum(q11.to(tl.float32), 0),
            tl.sum(q20.to(tl.float32), 0) + tl.sum(q21.to(tl.float32), 0),
            tl.sum(q30.to(tl.float32), 0) + tl.sum(q31.to(tl.float32), 0))
    return (q00, q01, q10, q11, q20, q21, q30, q31), sums


@triton.jit
def key_noise_query(q_vec, rmask, qk_scale, D: tl.constexpr, G: tl.constexpr, DEBIAS: tl.constexpr):
    """qv: per key group g (channels [g G, (g+1) G)) the float32 [R] debias multiplier of its
    scale^2, |q'_g|^2 qk_scale^2 / (24 log2 e) (base-2 scores); () when not DEBIAS."""
    qv = ()
    if DEBIAS:
        coef = qk_scale * qk_scale * (1.0 / (24.0 * 1.4426950408889634))
        c = tl.arange(0, G)
        for g in tl.static_range(D // G):
            qt = tl.load(q_vec[None, :] + g * G + c[:, None], mask=rmask[None, :], other=0.0).to(tl.float32)
            qv = qv + (tl.sum(qt * qt, 0) * coef,)
    return qv


@triton.constexpr_function
def group_count(D, G):
    """Groups the grouped path keeps per token: D/G when a group spans a plane or more
    (G >= D/4), else 1 (codes dequantised per channel, no per-group state)."""
    return D // G if G >= D // 4 else 1


@triton.jit
def int2_state(R: tl.constexpr, D: tl.constexpr, GV: tl.constexpr):
    """Zero state of int2_range: (m [R], l (16 x R), pm (per value group 16 x R), wsum (per
    value group 16 x R), acc (8 x [D/8, R])); the [16, R] tiles are summed over their rows
    at the end. GV: the values' group size."""
    NG: tl.constexpr = group_count(D, GV)
    DH: tl.constexpr = D // 8
    zt = tl.zeros([16, R], tl.float32)
    za = tl.zeros([DH, R], tl.float32)
    if NG == 1:
        pm = (zt,)
    elif NG == 2:
        pm = (zt, zt)
    else:
        pm = (zt, zt, zt, zt)
    return tl.full([R], float("-inf"), tl.float32), zt, pm, pm, (za, za, za, za, za, za, za, za)


@triton.jit
def fold16(x):
    """[BN, R] -> [16, R]: sum of the 16-row slices (rows held by the same threads)."""
    return tl.sum(tl.reshape(x, [x.shape[0] // 16, 16, x.shape[1]]), 0)


@triton.jit
def online_softmax_t(s, m_i, l_t):
    """Base-2 online-softmax step of transposed scores s^T [BN, R] over the token axis (0),
    safe for columns with every score -inf: (p, alpha, m_new, l_t_new) with
    l_t_new = l_t * alpha + fold16(p) ([16, R], rows summed at the end) and
    acc_new = acc * alpha + (p-weighted sums of this block)."""
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[None, :])
    return p, alpha, m_new, l_t * alpha[None, :] + fold16(p)


@triton.jit
def _v_pair(acc, vt, w, alpha, i: tl.constexpr, INTERP: tl.constexpr):
    """acc with plane i's even / odd tiles rescaled by alpha plus this block's codes^T @ w."""
    ce, co = unpack_pair(vt, i, INTERP, False)
    acc = setk(acc, 2 * i, fresh_dot(ce, w, acc[2 * i], alpha[None, :], INTERP))
    return setk(acc, 2 * i + 1, fresh_dot(co, w, acc[2 * i + 1], alpha[None, :], INTERP))


@triton.jit
def _block_slots(p0, hi, slots_row, MASKED: tl.constexpr, BN: tl.constexpr, SLOT64: tl.constexpr):
    """slot [BN] of the BN positions from p0 (0 at positions >= hi when MASKED), int64 when
    SLOT64 (a buffer with 2^31 or more elements)."""
    pos = p0 + tl.arange(0, BN)
    if MASKED:
        slot = tl.load(slots_row + pos, mask=pos < hi, other=0)
    else:
        slot = tl.load(slots_row + pos)
    if SLOT64:
        slot = slot.to(tl.int64)
    return slot


@triton.jit
def _int2_scores(slot, p0, hi, qops, c0, qg, qv, k_pairs_ptr, stride_pair_slot, pair_head_off,
                 k_scales_ptr, stride_scale_slot, stride_scale_group, scale_head_off,
                 k_scale_pairs_ptr, stride_scale_pair_slot, scale_pair_head_off, R: tl.constexpr,
                 MASKED: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, GK: tl.constexpr,
                 PAIR: tl.constexpr, INTERP: tl.constexpr, HALF: tl.constexpr, DEBIAS: tl.constexpr):
    """Scores s^T [BN, R] (base 2, scaled; -inf at masked positions) of the BN positions
    from p0: the key half of a block. GK: the keys' group size; DEBIAS: minus
    sum_g scale_g^2 qv[g] (key_noise_query)."""
    DQ: tl.constexpr = D // 4
    DH: tl.constexpr = D // 8
    KP: tl.constexpr = D // 8 if D >= 128 else 16  # dot K >= 16
    GRP_K: tl.constexpr = GK >= DQ
    NG_K: tl.constexpr = group_count(D, GK)
    PG_K: tl.constexpr = 4 // NG_K  # planes per key group
    OFF: tl.constexpr = 128.0
    kp = tl.arange(0, KP)
    if MASKED:
        mask = (p0 + tl.arange(0, BN)) < hi
        kmask = mask[:, None] & (kp < DH)[None, :]
    else:
        mask = None
        kmask = (kp < DH)[None, :] if KP > DH else None
    kt = load_or0(k_pairs_ptr + slot[:, None] * stride_pair_slot + pair_head_off + kp[None, :], kmask)  # [BN, KP]
    if GRP_K:
        for g in tl.static_range(NG_K):
            if PG_K == 1:  # zero start; the offset leaves with the min (below)
                d = tl.zeros([BN, R], tl.float32)
            else:
                d = c0[g]
            for j in tl.static_range(PG_K):
                ce, co = unpack_pair(kt, g * PG_K + j, INTERP, HALF)
                d = mma(ce, qops[2 * (g * PG_K + j)], d, INTERP)
                d = mma(co, qops[2 * (g * PG_K + j) + 1], d, INTERP)
            sc, mn = group_scales(k_scale_pairs_ptr, slot, scale_pair_head_off, stride_scale_pair_slot, g, mask,
                                  PAIR, INTERP)
            if PG_K == 1:  # d = OFF sum(q'_g) / STEP_g + q'_g.c: OFF / STEP_g per unit of qg
                mn = mn - (code_offset(HALF) / plane_step(g, HALF)) * sc
            if g == 0:
                s = d * sc[:, None] + mn[:, None] * qg[g][None, :]
            else:  # two FMAs per element and group (qk_scale is in q' and qg)
                s = d * sc[:, None] + s
                s = mn[:, None] * qg[g][None, :] + s
            if DEBIAS:
                s = s - (sc * sc)[:, None] * qv[g][None, :]
    else:
        s = tl.zeros([BN, R], tl.float32)
        for i in tl.static_range(4):
            ce, co = unpack_pair(kt, i, INTERP, False)
            chan = i * DQ + 2 * kp[None, :]
            km = (kp < DH)[None, :] if kmask is None else kmask
            ce = channel_dequant(ce, plane_step(i, False), chan, slot[:, None], km, k_scales_ptr, scale_head_off,
                                 stride_scale_group, stride_scale_slot, GK, OFF)
            co = channel_dequant(co, plane_step(i, False), chan + 1, slot[:, None], km, k_scales_ptr,
                                 scale_head_off, stride_scale_group, stride_scale_slot, GK, OFF)
            s = mma(ce, qops[2 * i], s, INTERP)
            s = mma(co, qops[2 * i + 1], s, INTERP)
        if DEBIAS:
            for g in tl.static_range(D // GK):
                sc = load_or0(k_scales_ptr + slot * stride_scale_slot + scale_head_off + g * stride_scale_group,
                              mask).to(tl.float32)
                s = s - (sc * sc)[:, None] * qv[g][None, :]
    if MASKED:
        s = tl.where(mask[:, None], s, float("-inf"))
    return s


@triton.jit
def _int2_accumulate(st, s, slot, p0, hi, v_pairs_ptr, stride_pair_slot, pair_head_off,
                     v_scales_ptr, stride_scale_slot, stride_scale_group, scale_head_off,
                     v_scale_pairs_ptr, stride_scale_pair_slot, scale_pair_head_off,
                     MASKED: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, GV: tl.constexpr,
                     PAIR: tl.constexpr, INTERP: tl.constexpr):
    """The value half of a block: online softmax of its scores s^T [BN, R] over the token
    axis (0) and the P@V dots of the BN positions from p0, added to the state st
    (int2_state). GV: the values' group size."""
    DQ: tl.constexpr = D // 4
    DH: tl.constexpr = D // 8
    GRP_V: tl.constexpr = GV >= DQ
    NG_V: tl.constexpr = group_count(D, GV)
    PG_V: tl.constexpr = 4 // NG_V  # planes per value group
    OFF: tl.constexpr = 128.0
    m_i, l_t, pm, wsum, acc = st
    dh = tl.arange(0, DH)
    if MASKED:
        mask = (p0 + tl.arange(0, BN)) < hi
        vmask = mask[None, :]
    else:
        mask = None
        vmask = None
    vt = load_or0(v_pairs_ptr + slot[None, :] * stride_pair_slot + pair_head_off + dh[:, None], vmask)  # [DH, BN]
    p, alpha, m_new, l_t = online_softmax_t(s, m_i, l_t)  # over the token axis (0)
    # ---- values: fresh dots per block, added to the running accumulators
    if GRP_V:
        ones = tl.full([16, BN], 1.0, tl.float32).to(tl.bfloat16)
        for g in tl.static_range(NG_V):
            sc, mn = group_scales(v_scale_pairs_ptr, slot, scale_pair_head_off, stride_scale_pair_slot, g, mask,
                                  PAIR, INTERP)
            w = (p * sc[:, None]).to(tl.bfloat16)
            pm = setk(pm, g, pm[g] * alpha[None, :] + fold16(p * mn[:, None]))
            wsum = setk(wsum, g, fresh_dot(ones, w, wsum[g], alpha[None, :], INTERP))
            for j in tl.static_range(PG_V):
                acc = _v_pair(acc, vt, w, alpha, g * PG_V + j, INTERP)
    else:
        pb = p.to(tl.bfloat16)
        vm = (dh < DH)[:, None] if vmask is None else vmask
        for i in tl.static_range(4):
            ce, co = unpack_pair(vt, i, INTERP, False)
            chan = i * DQ + 2 * dh[:, None]
            ce = channel_dequant(ce, plane_step(i, False), chan, slot[None, :], vm, v_scales_ptr, scale_head_off,
                                 stride_scale_group, stride_scale_slot, GV, OFF)
            co = channel_dequant(co, plane_step(i, False), chan + 1, slot[None, :], vm, v_scales_ptr,
                                 scale_head_off, stride_scale_group, stride_scale_slot, GV, OFF)
            acc = setk(acc, 2 * i, fresh_dot(ce, pb, acc[2 * i], alpha[None, :], INTERP))
            acc = setk(acc, 2 * i + 1, fresh_dot(co, pb, acc[2 * i + 1], alpha[None, :], INTERP))
    return m_new, l_t, pm, wsum, acc


@triton.jit
def _int2_block(st, slot, p0, hi, qops, c0, qg, qv, k_pairs_ptr, v_pairs_ptr, stride_pair_slot, pair_head_off,
                k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_group, scale_head_off,
                k_scale_pairs_ptr, v_scale_pairs_ptr, stride_scale_pair_slot, scale_pair_head_off,
                MASKED: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                PAIR: tl.constexpr, INTERP: tl.constexpr, HALF: tl.constexpr, DEBIAS: tl.constexpr):
    """One block of BN positions from p0 at slots ``slot`` (_block_slots; positions >= hi
    masked when MASKED): its scores, then softmax and value dots. K codes as float16
    when HALF (GK >= D/4). GK / GV: the keys' / values' group size."""
    R: tl.constexpr = st[0].shape[0]
    s = _int2_scores(slot, p0, hi, qops, c0, qg, qv, k_pairs_ptr, stride_pair_slot, pair_head_off,
                     k_scales_ptr, stride_scale_slot, stride_scale_group, scale_head_off,
                     k_scale_pairs_ptr, stride_scale_pair_slot, scale_pair_head_off, R, MASKED, BN, D, GK, PAIR,
                     INTERP, HALF, DEBIAS)
    return _int2_accumulate(st, s, slot, p0, hi, v_pairs_ptr, stride_pair_slot, pair_head_off,
                            v_scales_ptr, stride_scale_slot, stride_scale_group, scale_head_off,
                            v_scale_pairs_ptr, stride_scale_pair_slot, scale_pair_head_off, MASKED, BN, D, GV,
                            PAIR, INTERP)


@triton.jit
def int2_range(qops, qsums, qv, st, lo, hi, slots_row, k_pairs_ptr, v_pairs_ptr, stride_pair_slot, pair_head_off,
               k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_group, scale_head_off,
               k_scale_pairs_ptr, v_scale_pairs_ptr, stride_scale_pair_slot, scale_pair_head_off,
               BN: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, PAIR: tl.constexpr,
               INTERP: tl.constexpr, SLOT64: tl.constexpr, HALF: tl.constexpr, SLOT_AHEAD: tl.constexpr,
               DEBIAS: tl.constexpr):
    """Attend R query rows to INT2 positions [lo, hi) (slots slots_row[pos], a row of
    req_to_token): full blocks of BN positions without masks, then a masked tail block.

    qops / qsums: int2_query; qv: key_noise_query (DEBIAS). State st (int2_state): running max m, l (sum of p), per value
    group pm (sum of p * min) and wsum (sum of w = bf16(p * scale)); acc (plane i, parity e
    at 2 i + e) = sum_t w_t (OFF + STEP_i c_t) (or sum_t p_t v_t when GV < D/4). k/v_pairs:
    triton_common.pair_views; k/v_scales (element strides) per channel group (G < D/4);
    k/v_scale_pairs as in group_scales; ``*_head_off``: the KV head's offset in each. GK / GV:
    the keys' / values' group size (K and V scales share strides: allocate_layer).

    SLOT_AHEAD: each step loads the next block's slots, so the code and scale loads of a
    block have their addresses when its step starts (Triton's pipeliner then issues the
    next step's copies early in the step instead of after a slot load at its end); decode
    runs it, extend (whose programs walk the whole prefix) does not.
    """
    NG: tl.constexpr = group_count(D, GK)
    PG: tl.constexpr = 4 // NG  # planes per key group
    R: tl.constexpr = st[0].shape[0]
    # per key group: the min multiplier sum(q'_g) and, for groups of several planes, the
    # dot-chain start -OFF * sum(q'_i / STEP_i) (one-plane groups start from zero: their
    # offset is OFF / STEP_g per unit of sum(q'_g), folded into the min per token)
    c0 = ()
    qg = ()
    for g in tl.static_range(NG):
        cs = qsums[g * PG]
        qs = qsums[g * PG] * plane_step(g * PG, HALF)
        for j in tl.static_range(1, PG):
            cs += qsums[g * PG + j]
            qs += qsums[g * PG + j] * plane_step(g * PG + j, HALF)
        if PG > 1:
            c0 = c0 + (tl.zeros([BN, R], tl.float32) - code_offset(HALF) * cs[None, :],)
        qg = qg + (qs,)
    hi_full = lo + (hi - lo) // BN * BN
    if SLOT_AHEAD:  # each step loads the next block's slots (loop-carried)
        slot_n = _block_slots(lo, hi, slots_row, True, BN, SLOT64)
    for p0 in range(lo, hi_full, BN):
        if SLOT_AHEAD:
            slot = slot_n
            slot_n = _block_slots(p0 + BN, hi, slots_row, True, BN, SLOT64)
        else:
            slot = _block_slots(p0, hi, slots_row, False, BN, SLOT64)
        st = _int2_block(st, slot, p0, hi, qops, c0, qg, qv, k_pairs_ptr, v_pairs_ptr, stride_pair_slot,
                         pair_head_off, k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_group,
                         scale_head_off, k_scale_pairs_ptr, v_scale_pairs_ptr, stride_scale_pair_slot,
                         scale_pair_head_off, False, BN, D, GK, GV, PAIR, INTERP, HALF, DEBIAS)
    if hi_full < hi:
        if SLOT_AHEAD:
            slot = slot_n
        else:
            slot = _block_slots(hi_full, hi, slots_row, True, BN, SLOT64)
        st = _int2_block(st, slot, hi_full, hi, qops, c0, qg, qv, k_pairs_ptr, v_pairs_ptr, stride_pair_slot,
                         pair_head_off, k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_group,
                         scale_head_off, k_scale_pairs_ptr, v_scale_pairs_ptr, stride_scale_pair_slot,
                         scale_pair_head_off, True, BN, D, GK, GV, PAIR, INTERP, HALF, DEBIAS)
    return st


@triton.jit
def int2_finish(st, D: tl.constexpr, GV: tl.constexpr):
    """(outs, m, l): the normalised o'^T tiles of int2_range's state (8 x [D/8, R], channels
    i D/4 + 2p + e at index 2 i + e), the running max m [R] and the softmax denominators l.
    GV: the values' group size."""
    NG: tl.constexpr = group_count(D, GV)
    PG: tl.constexpr = 4 // NG
    OFF: tl.constexpr = 128.0
    m_i, l_t, pm, wsum, acc = st
    l = tl.sum(l_t, 0)
    inv = 1.0 / tl.where(l > 0, l, 1.0)
    outs = ()
    for i in tl.static_range(4):
        for e in tl.static_range(2):
            a = acc[2 * i + e]
            if GV >= D // 4:
                a = ((a - OFF * (tl.sum(wsum[i // PG], 0) * (1.0 / 16))[None, :]) * (1.0 / plane_step(i, False))
                     + tl.sum(pm[i // PG], 0)[None, :])
            outs = outs + (a * inv[None, :],)
    return outs, m_i, l


@triton.jit
def store_pairs(row_ptrs, rmask, outs, D: tl.constexpr):
    """Store int2_finish's tiles to rows of D floats: row_ptrs [R] pointers to channel 0."""
    DH: tl.constexpr = D // 8
    dh = tl.arange(0, DH)
    for i in tl.static_range(4):
        for e in tl.static_range(2):
            tl.store(row_ptrs[None, :] + (i * (D // 4) + 2 * dh + e)[:, None], outs[2 * i + e],
                     mask=rmask[None, :])


@triton.jit
def bf16_range(q, m_i, l_i, acc, k_base, v_base, stride_pos, lo, hi, MOD: tl.constexpr,
               qk_scale, BN: tl.constexpr, D: tl.constexpr, INTERP: tl.constexpr,
               qv, var_base, stride_var_pos):
    """Attend rows q' [R, D] to BF16 positions [lo, hi) stored at k_base/v_base +
    (pos % MOD if MOD else pos) * stride_pos (ring cells or sink rows). ``qv`` (key_noise_query,
    rows as q; () for none) with ``var_base``: a materialised prefix's key debias, var_base +
    pos * stride_var_pos + g holding group g's scale^2 (0 at its BF16 positions)."""
    d = tl.arange(0, D)
    nb = tl.arange(0, BN)
    for p0 in range(lo, hi, BN):
        pos = p0 + nb
        mask = pos < hi
        if MOD > 0:
            rowoff = (pos % MOD).to(tl.int64) * stride_pos
        else:
            rowoff = pos.to(tl.int64) * stride_pos
        k = tl.load(k_base + rowoff[None, :] + d[:, None], mask=mask[None, :], other=0.0)
        s = mma(q, k, tl.zeros([q.shape[0], BN], tl.float32), INTERP) * qk_scale
        for g in tl.static_range(len(qv)):
            var = tl.load(var_base + pos.to(tl.int64) * stride_var_pos + g, mask=mask, other=0.0)
            s = s - qv[g][:, None] * var[None, :]
        p, alpha, m_i, l_i = online_softmax(s, mask[None, :], m_i, l_i)
        v = tl.load(v_base + rowoff[:, None] + d[None, :], mask=mask[:, None], other=0.0)
        acc = fresh_dot(p.to(tl.bfloat16), v, acc, alpha[:, None], INTERP)
    return m_i, l_i, acc


@triton.jit
def bf16_side_t(q_vec, rmask, m_i, l_t, acc, s_b, ring_lo, n, k_sink, v_sink, stride_sink_pos, k_ring, v_ring,
                stride_ring_cell, qk_scale, S: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                INTERP: tl.constexpr):
    """Transposed attention of R rows to the BF16 side cache of one request: sink positions
    [0, s_b) (rows k_sink/v_sink + pos * stride_sink_pos) then ring positions [ring_lo, n)
    (cells k_ring/v_ring + (pos % W) * stride_ring_cell), as one index range u < s_b + n - ring_lo.

    q_vec: [R] pointers to the q' rows. State: running max m_i [R], l_t [16, R] (sum of p,
    rows summed at the end), acc: 4 tiles [D/4, R] (sum of p v^T, channel quarters). Per
    block s^T [BN, R] = sum_c K_c [BN, D/4] @ q'_c^T and acc_c += V_c^T [D/4, BN] @ p, like
    the INT2 tiles: operands stream in quarters, so few rows need few registers."""
    R: tl.constexpr = rmask.shape[0]
    DQ: tl.constexpr = D // 4
    dq = tl.arange(0, DQ)
    nb = tl.arange(0, BN)
    q0 = tl.load(q_vec[None, :] + dq[:, None], mask=rmask[None, :], other=0.0)  # [D/4, R]
    q1 = tl.load(q_vec[None, :] + DQ + dq[:, None], mask=rmask[None, :], other=0.0)
    q2 = tl.load(q_vec[None, :] + 2 * DQ + dq[:, None], mask=rmask[None, :], other=0.0)
    q3 = tl.load(q_vec[None, :] + 3 * DQ + dq[:, None], mask=rmask[None, :], other=0.0)
    total = s_b + (n - ring_lo)
    for u0 in tl.range(0, total, BN, num_stages=1):  # few blocks: no pipeline buffers in smem
        u = u0 + nb
        mask = u < total
        if S > 0 and W > 0:
            sink = u < s_b
            cell = ((ring_lo + u - s_b) % W) * stride_ring_cell
            krow = tl.where(sink, k_sink + u * stride_sink_pos, k_ring + cell)
            vrow = tl.where(sink, v_sink + u * stride_sink_pos, v_ring + cell)
        elif S > 0:
            krow = k_sink + u * stride_sink_pos
            vrow = v_sink + u * stride_sink_pos
        else:
            cell = ((ring_lo + u) % W) * stride_ring_cell
            krow = k_ring + cell
            vrow = v_ring + cell
        kp = krow[:, None] + dq[None, :]
        s = mma(tl.load(kp, mask=mask[:, None], other=0.0), q0, tl.zeros([BN, R], tl.float32), INTERP)
        s = mma(tl.load(kp + DQ, mask=mask[:, None], other=0.0), q1, s, INTERP)
        s = mma(tl.load(kp + 2 * DQ, mask=mask[:, None], other=0.0), q2, s, INTERP)
        s = mma(tl.load(kp + 3 * DQ, mask=mask[:, None], other=0.0), q3, s, INTERP)
        s = tl.where(mask[:, None], s * qk_scale, float("-inf"))
        p, alpha, m_i, l_t = online_softmax_t(s, m_i, l_t)
        pb = p.to(tl.bfloat16)
        vp = vrow[None, :] + dq[:, None]
        for c in tl.static_range(4):
            v = tl.load(vp + c * DQ, mask=mask[None, :], other=0.0)  # [D/4, BN]
            acc = setk(acc, c, fresh_dot(v, pb, acc[c], alpha[None, :], INTERP))
    return m_i, l_t, acc


@triton.jit
def request_layout(b, rows_ptr, lens_ptr, req_to_token_ptr, stride_req_to_token_row, sink_slot_of_page_ptr,
                   page_of_sink_slot_ptr, page_size, ring_valid_from_ptr, S: tl.constexpr, W: tl.constexpr):
    """(row, n, sink slot c, S_b, ring_lo) of request b for the read rule with n =
    lens[b]: sink [0, S_b), INT2 [S_b, ring_lo), ring [ring_lo, n)."""
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int64)
    if S > 0:
        c = sink_slot_of_row(row, req_to_token_ptr, stride_req_to_token_row, sink_slot_of_page_ptr,
                             page_of_sink_slot_ptr, page_size)
        s_b = tl.where(c >= 0, tl.minimum(n, S), 0)
    else:
        c = row * 0 - 1
        s_b = row * 0
    if W > 0:
        vf = tl.load(ring_valid_from_ptr + row).to(tl.int64)
        ring_lo = tl.minimum(tl.maximum(tl.maximum(n - W, vf), s_b), n)
    else:
        ring_lo = n
    return row, n, c, s_b, ring_lo
