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
   few query rows of a KV head sit on the small side of the tensor-core shapes; the INT2
   part is triton_hybrid_attn's (raw codes in tensor-core dots, its module doc).
   The number of INT2 splits of request b is decided on device:
        ns_b = min(NS, max(1, cdiv(L_b, MIN_CHUNK))),  L_b = INT2 positions of b,
   under NS = clamp(target_programs // (B * H), 1, max_splits) of the batch size (by default
   the stage-1 programs resident at once, so batch 1 still fills the GPU). NS is a runtime
   argument: one compiled kernel serves every batch size.
3. ``_decode_merge_row`` log-sum-exp merge of the 1 + NS partials (plus, for models with learned
   attention sinks, the query head's sink logit as one more denominator term), then o = o' @ R_V[h]^T,
   one program per query head (up to SPLIT_MERGE_MAX_BATCH requests: ``_decode_merge_split``,
   one program per query head and channel block; from DecodeConfig.block_rotation_min_batch
   requests on, the query-head merge without its un-rotation; both then un-rotate by
   ``_rotate_q_kernel``).

Rotations: a small batch rotates one row per program (D/32 programs per row: a short chain of
loads for a few rows); from ``block_rotation_min_batch`` requests on, both rotations take
blocks of rows per program as extend does (R[h] read once per EXTEND_ROTATION_ROWS rows), since
per-row programs re-read R[h] (32-64 KB) for every request and query head: at 159 requests of a
served Qwen3-8B step, the query-head merge alone re-read ~167 MB of rotations per layer.

On sm_90+ launches 2 and 3 (and the split merge's un-rotation) use programmatic dependent
launch (triton_common.wait_for_prior_grid): stage 1 reads its request layout meanwhile.

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
from .triton_common import (INTERPRET, bf16_side_args, check_cache_layout, check_last_dim_contiguous,
                            group_scale_args, head_index, needs_int64_slots, pair_views, pdl_supported,
                            release_dependent_grid, scale_args, sink_index_args, wait_for_prior_grid)
from .triton_hybrid_attn import (bf16_side_t, int2_finish, int2_query, int2_range, int2_state, key_noise_query,
                                 request_layout, store_pairs)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _rotate_q_kernel(q_ptr, stride_q_token, stride_q_head, rot_ptr, out_ptr, stride_out_token, stride_out_head, T,
                     GQ: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, KB: tl.constexpr,
                     EB: tl.constexpr, TRANSPOSE: tl.constexpr,
                     PDL_WAIT: tl.constexpr = False, PDL_RELEASE: tl.constexpr = False):
    """out[t, h*GQ + g, e] = sum_c x[t, h*GQ + g, c] R[h][c, e] (R[h][e, c] when TRANSPOSE)
    for the EB output columns e of program (token block, h, e-block); float32 ("ieee") dot
    over K chunks of KB read from memory, stored in out's dtype. Grid (cdiv(T, BT), H, D / EB):
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
    row_q = t * stride_q_token + (h * GQ + g) * stride_q_head
    kb = tl.arange(0, KB)
    rot = rot_ptr + h.to(tl.int64) * D * D
    acc = tl.zeros([BT * BH, EB], tl.float32)
    for c0 in tl.static_range(0, D, KB):
        qs = tl.load(q_ptr + row_q[:, None] + c0 + kb[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        if TRANSPOSE:  # rs[k, e] = R[e, c0 + k]
            rs = tl.load(rot + e[None, :] * D + (c0 + kb)[:, None]).to(tl.float32)
        else:
            rs = tl.load(rot + (c0 + kb)[:, None] * D + e[None, :]).to(tl.float32)
        acc = tl.dot(qs, rs, acc, input_precision="ieee")
    row_o = t * stride_out_token + (h * GQ + g) * stride_out_head
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
# batch size (a constexpr NS would compile once per CUDA-graph batch size at server start).
@triton.jit(do_not_specialize=["NS"])
def _decode_stage1(q_rot_ptr, stride_q_batch, stride_q_head, rows_ptr, lens_ptr,
                   req_to_token_ptr, stride_req_to_token_row, sink_slot_of_page_ptr, page_of_sink_slot_ptr,
                   page_size, ring_valid_from_ptr,
                   k_pairs_ptr, v_pairs_ptr, stride_pair_slot, stride_pair_head,
                   k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_head, stride_scale_group,
                   k_scale_pairs_ptr, v_scale_pairs_ptr, stride_scale_pair_slot, stride_scale_pair_head,
                   k_sink_ptr, v_sink_ptr, stride_sink_slot, stride_sink_pos, stride_sink_head,
                   k_ring_ptr, v_ring_ptr, stride_ring_row, stride_ring_cell, stride_ring_head,
                   mid_o_ptr, mid_lse_ptr, qk_scale,
                   NS, MIN_CHUNK: tl.constexpr,
                   GQ: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                   S: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, BN_BF16: tl.constexpr,
                   PAIR: tl.constexpr, INTERP: tl.constexpr, SLOT64: tl.constexpr, PDL: tl.constexpr = False,
                   DEBIAS: tl.constexpr = False):
    """Partial attention of one (request, KV head, split); see module doc. mid_o is
    [B, Hq, 1 + NS, D] float32 (o~ = sum p v / sum p), mid_lse [B, Hq, 1 + NS] (log2).
    PDL: launched while the query rotation runs; the request layout (written before that
    kernel) is read first, q' and the partials only after wait_for_prior_grid. DEBIAS: the
    INT2 scores' key debias (triton_hybrid_attn module doc)."""
    HALF: tl.constexpr = GK >= D // 4  # key codes unpack as float16 when a key group spans a plane
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    num_h = tl.num_programs(1)
    g = tl.arange(0, BH)
    hmask = g < GQ
    hq = (h * GQ + g).to(tl.int64)
    row, n, c, s_b, ring_lo = request_layout(b, rows_ptr, lens_ptr, req_to_token_ptr, stride_req_to_token_row,
                                             sink_slot_of_page_ptr, page_of_sink_slot_ptr, page_size,
                                             ring_valid_from_ptr, S, W)
    wait_for_prior_grid(PDL)
    mid_row = (b * num_h * GQ + hq) * (NS + 1) + sp  # [BH] index of (b, hq, sp)
    q_vec = q_rot_ptr + b * stride_q_batch + hq * stride_q_head  # [BH] pointers to the q' rows
    if sp == 0:
        # ---- BF16 side cache: sinks [0, s_b) and ring [ring_lo, n), transposed tiles
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_t = tl.zeros([16, BH], tl.float32)
        za = tl.zeros([D // 4, BH], tl.float32)
        acc = (za, za, za, za)
        if S + W > 0:
            m_i, l_t, acc = bf16_side_t(q_vec, hmask, m_i, l_t, acc, s_b, ring_lo, n,
                                        k_sink_ptr + tl.maximum(c, 0) * stride_sink_slot + h * stride_sink_head,
                                        v_sink_ptr + tl.maximum(c, 0) * stride_sink_slot + h * stride_sink_head,
                                        stride_sink_pos,
                                        k_ring_ptr + row * stride_ring_row + h * stride_ring_head,
                                        v_ring_ptr + row * stride_ring_row + h * stride_ring_head,
                                        stride_ring_cell, qk_scale, S, W, BN_BF16, D, INTERP)
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
        qops, qsums = int2_query(q_vec, hmask, qk_scale, D, GK, HALF)
        qv = key_noise_query(q_vec, hmask, qk_scale, D, GK, DEBIAS)
        hh = head_index(h, SLOT64)
        st = int2_range(qops, qsums, qv, int2_state(BH, D, GV), lo, hi, req_to_token_ptr + row * stride_req_to_token_row,
                        k_pairs_ptr, v_pairs_ptr, stride_pair_slot, hh * stride_pair_head,
                        k_scales_ptr, v_scales_ptr, stride_scale_slot, stride_scale_group, hh * stride_scale_head,
                        k_scale_pairs_ptr, v_scale_pairs_ptr, stride_scale_pair_slot, hh * stride_scale_pair_head,
                        BN, D, GK, GV, PAIR, INTERP, SLOT64, HALF, True, DEBIAS)
        outs, m_i, l_i = int2_finish(st, D, GV)
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


@triton.jit
def add_sink(m, l, sinks_ptr, hq, HAS_SINK: tl.constexpr):
    """A query head's merge statistics (scalars m, l = sum_s 2^(lse_s - m), log2) with its learned
    sink logit (natural units, gpt-oss) joined as one more term of the denominator, no value."""
    if HAS_SINK:
        s2 = tl.load(sinks_ptr + hq).to(tl.float32) * 1.4426950408889634  # LOG2E
        m_new = tl.maximum(m, s2)
        l = l * tl.exp2(m - m_new) + tl.exp2(s2 - m_new)
        m = m_new
    return m, l


@triton.jit(do_not_specialize=["NSP"])
def _decode_merge_row(mid_o_ptr, mid_lse_ptr, rot_ptr, out_ptr, stride_out_batch, stride_out_head, sinks_ptr,
                      NSP, NSP2: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, EB: tl.constexpr,
                      SPB: tl.constexpr, HAS_SINK: tl.constexpr = False, PDL: tl.constexpr = False,
                      UNROTATE: tl.constexpr = True):
    """o[b, hq] = (sum_s 2^{lse_s - m} o~_s / sum_s 2^{lse_s - m}) @ R_V[h]^T with h = hq // GQ
    and m the max of the lse_s (one vector load), one query head per program, grid (B, Hq);
    the partials up to the last one that attended to something, SPB at a time as [SPB, D]
    tiles (independent loads, no running rescale); the un-rotation o[e] = sum_d o'[d]
    R_V[h][e, d] as float32 products and sums. HAS_SINK: sinks_ptr[hq] joins the denominator
    (add_sink). PDL: launched with programmatic dependent launch (waits for stage 1 first).
    UNROTATE=False: o' itself (float32) goes to out, un-rotated afterwards in row blocks."""
    wait_for_prior_grid(PDL)
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    num_hq = tl.num_programs(1)
    d = tl.arange(0, D)
    base = (b * num_hq + hq) * NSP
    sps = tl.arange(0, NSP2)  # NSP2: power of two >= every NSP of the workspace (host-computed)
    lse_all = tl.load(mid_lse_ptr + base + sps[None, :], mask=(sps < NSP)[None, :], other=float("-inf"))
    m, l, used = merge_stats(lse_all, sps)
    m, l = add_sink(tl.max(m, 0), tl.max(l, 0), sinks_ptr, hq, HAS_SINK)  # the one row's values as scalars
    acc = tl.zeros([D], tl.float32)
    spb = tl.arange(0, SPB)
    for sp0 in range(0, used, SPB):
        sp = sp0 + spb
        lse = tl.load(mid_lse_ptr + base + sp, mask=sp < used, other=float("-inf"))
        w = tl.exp2(lse - m)
        o = tl.load(mid_o_ptr + (base + sp)[:, None] * D + d[None, :], mask=(w > 0)[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    o_rot = acc / tl.where(l > 0, l, 1.0)
    if not UNROTATE:
        tl.store(out_ptr + b * stride_out_batch + hq * stride_out_head + d, o_rot)
        return
    e = tl.arange(0, EB)
    rot = rot_ptr + (hq // GQ) * D * D
    for e0 in tl.static_range(0, D, EB):
        r = tl.load(rot + (e0 + e)[:, None] * D + d[None, :]).to(tl.float32)  # r[e, d] = R[e0 + e, d]
        oc = tl.sum(r * o_rot[None, :], 1)
        tl.store(out_ptr + b * stride_out_batch + hq * stride_out_head + e0 + e, oc.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["NSP"])
def _decode_merge_split(mid_o_ptr, mid_lse_ptr, o_rot_ptr, sinks_ptr, NSP, NSP2: tl.constexpr, D: tl.constexpr,
                        DB: tl.constexpr, HAS_SINK: tl.constexpr = False, PDL: tl.constexpr = False):
    """o'[b, hq, c] = sum_s 2^{lse_s - m} o~_s[c] / sum_s 2^{lse_s - m} for the DB channels c of
    program (b, hq, channel block), every partial in one [NSP2, DB] load (no loop: the
    latency of one load instead of a chain); float32 o' in the rotated space (the
    un-rotation o = o' R_V^T is a separate launch). Grid (B, Hq, D / DB). HAS_SINK, PDL: as
    _decode_merge_row."""
    wait_for_prior_grid(PDL)
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    num_hq = tl.num_programs(1)
    base = (b * num_hq + hq) * NSP
    sps = tl.arange(0, NSP2)
    lse = tl.load(mid_lse_ptr + base + sps[None, :], mask=(sps < NSP)[None, :], other=float("-inf"))
    m, l, _ = merge_stats(lse, sps)
    m, l = add_sink(tl.max(m, 0), tl.max(l, 0), sinks_ptr, hq, HAS_SINK)  # the one row's values as scalars
    w = tl.exp2(tl.reshape(lse, [NSP2]) - m)
    c = tl.program_id(2) * DB + tl.arange(0, DB)
    o = tl.load(mid_o_ptr + (base + sps)[:, None] * D + c[None, :], mask=(w > 0)[:, None], other=0.0)
    acc = tl.sum(w[:, None] * o, 0) / tl.where(l > 0, l, 1.0)
    tl.store(o_rot_ptr + (b * num_hq + hq) * D + c, acc)


# ----------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class Stage1Tiles:
    """How decode stage 1 is launched (one batch regime of one layout class)."""

    block_n: int  # INT2 tokens per step
    block_n_bf16: int  # sink / ring tokens per step
    max_registers: int | None  # ptxas register cap (maxnreg); None: uncapped
    num_stages: int  # software-pipeline depth of the token loops
    int64_slots: bool  # slot and head offsets in int64 (int64 anyway where int32 cannot hold them)


@dataclass(frozen=True)
class LayoutTiles:
    """Stage 1's tiles of one layout class: ``small`` up to ``small_batch_max`` requests,
    ``large`` above it (and at every batch of a batch-invariant decode)."""

    small_batch_max: int
    small: Stage1Tiles
    large: Stage1Tiles


# The tuned tables (H200; measurements in benchmarks/DECODE_KERNEL_LOG.md), keyed by whether
# both K and V groups span the head (G = D): such a layout keeps one dot chain per token.
STAGE1_TILES = {
    # G = D (e.g. G=128 / float16 at head_dim 128): long uncapped steps while programs are few,
    # then 64-token steps under a 168-register cap (12 programs per SM, no spills in the loops)
    True: LayoutTiles(small_batch_max=4,
                      small=Stage1Tiles(block_n=128, block_n_bf16=64, max_registers=None, num_stages=2,
                                        int64_slots=False),
                      large=Stage1Tiles(block_n=64, block_n_bf16=16, max_registers=168, num_stages=2,
                                        int64_slots=False)),
    # smaller groups (the default layout: keys D/4, values 128): per-group chains and sums need
    # the registers (a cap spills), so uncapped 64-token steps; above batch 1 a 3-stage pipeline
    # with int64 offsets issues each block's copies a full step ahead
    False: LayoutTiles(small_batch_max=1,
                       small=Stage1Tiles(block_n=64, block_n_bf16=64, max_registers=None, num_stages=2,
                                         int64_slots=False),
                       large=Stage1Tiles(block_n=64, block_n_bf16=64, max_registers=None, num_stages=3,
                                         int64_slots=True)),
}
STAGE1_WARPS = 1  # the V-side dots have 16-row tiles (D/8 byte pairs): a second warp would duplicate them
UNCAPPED_REGISTERS = 232  # registers per thread of an uncapped stage 1 (sm_90), for resident_per_sm
MIN_BLOCK_H = 8  # query-head rows per stage-1 program at least (the tensor cores' smallest N)
ROTATE_OUT_BLOCK = 32  # output columns per decode rotation program: a row's rotation over D/32 programs
SPLIT_MERGE_MAX_BATCH = 4  # the split merge up to this many requests (latency), the query-head merge above
BLOCK_ROTATION_MIN_BATCH = 32  # from this many requests: both rotations in row blocks (module doc)
MERGE_PARTIALS_PER_STEP = 64  # partials the query-head merge loads at once ([64, D] tiles)


@dataclass
class DecodeConfig:
    """How decode splits its work; stage 1's launch shape comes from STAGE1_TILES."""

    max_splits: int = 128  # NS upper bound (static: fixes the grid and the workspace)
    # INT2 programs to aim for: NS = clamp(target // (B * H), 1, max_splits), at most one
    # wave of equally long programs (a second, partial wave would double the time).
    # 0: the programs resident at once (SMs x resident_per_sm()) on CUDA, 16 on CPU.
    target_programs: int = 0
    min_chunk: int = 256  # fewest INT2 tokens per split
    # one stage-1 shape and one merge at every batch (the large-batch tiles, the query-head
    # merge): deterministic inference, see batch_invariant_config
    batch_invariant: bool = False
    # requests from which both rotations run in row blocks (the merge leaves o' un-rotated)
    block_rotation_min_batch: int = BLOCK_ROTATION_MIN_BATCH

    def stage1_tiles(self, batch: int, groups_span_head: bool = True) -> Stage1Tiles:
        """Stage 1's tiles for a batch of ``batch`` requests. ``groups_span_head``: both K
        and V have one INT2 group per head (G = D)."""
        table = STAGE1_TILES[bool(groups_span_head)]
        small = batch <= table.small_batch_max and not self.batch_invariant
        return table.small if small else table.large

    def merge_grid_for(self, batch: int) -> str:
        """The merge a batch of ``batch`` requests runs: "split" or "query_head"."""
        return "split" if batch <= SPLIT_MERGE_MAX_BATCH and not self.batch_invariant else "query_head"

    def block_rotation(self, batch: int) -> bool:
        """Whether a batch of ``batch`` requests rotates q' and o' in blocks of rows (module doc)."""
        return batch >= self.block_rotation_min_batch and not self.batch_invariant

    def resident_per_sm(self, batch: int, groups_span_head: bool = True) -> int:
        """Stage-1 programs an SM holds at once, from the register budget (65536 per SM;
        shared memory, ~7 KB per program, is not the limit)."""
        regs = self.stage1_tiles(batch, groups_span_head).max_registers or UNCAPPED_REGISTERS
        regs = -(-regs // 8) * 8
        return max(1, min(32, 65536 // (32 * STAGE1_WARPS * regs)))

    def splits_for(self, batch: int, num_kv_heads: int, device, groups_span_head: bool = True) -> int:
        target = self.target_programs or _default_target(device, self, batch, groups_span_head)
        return max(1, min(self.max_splits, target // max(1, batch * num_kv_heads)))


# scratch a batch-invariant decode may take for its partials (1 + max_splits per request row)
BATCH_INVARIANT_WORKSPACE_BYTES = 512 << 20


def batch_invariant_config(max_context: int, max_batch: int, num_q_heads: int, head_dim: int,
                           workspace_bytes: int = BATCH_INVARIANT_WORKSPACE_BYTES,
                           base: DecodeConfig | None = None) -> DecodeConfig:
    """A DecodeConfig whose output for a request does not depend on the rest of the batch
    (deterministic inference): one stage-1 shape and one merge at every batch
    (``batch_invariant``), and INT2 splits that depend on the request's length only:
        NS = max_splits at every batch, the most whose partials for ``max_batch`` rows fit
             ``workspace_bytes`` (max_batch (1 + NS) Hq (D + 1) 4 bytes), at most base's
        MIN_CHUNK = max(base.min_chunk, round_up(cdiv(max_context, NS), BLOCK_N))
        ns_b = cdiv(L_b, MIN_CHUNK) <= NS
    with BLOCK_N the large-batch tiles' INT2 step. Fewer splits than the default at small
    batches: slower there, the price of invariance."""
    base = base or DecodeConfig()
    per_row = max(1, max_batch) * num_q_heads * (head_dim + 1) * 4
    splits = max(1, min(base.max_splits, workspace_bytes // per_row - 1))
    per_split = -(-max(1, max_context) // splits)
    block_n = max(t.large.block_n for t in STAGE1_TILES.values())
    min_chunk = max(base.min_chunk, -(-per_split // block_n) * block_n)
    return replace(base, batch_invariant=True, max_splits=splits, min_chunk=min_chunk, target_programs=1 << 30)


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
        split_rows = max((b for b in range(1, max_batch + 1)
                          if self.config.merge_grid_for(b) == "split" or self.config.block_rotation(b)), default=0)
        self.o_rot = torch.empty(split_rows * num_q_heads * head_dim, dtype=torch.float32, device=device)

    def launch(self, batch: int, groups_span_head: bool = True) -> "DecodeLaunch":
        """The resolved launch of a batch of ``batch`` requests (once per batch, shared by
        every layer): its split count, stage-1 tiles, merge and views of this scratch.
        ``groups_span_head``: both K and V have one INT2 group per head (DecodeConfig.stage1_tiles)."""
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the workspace's max_batch {self.max_batch}")
        cfg = self.config
        ns = cfg.splits_for(batch, self.num_kv_heads, self.device, groups_span_head)
        split_merge = cfg.merge_grid_for(batch) == "split"
        block = cfg.block_rotation(batch)
        hq, d = self.num_q_heads, self.head_dim
        return DecodeLaunch(
            batch=batch, splits=ns, min_chunk=cfg.min_chunk, tiles=cfg.stage1_tiles(batch, groups_span_head),
            split_merge=split_merge, block_rotation=block, merge_width=self.merge_width,
            pdl=pdl_supported(self.device),
            q_rot=self.q_rot[:batch * hq * d].view(batch, hq, d),
            mid_o=self.mid_o[:batch * hq * (ns + 1) * d].view(batch, hq, ns + 1, d),
            mid_lse=self.mid_lse[:batch * hq * (ns + 1)].view(batch, hq, ns + 1),
            o_rot=self.o_rot[:batch * hq * d].view(batch, hq, d) if split_merge or block else None)


@dataclass(frozen=True)
class DecodeLaunch:
    """How one decode batch runs (DecodeWorkspace.launch): resolved once per batch."""

    batch: int  # B
    splits: int  # NS: INT2 splits per (request, KV head); stage 1 runs NS + 1 programs (+1: sink/ring)
    min_chunk: int
    tiles: Stage1Tiles
    split_merge: bool  # the split merge + separate un-rotation (small batches), else the query-head merge
    block_rotation: bool  # both rotations in blocks of rows (large batches), else one row per program
    merge_width: int  # power of two >= max_splits + 1 (the merge's lse vector)
    pdl: bool  # programmatic dependent launch between the kernels
    q_rot: torch.Tensor  # bf16 [B, Hq, D] rotated queries
    mid_o: torch.Tensor  # float32 [B, Hq, 1 + NS, D] partial outputs
    mid_lse: torch.Tensor  # float32 [B, Hq, 1 + NS] their log2-sum-exp
    o_rot: torch.Tensor | None  # float32 [B, Hq, D] merged o' (split merge or block rotation only)


def _block_h(gq: int) -> int:
    return max(triton.next_power_of_2(gq), MIN_BLOCK_H)


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int) -> None:
    """Learned sink logits are one contiguous value per query head."""
    if sinks is not None and (sinks.shape != (num_q_heads,) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous [{num_q_heads}] tensor (one logit per query head), "
                         f"got {tuple(sinks.shape)}")


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


def rotate_queries(q: torch.Tensor, rot: torch.Tensor, out: torch.Tensor, num_warps: int = 4,
                   transpose: bool = False, out_block: int = 0, tokens_per_program: int = 1,
                   pdl_wait: bool = False, pdl_release: bool = False) -> torch.Tensor:
    """out[t, hq] = q[t, hq] @ rot[hq // (Hq/H)] (or @ rot^T when ``transpose``) for q
    [T, Hq, D]; rot [H, D, D] float32; out in any float dtype (the rounding of the store).
    ``out_block``: output columns per program (0: all D; decode: ROTATE_OUT_BLOCK, D/32
    programs per row block, each reading its R columns in one K chunk). ``tokens_per_program``
    (a power of two): tokens per program (decode: 1; extend: EXTEND_ROTATION_ROWS rows, see
    rotate_tokens). ``pdl_wait``: launched with programmatic dependent launch, q being the
    previous kernel's output; ``pdl_release``: the next kernel may start at once (both need
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
        PDL_WAIT=pdl_wait, PDL_RELEASE=pdl_release, num_warps=num_warps, launch_pdl=pdl_wait)
    return out


# rows (tokens x query heads of a KV head) per rotation program in extend: R[h] (64 KB at
# D = 128, float32) is then read once per 32 rows instead of once per token (64 rows spill)
EXTEND_ROTATION_ROWS = 32


def rotate_tokens(q: torch.Tensor, rot: torch.Tensor, out: torch.Tensor, transpose: bool = False,
                  **pdl) -> torch.Tensor:
    """rotate_queries for many rows (extend, and decode from block_rotation_min_batch requests):
    EXTEND_ROTATION_ROWS rows per program. ``pdl``: rotate_queries' pdl_wait / pdl_release."""
    gqp = triton.next_power_of_2(q.shape[1] // rot.shape[0])
    return rotate_queries(q, rot, out, num_warps=8, transpose=transpose,
                          tokens_per_program=max(1, EXTEND_ROTATION_ROWS // gqp), **pdl)


def _row_rotate(x, rot, out, **pdl):
    """Decode's rotation of a small batch: one row per program, D/ROTATE_OUT_BLOCK programs per row."""
    return rotate_queries(x, rot, out, out_block=ROTATE_OUT_BLOCK, **pdl)


def triton_decode(q: torch.Tensor, layer: HybridLayerCache, index: HybridCacheIndex,
                  rotation: LayerRotation, req_to_token: torch.Tensor, rows: torch.Tensor,
                  seq_lens: torch.Tensor, sm_scale: float, out: torch.Tensor | None = None,
                  workspace: DecodeWorkspace | None = None,
                  config: DecodeConfig | None = None, launch: DecodeLaunch | None = None,
                  sinks: torch.Tensor | None = None, key_debias: bool = False) -> torch.Tensor:
    """Decode attention (reference.reference_decode between the rotations): returns o [B, Hq, D] (q.dtype or
    ``out``'s dtype), un-rotated. ``sinks``: [Hq] learned sink logits (any float dtype) or None;
    ``key_debias``: the INT2 scores' debias (reference module doc).
    ``launch``: the batch's resolved launch
    (DecodeWorkspace.launch; else resolved here from ``workspace``, or from a workspace made
    here with ``config``). Allocates only when ``launch``/``workspace`` and ``out`` are None."""
    check_decode_inputs(q, layer, rotation, rows, seq_lens)
    b, hq, d = q.shape
    h = layer.num_kv_heads
    gq = hq // h
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if launch is None:
        if workspace is None:
            workspace = DecodeWorkspace(b, hq, h, d, q.device, config)
        elif (workspace.num_q_heads, workspace.num_kv_heads, workspace.head_dim) != (hq, h, d):
            raise ValueError("workspace was allocated for other head counts / head_dim")
        launch = workspace.launch(b, min(layer.key_group_size, layer.value_group_size) >= d)
    elif launch.q_rot.shape != (b, hq, d):
        raise ValueError(f"launch planned for q {tuple(launch.q_rot.shape)}, got {tuple(q.shape)}")
    check_last_dim_contiguous("out", out)
    check_last_dim_contiguous("req_to_token", req_to_token)
    check_sinks(sinks, hq)
    ns, tiles, pdl = launch.splits, launch.tiles, launch.pdl
    q_rot, mid_o, mid_lse = launch.q_rot, launch.mid_o, launch.mid_lse
    rotate = rotate_tokens if launch.block_rotation else _row_rotate
    rotate(q, rotation.k_rot.contiguous(), q_rot, pdl_release=pdl)
    scale_pairs = group_scale_args(layer)
    _decode_stage1[(b, h, ns + 1)](
        q_rot, q_rot.stride(0), q_rot.stride(1), rows, seq_lens, *sink_index_args(index, req_to_token),
        index.ring_valid_from, *pair_views(layer), *scale_args(layer), *scale_pairs[:4], *bf16_side_args(layer),
        mid_o, mid_lse, sm_scale * LOG2E,
        NS=ns, MIN_CHUNK=launch.min_chunk, GQ=gq, BH=_block_h(gq), D=d, GK=layer.key_group_size,
        GV=layer.value_group_size, S=layer.sink_tokens, W=layer.recent_window, BN=tiles.block_n,
        BN_BF16=tiles.block_n_bf16, PAIR=scale_pairs[4], INTERP=INTERPRET,
        SLOT64=tiles.int64_slots or needs_int64_slots(layer), PDL=pdl, DEBIAS=key_debias, num_warps=STAGE1_WARPS,
        num_stages=tiles.num_stages, maxnreg=tiles.max_registers, launch_pdl=pdl,
    )
    if launch.split_merge:
        db = min(32, d)
        _decode_merge_split[(b, hq, d // db)](mid_o, mid_lse, launch.o_rot, mid_lse if sinks is None else sinks,
                                               NSP=ns + 1, NSP2=launch.merge_width, D=d, DB=db,
                                               HAS_SINK=sinks is not None, PDL=pdl, num_warps=4, launch_pdl=pdl)
    else:
        merged = launch.o_rot if launch.block_rotation else out  # o' (float32), or o itself
        _decode_merge_row[(b, hq)](
            mid_o, mid_lse, rotation.v_rot.contiguous(), merged, merged.stride(0), merged.stride(1),
            mid_lse if sinks is None else sinks,
            NSP=ns + 1, NSP2=launch.merge_width, GQ=gq, D=d, EB=min(32, d), SPB=MERGE_PARTIALS_PER_STEP,
            HAS_SINK=sinks is not None, PDL=pdl, UNROTATE=not launch.block_rotation, num_warps=4, launch_pdl=pdl,
        )
    if launch.o_rot is not None:  # the merge left o' rotated: o = o' R_V^T
        rotate(launch.o_rot, rotation.v_rot.contiguous(), out, transpose=True, pdl_wait=pdl)
    return out

