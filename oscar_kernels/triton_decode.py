"""Triton decode attention over the hybrid BF16/INT2 paged cache (split-K flash-decoding).

Three launches, all with static grids for a given batch (CUDA-graph safe, no host sync,
no allocation when a :class:`DecodeWorkspace` is given):

1. ``_rotate_q_kernel``  q' = q @ R_K[h]  for the Hq/H query heads of each KV head (bf16).
2. ``_decode_stage1``    grid (B, H, 1 + NS). Program (b, h, 0) attends to the BF16 side
   cache (sink positions [0, S_b) and ring positions [ring_lo, n), one index range);
   programs (b, h, 1 + s) attend to chunk s of the INT2 history [S_b, ring_lo), read
   through req_to_token. Each writes a partial (o~, lse) per query head; one program
   serves all Hq/H query heads of its KV head, so every byte of the cache is read once.
   All tiles are transposed ([tokens, rows] scores, [channels, rows] accumulators), so the
   few query rows of a KV head sit on the small side of the tensor-core shapes. The INT2
   part (triton_hybrid_attn) uses
        q'.k_t = sum_i scale_{t,i} (q'_i . c_{t,i}) + min_{t,i} sum(q'_i)
        sum_t p_t v_t |plane i = (p * scale_i) @ C_i + sum_t p_t min_{t,i}
   (plane i = channels [i D/4, (i+1) D/4), one group per plane when G >= D/4), so codes go
   straight into tensor-core dots; for G < D/4 the codes are dequantised per channel.
   The number of INT2 splits of request b is decided on device:
        ns_b = min(NS, max(1, cdiv(L_b, MIN_CHUNK))),  L_b = INT2 positions of b,
   under NS = clamp(target_programs // (B * H), 1, max_splits) of the batch size (by default
   the stage-1 programs resident at once, so batch 1 still fills the GPU). NS is a runtime
   argument: one compiled kernel serves every batch size.
3. ``_decode_merge``     log-sum-exp merge of the 1 + NS partials, then o = o' @ R_V[h]^T
   (small batches: ``_decode_merge_split``, one program per query head and channel block,
   then the un-rotation by ``_rotate_q_kernel``; DecodeConfig.merge_grid).

On sm_90+ launches 2 and 3 (and the split merge's un-rotation) use programmatic dependent
launch (DecodeConfig.programmatic_launch): each may start while the kernel before it runs and
waits on device (griddepcontrol.wait) before it reads that kernel's output; the query rotation
releases stage 1 at once, so stage 1 reads its request layout meanwhile.

Read rule (hybrid_cache): S_b = min(S, n) if the first page owns a valid sink slot else 0;
ring_lo = clamp(max(n - W, ring_valid_from[row]), S_b, n) (= n when W = 0).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation
from .triton_common import (INTERPRET, check_cache_layout, check_last_dim_contiguous, group_scale_args,
                            half_keys, head_index, mma_f32, needs_int64_slots, pair_views, pdl_supported,
                            release_dependent_grid, wait_for_prior_grid)
from .triton_hybrid_attn import (bf16_side_t, int2_finish, int2_query, int2_range, int2_state, request_layout,
                                 store_pairs)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _rotate_q_kernel(q_ptr, sq_b, sq_h, rot_ptr, out_ptr, so_b, so_h, T,
                     GQ: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, KB: tl.constexpr,
                     EB: tl.constexpr, TRANSPOSE: tl.constexpr, PRECISION: tl.constexpr,
                     PDL_WAIT: tl.constexpr = False, PDL_RELEASE: tl.constexpr = False):
    """out[t, h*GQ + g, e] = sum_c x[t, h*GQ + g, c] R[h][c, e] (R[h][e, c] when TRANSPOSE)
    for the EB output columns e of program (token block, h, e-block); float32 dot over K
    chunks of KB read from memory, stored in out's dtype. Grid (cdiv(T, BT), H, D / EB):
    each program rotates BT tokens x GQ query heads (BT x BH rows, padded heads masked), so
    R[h] is read once per BT tokens (extend: thousands of tokens); with EB < D the few rows
    of a small batch spread over more programs, each with a shorter chain of loads.
    PDL_RELEASE: the next kernel may start at once (decode's stage 1 reads its request
    layout meanwhile); PDL_WAIT: x is the previous kernel's output (launched with PDL)."""
    release_dependent_grid(PDL_RELEASE)
    wait_for_prior_grid(PDL_WAIT)
    r = tl.arange(0, BT * BH)
    t = tl.program_id(0).to(tl.int64) * BT + r // BH
    h = tl.program_id(1)
    e = tl.program_id(2) * EB + tl.arange(0, EB)
    g = r % BH
    rmask = (g < GQ) & (t < T)
    row_q = t * sq_b + (h * GQ + g) * sq_h
    kb = tl.arange(0, KB)
    rot = rot_ptr + h.to(tl.int64) * D * D
    acc = tl.zeros([BT * BH, EB], tl.float32)
    for c0 in tl.static_range(0, D, KB):
        qs = tl.load(q_ptr + row_q[:, None] + c0 + kb[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        if TRANSPOSE:  # rs[k, e] = R[e, c0 + k]
            rs = tl.load(rot + e[None, :] * D + (c0 + kb)[:, None]).to(tl.float32)
        else:
            rs = tl.load(rot + (c0 + kb)[:, None] * D + e[None, :]).to(tl.float32)
        acc = mma_f32(qs, rs, acc, PRECISION)
    row_o = t * so_b + (h * GQ + g) * so_h
    tl.store(out_ptr + row_o[:, None] + e[None, :], acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def store_lse(ptrs, mask, m_i, l_i):
    """log2-sum-exp of a partial: m + log2(l), -inf when nothing was attended."""
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(ptrs, lse, mask=mask)


@triton.jit
def int2_split(s_b, ring_lo, split, NS, MIN_CHUNK: tl.constexpr, BN: tl.constexpr):
    """[lo, hi) of INT2 split ``split`` of [s_b, ring_lo): ns = min(NS, max(1, cdiv(L,
    MIN_CHUNK))) splits of whole BN blocks (empty, lo >= hi, for split >= ns)."""
    length = ring_lo - s_b
    ns = tl.minimum(tl.maximum(tl.cdiv(length, MIN_CHUNK), 1), NS)
    chunk = tl.cdiv(tl.cdiv(length, ns), BN) * BN
    lo = s_b + split * chunk
    return lo, tl.minimum(lo + chunk, ring_lo)


# The split count is a runtime argument, never specialised: one compiled kernel serves every
# batch size (a constexpr NS compiled once per CUDA-graph batch size: ~120 s of start-up).
@triton.jit(do_not_specialize=["NS"])
def _decode_stage1(qr_ptr, sqr_b, sqr_h, rows_ptr, lens_ptr, r2t_ptr, r2t_stride,
                   sop_ptr, pos_of_ptr, page_size, vf_ptr,
                   kpk_ptr, vpk_ptr, spk_s, spk_h, ksc_ptr, vsc_ptr, ssc_s, ssc_h, ssc_g,
                   kgs_ptr, vgs_ptr, sgs_s, sgs_h,
                   ksink_ptr, vsink_ptr, ssk_c, ssk_p, ssk_h,
                   kring_ptr, vring_ptr, srg_r, srg_c, srg_h,
                   mid_o_ptr, mid_lse_ptr, qk_scale,
                   NS, MIN_CHUNK: tl.constexpr,
                   GQ: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                   S: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, BN_BF16: tl.constexpr,
                   PAIR: tl.constexpr, MAGIC: tl.constexpr, USE_DOT: tl.constexpr, INTERP: tl.constexpr,
                   SLOT64: tl.constexpr, HALF: tl.constexpr, SLOT_AHEAD: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Partial attention of one (request, KV head, split); see module doc. mid_o is
    [B, Hq, 1 + NS, D] float32 (o~ = sum p v / sum p), mid_lse [B, Hq, 1 + NS] (log2).
    PDL: launched while the query rotation runs; the request layout (written before that
    kernel) is read first, q' and the partials only after wait_for_prior_grid."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    num_h = tl.num_programs(1)
    g = tl.arange(0, BH)
    hmask = g < GQ
    hq = (h * GQ + g).to(tl.int64)
    row, n, c, s_b, ring_lo = request_layout(b, rows_ptr, lens_ptr, r2t_ptr, r2t_stride, sop_ptr,
                                             pos_of_ptr, page_size, vf_ptr, S, W)
    wait_for_prior_grid(PDL)
    mid_row = (b * num_h * GQ + hq) * (NS + 1) + sp  # [BH] index of (b, hq, sp)
    q_vec = qr_ptr + b * sqr_b + hq * sqr_h  # [BH] pointers to the q' rows
    if sp == 0:
        # ---- BF16 side cache: sinks [0, s_b) and ring [ring_lo, n), transposed tiles
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_t = tl.zeros([16, BH], tl.float32)
        za = tl.zeros([D // 4, BH], tl.float32)
        acc = (za, za, za, za)
        if S + W > 0:
            m_i, l_t, acc = bf16_side_t(q_vec, hmask, m_i, l_t, acc, s_b, ring_lo, n,
                                        ksink_ptr + tl.maximum(c, 0) * ssk_c + h * ssk_h,
                                        vsink_ptr + tl.maximum(c, 0) * ssk_c + h * ssk_h, ssk_p,
                                        kring_ptr + row * srg_r + h * srg_h, vring_ptr + row * srg_r + h * srg_h,
                                        srg_c, qk_scale, S, W, BN_BF16, D, USE_DOT, INTERP)
        l_i = tl.sum(l_t, 0)
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        dq = tl.arange(0, D // 4)
        for j in tl.static_range(4):
            tl.store(mid_o_ptr + mid_row[None, :] * D + j * (D // 4) + dq[:, None], acc[j] * inv[None, :],
                     mask=hmask[None, :])
        store_lse(mid_lse_ptr + mid_row, hmask, m_i, l_i)
    else:
        # ---- INT2 history: chunk sp - 1 of [s_b, ring_lo), transposed tiles [*, BH]
        lo, hi = int2_split(s_b, ring_lo, sp - 1, NS, MIN_CHUNK, BN)
        qops, qsums = int2_query(q_vec, hmask, qk_scale, D, GK, MAGIC, HALF)
        hh = head_index(h, SLOT64)
        st = int2_range(qops, qsums, int2_state(BH, D, GV), lo, hi, r2t_ptr + row * r2t_stride,
                        kpk_ptr, vpk_ptr, spk_s, hh * spk_h, ksc_ptr, vsc_ptr, ssc_s, ssc_g, hh * ssc_h,
                        kgs_ptr, vgs_ptr, sgs_s, hh * sgs_h, qk_scale, BN, D, GK, GV, PAIR, MAGIC, USE_DOT,
                        INTERP, SLOT64, HALF, SLOT_AHEAD)
        outs, m_i, l_i = int2_finish(st, D, GV, MAGIC)
        # an unused split (lo >= hi) writes only its lse (-inf); the merge skips its o~
        store_pairs(mid_o_ptr + mid_row * D, hmask & (lo < hi), outs, D)
        store_lse(mid_lse_ptr + mid_row, hmask, m_i, l_i)


@triton.jit
def merge_stats(lse_all, sps):
    """Of partial lse values [R, NSP2] (log2; -inf for a split that attended to nothing):
    per row the max m (0 when all are -inf) and l = sum 2^(lse - m), and ``used`` = one past
    the last split any row attended to (the merge reads no partial beyond it)."""
    m = tl.max(lse_all, 1)
    m = tl.where(m > float("-inf"), m, 0.0)
    l = tl.sum(tl.exp2(lse_all - m[:, None]), 1)
    used = tl.max(tl.max(tl.where(lse_all > float("-inf"), sps[None, :] + 1, 0), 1), 0)
    return m, l, used


@triton.jit(do_not_specialize=["NSP"])
def _decode_merge(mid_o_ptr, mid_lse_ptr, rot_ptr, out_ptr, so_b, so_h,
                  NSP, NSP2: tl.constexpr, GQ: tl.constexpr, BH: tl.constexpr,
                  D: tl.constexpr, EB: tl.constexpr, SPB: tl.constexpr, PRECISION: tl.constexpr,
                  PDL: tl.constexpr = False):
    """o[b, hq] = (sum_s 2^{lse_s - m} o~_s / sum_s 2^{lse_s - m}) @ R_V[h]^T with m the max
    of the lse_s (one vector load), then the partials up to the last one that attended to
    something, SPB at a time ([BH, SPB, D] loads, no running rescale). Timed on the H200
    (round 4, batch 1, 64k, whole decode): SPB 1 / 4 / 8 = 55.1 / 55.6 / 52.6 us; the merge
    itself ~21 us of it (leave-one-out breakdown). Grid (B, H). PDL: launched with
    programmatic dependent launch (waits for stage 1 first)."""
    wait_for_prior_grid(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    num_h = tl.num_programs(1)
    g = tl.arange(0, BH)
    hmask = g < GQ
    hq = (h * GQ + g).to(tl.int64)
    d = tl.arange(0, D)
    base = (b * num_h * GQ + hq) * NSP
    sps = tl.arange(0, NSP2)  # NSP2: power of two >= every NSP of the workspace (host-computed)
    lse_all = tl.load(mid_lse_ptr + base[:, None] + sps[None, :], mask=hmask[:, None] & (sps < NSP)[None, :],
                      other=float("-inf"))
    m, l, used = merge_stats(lse_all, sps)
    acc = tl.zeros([BH, D], tl.float32)
    spb = tl.arange(0, SPB)
    for sp0 in range(0, used, SPB):  # SPB partials per step: their loads are independent
        sp = sp0 + spb
        live = hmask[:, None] & (sp < used)[None, :]  # [BH, SPB]
        lse = tl.load(mid_lse_ptr + base[:, None] + sp[None, :], mask=live, other=float("-inf"))
        w = tl.exp2(lse - m[:, None])
        rows = (base[:, None] + sp[None, :]) * D  # [BH, SPB]
        o = tl.load(mid_o_ptr + rows[:, :, None] + d[None, None, :], mask=(live & (w > 0))[:, :, None],
                    other=0.0)  # [BH, SPB, D]
        acc += tl.sum(w[:, :, None] * o, 1)
    o_rot = acc / tl.where(l > 0, l, 1.0)[:, None]
    e = tl.arange(0, EB)
    rot = rot_ptr + h.to(tl.int64) * D * D
    for e0 in tl.static_range(0, D, EB):
        rt = tl.load(rot + (e0 + e)[None, :] * D + d[:, None]).to(tl.float32)  # rt[d, e] = R[e, d]
        oc = mma_f32(o_rot, rt, tl.zeros([BH, EB], tl.float32), PRECISION)
        tl.store(out_ptr + b * so_b + hq[:, None] * so_h + e0 + e[None, :],
                 oc.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit(do_not_specialize=["NSP"])
def _decode_merge_row(mid_o_ptr, mid_lse_ptr, rot_ptr, out_ptr, so_b, so_h,
                      NSP, NSP2: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, EB: tl.constexpr,
                      SPB: tl.constexpr, PDL: tl.constexpr = False):
    """_decode_merge's math for one query head per program, grid (B, Hq): at small batch
    GQ times more programs share the partials' reads. o[b, hq] = (sum_s 2^{lse_s - m} o~_s /
    sum_s 2^{lse_s - m}) @ R_V[h]^T with h = hq // GQ; partials SPB at a time as [SPB, D]
    tiles; the un-rotation o[e] = sum_d o'[d] R_V[h][e, d] as float32 products and sums.
    PDL: as _decode_merge."""
    wait_for_prior_grid(PDL)
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    num_hq = tl.num_programs(1)
    d = tl.arange(0, D)
    base = (b * num_hq + hq) * NSP
    sps = tl.arange(0, NSP2)
    lse_all = tl.load(mid_lse_ptr + base + sps[None, :], mask=(sps < NSP)[None, :], other=float("-inf"))
    m, l, used = merge_stats(lse_all, sps)
    m, l = tl.max(m, 0), tl.max(l, 0)  # the one row's values as scalars
    acc = tl.zeros([D], tl.float32)
    spb = tl.arange(0, SPB)
    for sp0 in range(0, used, SPB):
        sp = sp0 + spb
        lse = tl.load(mid_lse_ptr + base + sp, mask=sp < used, other=float("-inf"))
        w = tl.exp2(lse - m)
        o = tl.load(mid_o_ptr + (base + sp)[:, None] * D + d[None, :], mask=(w > 0)[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    o_rot = acc / tl.where(l > 0, l, 1.0)
    e = tl.arange(0, EB)
    rot = rot_ptr + (hq // GQ) * D * D
    for e0 in tl.static_range(0, D, EB):
        r = tl.load(rot + (e0 + e)[:, None] * D + d[None, :]).to(tl.float32)  # r[e, d] = R[e0 + e, d]
        oc = tl.sum(r * o_rot[None, :], 1)
        tl.store(out_ptr + b * so_b + hq * so_h + e0 + e, oc.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["NSP"])
def _decode_merge_split(mid_o_ptr, mid_lse_ptr, o_rot_ptr, NSP, NSP2: tl.constexpr, D: tl.constexpr,
                        DB: tl.constexpr, PDL: tl.constexpr = False):
    """o'[b, hq, c] = sum_s 2^{lse_s - m} o~_s[c] / sum_s 2^{lse_s - m} for the DB channels c of
    program (b, hq, channel block), every partial in one [NSP2, DB] load (no loop: the
    latency of one load instead of a chain); float32 o' in the rotated space (the
    un-rotation o = o' R_V^T is a separate launch). Grid (B, Hq, D / DB). PDL: as
    _decode_merge."""
    wait_for_prior_grid(PDL)
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    num_hq = tl.num_programs(1)
    base = (b * num_hq + hq) * NSP
    sps = tl.arange(0, NSP2)
    lse = tl.load(mid_lse_ptr + base + sps[None, :], mask=(sps < NSP)[None, :], other=float("-inf"))
    m, l, _ = merge_stats(lse, sps)
    w = tl.exp2(tl.reshape(lse, [NSP2]) - tl.max(m, 0))
    l = tl.max(l, 0)  # the one row's values as scalars
    c = tl.program_id(2) * DB + tl.arange(0, DB)
    o = tl.load(mid_o_ptr + (base + sps)[:, None] * D + c[None, :], mask=(w > 0)[:, None], other=0.0)
    acc = tl.sum(w[:, None] * o, 0) / tl.where(l > 0, l, 1.0)
    tl.store(o_rot_ptr + (b * num_hq + hq) * D + c, acc)


# ----------------------------------------------------------------------------- host side
MERGE_GRIDS = ("auto", "kv_head", "query_head", "split")


@dataclass
class DecodeConfig:
    """Launch parameters of the decode kernels (the benchmark sweeps them)."""

    # INT2 tokens per inner step; 0: by batch, SMALL_BATCH_BLOCK_N up to small_batch_max
    # requests, else BLOCK_N (timed: see max_registers)
    block_n: int = 0
    small_batch_max: int = 4
    # sink/ring tokens per inner step; 0: BF16_BLOCK_N where stage 1 is uncapped, else
    # CAPPED_BF16_BLOCK_N. The BF16 program (sink 16 + ring 128 tokens, one per request and KV
    # head) is the critical path at batch 1: a chain of dependent loads per step. Timed on the
    # H200 (session 13, same run, cold L2, keys 32 / values 128 / float8, uncapped) 128 / 64 /
    # 32: batch 1 / 64k 31.46 / 32.93 / 38.67 us, 1 / 16k 29.30 / 29.64 / 35.96, 8 / 64k
    # 154.56 / 152.53 / 156.50, 64 / 128k 2,353 / 2,329 / 2,307 (larger tiles cost the INT2
    # loop registers; at 64 this loop spills 30 instructions in sm_90 SASS, for its 2-3
    # iterations per request). Under the register cap (batches above small_batch_max when
    # groups span the head) 32 spills in the loop and 16 does not (tests/aot_sm90.py).
    block_n_bf16: int = 0
    # One warp: the V-side dots have 16-row tiles (D/8 byte pairs), which a second warp would
    # only duplicate; sm_90 SASS (tests/aot_sm90.py): ~13 warp instructions per token and KV
    # head at block_n 64 (the 2-warp kernel before this one: ~23).
    num_warps: int = 1
    # stage 1's pipeline depth (0: pipeline_for) and slot / head offsets in int64 (None:
    # pipeline_for; True: always; False: only where int32 cannot hold them, needs_int64_slots);
    # up to shallow_pipeline_max requests pipeline_for picks 2 stages and int32
    num_stages: int = 0
    int64_slots: bool | None = None
    shallow_pipeline_max: int = 1
    # ptxas register cap (maxnreg) of stage 1 when one quantisation group spans the head
    # (G = D, the calibration default): at 168, 12 one-warp programs fit an SM (uncapped,
    # ~230 registers: 8) and no value spills inside the token loops. Timed on the H200
    # (kernels_h200.json, round 4, same run): 168 vs the previous 136 is 0.77-0.85 x the
    # time at batch 8 (4k-128k), 0.97-0.99 x at batch 64, within +-0.7% at batch 1; 128
    # spills in the loop (1.6 x slower at b64 128k). Smaller groups keep a dot chain,
    # weights and min sums per group: the automatic cap is lifted for them (the cap would
    # spill in the loop), and the split count follows the programs that then fit.
    # None: uncapped; 0: by block_n and groups, REGISTER_CAP at block_n <= 64 when K and V
    # groups span the head, uncapped otherwise (128 tokens per step need the registers);
    # an explicit number applies to every layout. Timed (session 6 sweep, one run, warm L2): block_n 128 uncapped vs 64
    # capped = 31.4 / 33.5 us at batch 1 (64k), 50.7 / 59.7 at batch 1 (128k), 51.2 / 52.5 at
    # batch 2 and 83.5 / 91.8 at batch 4 (64k), but 294.1 / 289.5 at batch 16 and 162.5 / 152.0
    # at batch 8 (64k): hence the small-batch shape up to batch 4.
    max_registers: int | None = 0
    max_splits: int = 128  # NS upper bound (static: fixes the grid and the workspace)
    # INT2 programs to aim for: NS = clamp(target // (B * H), 1, max_splits), at most one
    # wave of equally long programs (a second, partial wave would double the time).
    # 0: the programs resident at once (SMs x resident_per_sm()) on CUDA, 16 on CPU.
    target_programs: int = 0
    min_chunk: int = 256  # fewest INT2 tokens per split
    magic_unpack: bool = True  # bit trick: codes become float values with one LOP3 (no converts)
    # K codes and q' as float16 (magic, G >= D/4): all four planes unpack without shifts; q'
    # (rotated queries) must stay below 65504 in magnitude, as in any fp16 attention.
    half_keys: bool = True
    use_dot: bool = True  # tensor cores for q.k and p.v
    # float8 (scale, min) pairs read as aligned 4-byte words (triton_common.float8_words_view)
    # so that Triton's pipeliner prefetches them; False: 2-byte loads in the block's own step.
    # Timed (session 11, same run): 0.83-0.93 x the time at batch 4-64 (16k-128k), equal at batch 1
    float8_words: bool = True
    # stage 1 loads each block's slots one step ahead (int2_range SLOT_AHEAD). Timed on the
    # H200 (session 11, same run, cold L2): 0.90-0.93 x the time at batch 4-32 (64k, 128k)
    # and batch 64 (16k), equal at batch 1 (64k) and batch 64 (128k)
    slot_ahead: bool = True
    min_block_h: int = 8  # query-head rows per program (>= Hq/H, power of two)
    fp32_precision: str = "ieee"  # input precision of the query rotation (float32 dots)
    merge_precision: str = "tf32x3"  # un-rotation in the merge (ieee spills registers there)
    # partials the merge loads at once (power of two); 0: per merge grid, 64 for "query_head"
    # (one program per query head: [64, D] per load), 4 for "kv_head" (GQ rows per program)
    merge_partials_per_step: int = 0
    # merge programs: "kv_head" (one per KV head, its GQ query heads together, tensor-core
    # un-rotation) or "query_head" (GQ x more programs, each loading 64 partials at once), or
    # "split" (one program per query head and block of 32 channels loading every partial at
    # once, then the un-rotation as a second launch), or "auto": "split" up to
    # split_merge_max_batch requests, "query_head" above. Timed on the H200, whole decode:
    # round 5, split / kv_head = 35.1 / 46.2 us at batch 1 (64k), 159.2 / 157.7 at batch 8
    # (64k), 364.9 / 317.3 at batch 64 (16k); round 6 (kernels_h200.json): split / kv_head =
    # 52.5 / 60.8 us at batch 2 and 92.2 / 97.0 at batch 4 (64k); query_head (64 partials) /
    # kv_head = 152.6 / 158.3 at batch 8 (64k), 321.1 / 320.2 at batch 64 (16k), 2,282.8 /
    # 2,275.7 at batch 64 (128k); batch 16: kv_head 290.4, split 298.8, query_head untimed.
    merge_grid: str = "auto"
    split_merge_max_batch: int = 4  # "auto": the split merge up to this batch (timed: 1, 2, 4)
    # output columns per query-rotation program (0: all D, one program per row block and KV
    # head; 32: four per, each loading its [D, 32] slice of R_K at once). Timed (round 5,
    # kv_head merge): 32 / 0 = 46.2 / 50.5 us at batch 1 (64k), 157.7 / 163.7 at batch 8
    # (64k), 317.3 / 315.3 at batch 64 (16k), 2259 / 2263 at batch 64 (128k).
    rotate_out_block: int = 32
    # programmatic dependent launch (sm_90+, triton_common.pdl_supported): stage 1, the merge
    # and the un-rotation start while the kernel before them runs and wait on device for
    # its output (griddepcontrol), so each launch's latency and stage 1's reads of the
    # request layout overlap the previous kernel
    programmatic_launch: bool = True

    def merge_grid_for(self, batch: int) -> str:
        """The merge grid a batch of ``batch`` requests runs ("auto" resolved)."""
        if self.merge_grid != "auto":
            return self.merge_grid
        return "split" if batch <= self.split_merge_max_batch else "query_head"

    def merge_partials_for(self, merge_grid: str) -> int:
        """Partials per merge step of a merge grid (merge_partials_per_step 0 resolved)."""
        if self.merge_partials_per_step:
            return self.merge_partials_per_step
        return 64 if merge_grid == "query_head" else 4

    def stage1_shape_for(self, batch: int, groups_span_head: bool = True) -> tuple[int, int | None]:
        """(block_n, max_registers) stage 1 runs for a batch of ``batch`` requests (0s resolved).
        ``groups_span_head``: both K and V have one INT2 group per head (G = D); smaller groups
        keep per-group dot chains and sums, so the automatic cap (0) is lifted for them and
        they keep 64-token steps at small batches (128 spill: 70 instructions in the sm_90 loop
        at keys 32 / values 128)."""
        small = batch <= self.small_batch_max and groups_span_head  # 128-token steps spill otherwise
        block_n = self.block_n or (SMALL_BATCH_BLOCK_N if small else BLOCK_N)
        regs = self.max_registers
        if regs == 0:
            regs = REGISTER_CAP if block_n <= BLOCK_N and groups_span_head else None
        return block_n, regs

    def pipeline_for(self, batch: int, block_n: int, max_registers: int | None) -> tuple[int, bool]:
        """(num_stages, int64 slot offsets) of stage 1 for a batch of ``batch`` requests at
        the shape (block_n, max_registers) of stage1_shape_for (0 / None fields resolved).
        Above shallow_pipeline_max requests an uncapped stage 1 of BLOCK_N-token steps runs 3
        stages with int64 offsets: sm_90 then issues a block's copies a full step before
        their wait (2 stages: at the end of the step before, so the warp waits for them at
        the top of the next; Nsight Compute, batch 64 / 128k: 23% of the warps' samples on
        that wait), and the int64 schedule does not wait on the next-but-one block's slot
        load inside the step that issues it (with int32 a select on the loaded slots did:
        9-12% of the samples at batch 8 / 64k). Timed on the H200 (session 14 call E, same
        run, cold L2, keys 32 / values 128 / float8) against 2 stages with int32: batch 8 /
        64k 151.4 vs 157.0 us, 8 / 128k 274.3 vs 282.6, 64 / 16k 305.9 vs 314.6, 64 / 64k
        1,046 vs 1,071, 64 / 128k 2,036 vs 2,320 (int64 there either way);
        3 stages with int32 were 1.06-1.07x slower except at 64 / 128k; batch 1 / 64k (8
        blocks per program) 34.5 vs 32.5, so batch 1 keeps 2 stages and int32; at 64k (call I)
        batch 2 45.77 vs 47.78, 4 91.86 vs 93.61, 5 92.71 vs 96.15, 16 275.96 vs 285.97. Other
        shapes (128-token steps, register caps) keep 2 stages / int32 (not timed deeper with
        this session's kernels)."""
        deep = batch > self.shallow_pipeline_max and block_n <= BLOCK_N and max_registers is None
        stages = self.num_stages or (3 if deep else 2)
        return stages, deep if self.int64_slots is None else self.int64_slots

    def bf16_block_for(self, max_registers: int | None) -> int:
        """BF16 sink/ring tokens per step for a stage 1 compiled under ``max_registers``."""
        if self.block_n_bf16:
            return self.block_n_bf16
        return BF16_BLOCK_N if max_registers is None else CAPPED_BF16_BLOCK_N

    def resident_per_sm(self, batch: int, groups_span_head: bool = True) -> int:
        """Stage-1 programs an SM holds at once, from the register budget (65536 per SM;
        an uncapped stage 1 takes ~232 per thread; shared memory, ~7 KB, is not the limit)."""
        regs = -(-(self.stage1_shape_for(batch, groups_span_head)[1] or 232) // 8) * 8
        return max(1, min(32, 65536 // (32 * self.num_warps * regs)))

    def splits_for(self, batch: int, num_kv_heads: int, device, groups_span_head: bool = True) -> int:
        target = self.target_programs or _default_target(device, self, batch, groups_span_head)
        return max(1, min(self.max_splits, target // max(1, batch * num_kv_heads)))


# scratch a batch-invariant decode may take for its partials (1 + max_splits per request row)
BATCH_INVARIANT_WORKSPACE_BYTES = 512 << 20


def batch_invariant_config(max_context: int, max_batch: int, num_q_heads: int, head_dim: int,
                           workspace_bytes: int = BATCH_INVARIANT_WORKSPACE_BYTES,
                           base: DecodeConfig | None = None) -> DecodeConfig:
    """A DecodeConfig whose output for a request does not depend on the rest of the batch
    (deterministic inference): one stage-1 shape (BLOCK_N under the register cap) and
    pipeline (pipeline_for: 3 stages where uncapped) and one merge grid at every batch, and
    INT2 splits that depend on the request's length only:
        NS = max_splits at every batch, the most whose partials for ``max_batch`` rows fit
             ``workspace_bytes`` (max_batch (1 + NS) Hq (D + 1) 4 bytes), at most base's
        MIN_CHUNK = max(base.min_chunk, round_up(cdiv(max_context, NS), BLOCK_N))
        ns_b = cdiv(L_b, MIN_CHUNK) <= NS
    Fewer splits than the default at small batches: slower there, the price of invariance."""
    base = base or DecodeConfig()
    per_row = max(1, max_batch) * num_q_heads * (head_dim + 1) * 4
    splits = max(1, min(base.max_splits, workspace_bytes // per_row - 1))
    per_split = -(-max(1, max_context) // splits)
    min_chunk = max(base.min_chunk, -(-per_split // BLOCK_N) * BLOCK_N)
    return replace(base, block_n=BLOCK_N, max_registers=0, small_batch_max=0, merge_grid="query_head",
                   max_splits=splits, min_chunk=min_chunk, target_programs=1 << 30, shallow_pipeline_max=0)


BLOCK_N = 64  # INT2 tokens per stage-1 step above DecodeConfig.small_batch_max requests
SMALL_BATCH_BLOCK_N = 128  # ... and up to it: fewer, longer steps where programs are few
REGISTER_CAP = 168  # stage 1's maxnreg at block_n <= BLOCK_N (DecodeConfig.max_registers)
BF16_BLOCK_N = 64  # BF16 sink/ring tokens per stage-1 step, uncapped (DecodeConfig.block_n_bf16)
CAPPED_BF16_BLOCK_N = 16  # ... under a register cap


def _default_target(device, cfg: DecodeConfig, batch: int, groups_span_head: bool = True) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return cfg.resident_per_sm(batch, groups_span_head) * _sm_count(index)
    return 16


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class DecodeWorkspace:
    """Scratch buffers of decode_attention, allocated once for ``max_batch`` (CUDA graphs:
    allocate before capture and pass the same object to every call)."""

    def __init__(self, max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 device, config: DecodeConfig | None = None):
        self.config = config or DecodeConfig()
        self.max_batch, self.num_q_heads, self.num_kv_heads, self.head_dim = (
            max_batch, num_q_heads, num_kv_heads, head_dim)
        self.device = torch.device(device)
        cap = max(b * (self.config.splits_for(b, num_kv_heads, self.device) + 1)
                  for b in range(1, max_batch + 1))
        # lse vector width of the merge: one value for every batch size (one compilation)
        self.merge_width = triton.next_power_of_2(self.config.max_splits + 1)
        self.q_rot = torch.empty(max_batch * num_q_heads * head_dim, dtype=torch.bfloat16, device=device)
        self.mid_o = torch.empty(cap * num_q_heads * head_dim, dtype=torch.float32, device=device)
        self.mid_lse = torch.empty(cap * num_q_heads, dtype=torch.float32, device=device)
        # merged o' before the un-rotation (batches that run the "split" merge only)
        split_rows = max((b for b in range(1, max_batch + 1) if self.config.merge_grid_for(b) == "split"), default=0)
        self.o_rot = torch.empty(split_rows * num_q_heads * head_dim, dtype=torch.float32, device=device)

    def views(self, batch: int, config: DecodeConfig | None = None, groups_span_head: bool = True):
        """(NS, q_rot [B, Hq, D], mid_o [B, Hq, 1+NS, D], mid_lse [B, Hq, 1+NS]) for a batch;
        another ``config`` may only lower NS below what the workspace was sized for (as may
        groups smaller than the head: fewer resident programs, DecodeConfig.stage1_shape_for)."""
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the workspace's max_batch {self.max_batch}")
        ns = self.config.splits_for(batch, self.num_kv_heads, self.device, groups_span_head)
        if config is not None:
            ns = min(ns, config.splits_for(batch, self.num_kv_heads, self.device, groups_span_head))
        hq, d = self.num_q_heads, self.head_dim
        q_rot = self.q_rot[:batch * hq * d].view(batch, hq, d)
        mid_o = self.mid_o[:batch * hq * (ns + 1) * d].view(batch, hq, ns + 1, d)
        mid_lse = self.mid_lse[:batch * hq * (ns + 1)].view(batch, hq, ns + 1)
        return ns, q_rot, mid_o, mid_lse


def _block_h(gq: int, cfg: DecodeConfig) -> int:
    return max(triton.next_power_of_2(gq), cfg.min_block_h)


def check_decode_inputs(q, layer, rotation, rows, seq_lens):
    b, hq, d = q.shape
    h = layer.num_kv_heads
    if d != layer.head_dim or hq % h:
        raise ValueError(f"q shape {tuple(q.shape)} does not fit the cache (H={h}, D={layer.head_dim})")
    if d % 16 or d < 64 or d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two >= 64 for the Triton kernels")
    if rows.shape != (b,) or seq_lens.shape != (b,):
        raise ValueError(f"rows/seq_lens must have shape ({b},)")
    if rotation.k_rot.shape != (h, d, d):
        raise ValueError(f"rotation shape {tuple(rotation.k_rot.shape)} != ({h}, {d}, {d})")
    check_cache_layout(layer)


def rotate_queries(q: torch.Tensor, rot: torch.Tensor, out: torch.Tensor, precision: str = "ieee",
                   num_warps: int = 4, transpose: bool = False, out_block: int = 0,
                   tokens_per_program: int = 1, pdl_wait: bool = False,
                   pdl_release: bool = False) -> torch.Tensor:
    """out[t, hq] = q[t, hq] @ rot[hq // (Hq/H)] (or @ rot^T when ``transpose``) for q
    [T, Hq, D]; rot [H, D, D] float32; out in any float dtype (the rounding of the store).
    ``out_block``: output columns per program (0: all D; e.g. 32: D/32 programs per row
    block, each reading its R columns in one K chunk). ``tokens_per_program`` (a power of
    two): tokens per program (decode: 1; extend: EXTEND_ROTATION_ROWS rows, see rotate_tokens).
    ``pdl_wait``: launched with programmatic dependent launch, q being the previous
    kernel's output; ``pdl_release``: the next kernel may start at once (both need
    triton_common.pdl_supported)."""
    t, hq, d = q.shape
    h = rot.shape[0]
    gq = hq // h
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("out", out)
    if t == 0:
        return out
    eb = out_block or d
    if d % eb or eb & (eb - 1) or eb < 16:
        raise ValueError(f"out_block {out_block} must be a power of two >= 16 dividing head_dim {d}")
    if tokens_per_program < 1 or tokens_per_program & (tokens_per_program - 1):
        raise ValueError(f"tokens_per_program {tokens_per_program} must be a power of two")
    kb = d if eb < d else min(32, d)  # a column block reads its R slice at once
    bt = tokens_per_program
    _rotate_q_kernel[(triton.cdiv(t, bt), h, d // eb)](
        q, q.stride(0), q.stride(1), rot, out, out.stride(0), out.stride(1), t,
        GQ=gq, BH=triton.next_power_of_2(gq), BT=bt, D=d, KB=kb, EB=eb, TRANSPOSE=bool(transpose),
        PRECISION=precision, PDL_WAIT=pdl_wait, PDL_RELEASE=pdl_release, num_warps=num_warps,
        launch_pdl=pdl_wait)
    return out


# rows (tokens x query heads of a KV head) per rotation program in extend: R[h] (64 KB at
# D = 128, float32) is then read once per 32 rows instead of once per token. sm_90 build
# (tests/aot_sm90.py, D = 128, GQ = 4, ieee): 32 rows x 8 warps 79 registers; 64 rows x 8
# warps 203; 64 rows x 4 warps spills 2 KB.
EXTEND_ROTATION_ROWS = 32


def rotate_tokens(q: torch.Tensor, rot: torch.Tensor, out: torch.Tensor, precision: str = "ieee",
                  transpose: bool = False) -> torch.Tensor:
    """rotate_queries for many tokens (extend): EXTEND_ROTATION_ROWS rows per program."""
    gqp = triton.next_power_of_2(q.shape[1] // rot.shape[0])
    return rotate_queries(q, rot, out, precision, num_warps=8, transpose=transpose,
                          tokens_per_program=max(1, EXTEND_ROTATION_ROWS // gqp))


def triton_decode(q: torch.Tensor, layer: HybridLayerCache, index: HybridCacheIndex,
                  rotation: LayerRotation, req_to_token: torch.Tensor, rows: torch.Tensor,
                  seq_lens: torch.Tensor, sm_scale: float, out: torch.Tensor | None = None,
                  workspace: DecodeWorkspace | None = None,
                  config: DecodeConfig | None = None) -> torch.Tensor:
    """Decode attention (api.decode_attention semantics): returns o [B, Hq, D] (q.dtype or
    ``out``'s dtype), un-rotated. Allocates only when ``workspace``/``out`` are None."""
    check_decode_inputs(q, layer, rotation, rows, seq_lens)
    b, hq, d = q.shape
    h = layer.num_kv_heads
    gq = hq // h
    if workspace is None:
        workspace = DecodeWorkspace(b, hq, h, d, q.device, config)
    elif (workspace.num_q_heads, workspace.num_kv_heads, workspace.head_dim) != (hq, h, d):
        raise ValueError("workspace was allocated for other head counts / head_dim")
    cfg = config or workspace.config
    if cfg.merge_grid not in MERGE_GRIDS:
        raise ValueError(f"DecodeConfig.merge_grid must be one of {MERGE_GRIDS}, not {cfg.merge_grid!r}")
    merge_grid = cfg.merge_grid_for(b)
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    check_last_dim_contiguous("out", out)
    check_last_dim_contiguous("req_to_token", req_to_token)
    spans = min(layer.key_group_size, layer.value_group_size) >= d
    ns, q_rot, mid_o, mid_lse = workspace.views(b, config, spans)
    pdl = cfg.programmatic_launch and pdl_supported(q.device)
    rotate_queries(q, rotation.k_rot.contiguous(), q_rot, cfg.fp32_precision, out_block=cfg.rotate_out_block,
                   pdl_release=pdl)
    lay = layer
    bh = _block_h(gq, cfg)
    block_n, max_registers = cfg.stage1_shape_for(b, spans)
    num_stages, int64_slots = cfg.pipeline_for(b, block_n, max_registers)
    magic = cfg.magic_unpack
    kpk, vpk, spk_s, spk_h = pair_views(lay)
    scale_args = group_scale_args(lay, cfg.float8_words)
    _decode_stage1[(b, h, ns + 1)](
        q_rot, q_rot.stride(0), q_rot.stride(1), rows, seq_lens, req_to_token, req_to_token.stride(0),
        index.sink_slot_of_page, index.page_of_sink_slot, index.page_size, index.ring_valid_from,
        kpk, vpk, spk_s, spk_h,
        lay.k_scales, lay.v_scales, lay.k_scales.stride(0), lay.k_scales.stride(1), lay.k_scales.stride(2),
        *scale_args[:4],
        lay.k_sink, lay.v_sink, lay.k_sink.stride(0), lay.k_sink.stride(1), lay.k_sink.stride(2),
        lay.k_ring, lay.v_ring, lay.k_ring.stride(0), lay.k_ring.stride(1), lay.k_ring.stride(2),
        mid_o, mid_lse, sm_scale * LOG2E,
        NS=ns, MIN_CHUNK=cfg.min_chunk, GQ=gq, BH=bh, D=d, GK=lay.key_group_size, GV=lay.value_group_size,
        S=lay.sink_tokens, W=lay.recent_window, BN=block_n, BN_BF16=cfg.bf16_block_for(max_registers),
        PAIR=scale_args[4], MAGIC=magic, USE_DOT=cfg.use_dot, INTERP=INTERPRET,
        SLOT64=int64_slots or needs_int64_slots(lay), HALF=half_keys(cfg.half_keys, magic, lay),
        SLOT_AHEAD=cfg.slot_ahead, PDL=pdl, num_warps=cfg.num_warps,
        num_stages=num_stages,
        maxnreg=max_registers, launch_pdl=pdl,
    )
    if merge_grid == "split":
        if workspace.o_rot.numel() < b * hq * d:
            raise ValueError('merge_grid="split" needs a workspace made with that config (its o\' buffer)')
        o_rot = workspace.o_rot[:b * hq * d].view(b, hq, d)
        db = min(32, d)
        _decode_merge_split[(b, hq, d // db)](mid_o, mid_lse, o_rot, NSP=ns + 1, NSP2=workspace.merge_width, D=d,
                                               DB=db, PDL=pdl, num_warps=4, launch_pdl=pdl)
        rotate_queries(o_rot, rotation.v_rot.contiguous(), out, cfg.fp32_precision, transpose=True,
                       out_block=cfg.rotate_out_block or db, pdl_wait=pdl)
    elif merge_grid == "query_head":
        _decode_merge_row[(b, hq)](
            mid_o, mid_lse, rotation.v_rot.contiguous(), out, out.stride(0), out.stride(1),
            NSP=ns + 1, NSP2=workspace.merge_width, GQ=gq, D=d, EB=min(32, d), SPB=cfg.merge_partials_for(merge_grid),
            PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
    else:
        _decode_merge[(b, h)](
            mid_o, mid_lse, rotation.v_rot.contiguous(), out, out.stride(0), out.stride(1),
            NSP=ns + 1, NSP2=workspace.merge_width, GQ=gq, BH=bh, D=d, EB=min(32, d),
            SPB=cfg.merge_partials_for(merge_grid), PRECISION=cfg.merge_precision, PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )
    return out


def int2_bytes_read(layer: HybridLayerCache, seq_lens: list[int], num_q_heads: int) -> int:
    """Bytes decode must read for the given lengths: codes + scales of every INT2 position,
    bf16 K/V of the sink and ring windows, req_to_token entries and q (for GBps figures)."""
    h, d = layer.num_kv_heads, layer.head_dim
    s, w = layer.sink_tokens, layer.recent_window
    per_int2 = 2 * layer.k_packed.shape[-1] + (layer.k_scales[0, 0].numel() + layer.v_scales[0, 0].numel()) \
        * layer.k_scales.element_size()
    total = 0
    for n in seq_lens:
        bf = min(n, s + w)
        total += h * ((n - bf) * per_int2 + bf * 2 * d * 2) + 4 * n
    return total + len(seq_lens) * num_q_heads * d * 2
