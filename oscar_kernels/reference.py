"""Pure-PyTorch twins of the kernels: the oracle every Triton kernel is tested against.

Shapes: T new tokens, B requests, H KV heads, Hq query heads (Hq % H == 0, query head h
reads KV head h // (Hq // H)), D head_dim. All attention runs in the rotated space:
callers pass q' = q R_K and get o' (un-rotate with o = o' R_V^T, see :func:`rotate`).

Key debias (``key_debias=True``; off by default, see below): an INT2 key's rounding error e (uniform in
+-scale/2 per channel, variance scale^2 / 12) adds q'.e to its logit, and E[exp(x + q'.e)] =
exp(x + var/2): every history key is weighted up against the exact BF16 sinks and ring, the more
the longer the history. Each INT2 position's logit therefore subtracts half its noise variance,
    sm_scale^2 / 24 * sum_g scale_g^2 |q'_g|^2        (g: the key's channel groups),
which needs nothing but the stored scales (:func:`key_noise_bias`). It is right on average
(SmolLM2-135M: perplexity and agreement with BF16 improve) but costs retrieval (passkey hits
fall, benchmarks/RESULTS.md), so it is an opt-in (--oscar-key-debias on), not the default.
"""
from __future__ import annotations

import torch

from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation, sink_slot_for
from .int2 import dequantise, quantise_rotated, unpack


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] @ rotation [H, D, D] per head (float32). Use rotation.transpose(-1, -2)
    to undo a rotation. For query heads, repeat the KV-head rotations GQA-wise first."""
    return torch.einsum("thd,hde->the", x.float(), rotation.float())


def expand_gqa(per_kv_head: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[H, ...] -> [Hq, ...]: the KV head's tensor for every query head that reads it."""
    return per_kv_head.repeat_interleave(num_q_heads // per_kv_head.shape[0], dim=0)


def reference_store(layer: HybridLayerCache, index: HybridCacheIndex, rotation: LayerRotation,
                    req_to_token: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                    seq_ends: torch.Tensor, write_int2: bool = True, write_ring: bool = True,
                    write_sink: bool | None = None):
    """Write T new tokens (k, v unrotated [T, H, D]) into the hybrid cache. write_int2:
    INT2 codes+scales at ``slots``. write_sink (default: write_int2): BF16 sinks for
    positions < S (when the sequence's first page owns a sink slot; a speculative verify
    stores INT2 without sinks, its commit sinks without INT2). write_ring: BF16 ring cells for positions
    ``>= seq_ends - W`` (seq_ends = the request's length after this batch). Extend must
    write the ring *after* attention (cells of the prefix window would be clobbered).
    slots/positions/rows/seq_ends: [T] integer tensors (rows = request row per token).
    Returns the rotated (unclipped; keys shifted) k', v' as float32 [T, H, D]."""
    gk, gv = layer.key_group_size, layer.value_group_size
    sdt = layer.k_scales.dtype
    r = rotation
    k_rot, k_packed, k_scales = quantise_rotated(k, r.k_rot, r.k_clip_min, r.k_clip_max, gk, sdt, r.k_shift)
    v_rot, v_packed, v_scales = quantise_rotated(v, r.v_rot, r.v_clip_min, r.v_clip_max, gv, sdt)
    slots, positions, rows = slots.long(), positions.long(), rows.long()
    s, w = layer.sink_tokens, layer.recent_window
    if write_sink is None:
        write_sink = write_int2
    if write_int2:
        layer.k_packed[slots] = k_packed
        layer.v_packed[slots] = v_packed
        layer.k_scales[slots] = k_scales
        layer.v_scales[slots] = v_scales
    if write_sink:
        if s > 0:
            c = sink_slot_for(index, req_to_token[rows, 0])
            m = (positions < s) & (c >= 0)
            layer.k_sink[c[m], positions[m]] = k_rot[m].to(layer.k_sink.dtype)
            layer.v_sink[c[m], positions[m]] = v_rot[m].to(layer.v_sink.dtype)
    if write_ring and w > 0:
        m = positions >= seq_ends.long() - w
        layer.k_ring[rows[m], positions[m] % w] = k_rot[m].to(layer.k_ring.dtype)
        layer.v_ring[rows[m], positions[m] % w] = v_rot[m].to(layer.v_ring.dtype)
    return k_rot, v_rot


def key_noise_bias(q: torch.Tensor, k_var: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Logit debias (module doc): q' [Tq, Hq, D], k_var [Tk, H, NG] (scale^2 of each key group,
    0 where the key is exact) -> [Hq, Tq, Tk] float32, to subtract from the logits."""
    hq, d = q.shape[1], q.shape[2]
    ng = k_var.shape[-1]
    qn = q.float().view(q.shape[0], hq, ng, d // ng).pow(2).sum(-1)  # [Tq, Hq, NG]
    kv = expand_gqa(k_var.transpose(0, 1).float(), hq)  # [Hq, Tk, NG]
    return torch.einsum("qhg,hkg->hqk", qn, kv) * (sm_scale * sm_scale / 24.0)


def key_scales_squared(layer: HybridLayerCache, slots: torch.Tensor) -> torch.Tensor:
    """The keys' group scales squared at ``slots`` [n] -> [n, H, NG] float32 (key_noise_bias)."""
    return layer.k_scales[slots.long()][..., 0].float().pow(2)


def hybrid_kv(layer: HybridLayerCache, index: HybridCacheIndex, req_to_token: torch.Tensor,
              row: int, n: int, window_end: int | None = None, with_var: bool = False):
    """Keys and values (float32 [n, H, D], rotated space) of positions 0..n-1 of the
    request in ``row`` as the kernels must read them (read rule in hybrid_cache).
    ``window_end`` (default n): the sequence length whose recent window the ring serves,
    ring read for positions >= max(window_end - W, valid_from) (a speculative draft at
    depth d reads its prefix of n positions as decode at length n + d + 1 would).
    ``with_var``: also the keys' group scales squared [n, H, NG] float32, 0 at the BF16
    positions (key_noise_bias)."""
    slots = req_to_token[row, :n].long()
    k = dequantise(unpack(layer.k_packed[slots]), layer.k_scales[slots])
    v = dequantise(unpack(layer.v_packed[slots]), layer.v_scales[slots])
    var = key_scales_squared(layer, slots) if with_var else None
    if n == 0:
        return (k, v, var) if with_var else (k, v)
    pos = torch.arange(n, device=slots.device)
    s, w = layer.sink_tokens, layer.recent_window
    if w > 0:
        start = max((n if window_end is None else window_end) - w, int(index.ring_valid_from[row]))
        m = pos >= start
        k[m] = layer.k_ring[row, pos[m] % w].float()
        v[m] = layer.v_ring[row, pos[m] % w].float()
        if with_var:
            var[m] = 0.0
    if s > 0:
        c = int(sink_slot_for(index, slots[:1])[0])
        if c >= 0:
            m = pos < s
            k[m] = layer.k_sink[c, pos[m]].float()
            v[m] = layer.v_sink[c, pos[m]].float()
            if with_var:
                var[m] = 0.0
    return (k, v, var) if with_var else (k, v)


def reference_materialize_prefix(layer: HybridLayerCache, index: HybridCacheIndex, req_to_token: torch.Tensor,
                                 rows: torch.Tensor, prefix_lens: torch.Tensor):
    """(k, v) bf16 [sum L_b, H, D]: the hybrid prefixes of the requests as the read rule
    gives them (hybrid_kv), request after request (twin of triton_materialize)."""
    h, d = layer.num_kv_heads, layer.head_dim
    parts = [hybrid_kv(layer, index, req_to_token, int(r), int(n)) for r, n in zip(rows, prefix_lens)]
    parts = parts or [(torch.empty(0, h, d, device=layer.k_packed.device),) * 2]
    return torch.cat([k for k, _ in parts]).bfloat16(), torch.cat([v for _, v in parts]).bfloat16()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
            mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
            k_var: torch.Tensor | None = None) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, H, D] -> [Tq, Hq, D] softmax attention, GQA, float32.
    ``sinks`` [Hq]: a learned logit per query head (gpt-oss) that joins every row's softmax
    as one more column with no value: o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}).
    ``k_var`` [Tk, H, NG]: the keys' debias (key_noise_bias), None: none."""
    hq = q.shape[1]
    logits = torch.einsum("qhd,hkd->hqk", q.float(), expand_gqa(k.transpose(0, 1), hq).float()) * sm_scale
    if k_var is not None:
        logits = logits - key_noise_bias(q, k_var, sm_scale)
    v = expand_gqa(v.transpose(0, 1), hq)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hq, 1, 1).expand(hq, logits.shape[1], 1)
        p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(logits, dim=-1)
    return torch.einsum("hqk,hkd->qhd", p, v.float())


def reference_decode(q_rot: torch.Tensor, layer: HybridLayerCache, index: HybridCacheIndex,
                     req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, sinks: torch.Tensor | None = None, key_debias: bool = False) -> torch.Tensor:
    """One query token per request (q' [B, Hq, D]) over its n = seq_lens[b] cached
    positions (the new token already stored); ``sinks`` [Hq] as in :func:`_attend`;
    ``key_debias``: the module doc's logit debias at the INT2 positions.
    Returns o' [B, Hq, D] float32."""
    out = torch.empty(q_rot.shape, dtype=torch.float32, device=q_rot.device)
    for b in range(q_rot.shape[0]):
        k, v, var = hybrid_kv(layer, index, req_to_token, int(rows[b]), int(seq_lens[b]), with_var=True)
        out[b] = _attend(q_rot[b:b + 1], k, v, sm_scale, sinks=sinks, k_var=var if key_debias else None)[0]
    return out


def reference_extend(q_rot: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor,
                     layer: HybridLayerCache, index: HybridCacheIndex, req_to_token: torch.Tensor,
                     rows: torch.Tensor, prefix_lens: torch.Tensor, qo_indptr: torch.Tensor,
                     sm_scale: float, sinks: torch.Tensor | None = None, key_debias: bool = False) -> torch.Tensor:
    """Prefill / chunked prefill. New tokens (q', k', v' [T, *, D], request b owns rows
    qo_indptr[b]:qo_indptr[b+1]) attend to the hybrid prefix of length prefix_lens[b]
    (read rule with n = prefix length) and causally to the new BF16 tokens themselves;
    ``sinks`` [Hq] as in :func:`_attend`; ``key_debias`` as in :func:`reference_decode`.
    Returns o' [T, Hq, D] float32."""
    out = torch.empty(q_rot.shape, dtype=torch.float32, device=q_rot.device)
    for b in range(rows.shape[0]):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if hi == lo:
            continue
        n_pre = int(prefix_lens[b])
        kp, vp, var = hybrid_kv(layer, index, req_to_token, int(rows[b]), n_pre, with_var=True)
        k = torch.cat([kp, k_rot[lo:hi].float()])
        v = torch.cat([vp, v_rot[lo:hi].float()])
        e = hi - lo
        var = torch.cat([var, var.new_zeros(e, *var.shape[1:])]) if key_debias else None
        qi = torch.arange(e, device=q_rot.device).unsqueeze(1)
        kj = torch.arange(n_pre + e, device=q_rot.device).unsqueeze(0)
        mask = kj <= qi + n_pre  # [e, n_pre + e]
        out[lo:hi] = _attend(q_rot[lo:hi], k, v, sm_scale, mask.unsqueeze(0), sinks, var)
    return out


def reference_verify(q_rot: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor,
                     layer: HybridLayerCache, index: HybridCacheIndex, req_to_token: torch.Tensor,
                     rows: torch.Tensor, prefix_lens: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, ancestors: torch.Tensor, sm_scale: float,
                     sinks: torch.Tensor | None = None, key_debias: bool = False) -> torch.Tensor:
    """Speculative verify: B requests of T draft tokens each (token t = b * T + i), already
    INT2-stored at ``slots`` (no sinks, no ring). Draft i of request b (position
    p_i = n + d_i, n = prefix_lens[b], depth d_i) attends to exactly what decode at length
    n_i = n + d_i + 1 would read had its ancestors been accepted:
        prefix positions j < n by the read rule with window end n_i (hybrid_kv(..., window_end=n_i));
        each draft a with ancestors[b, i, a] (itself included), at position p_a:
            BF16 k'_a, v'_a  if p_a >= max(n_i - W, valid_from[row]) (ring, W > 0) or p_a < S
                             with a valid sink slot (decode reads them there),
            else the INT2 it was stored as at slots[b * T + a].
    q' [B*T, Hq, D], k'/v' [B*T, H, D] (the store's rotated BF16 copies), positions, slots
    [B*T], ancestors bool [B, T, T] (speculative.draft_ancestors); ``sinks`` [Hq] as in
    :func:`_attend`; ``key_debias`` as in :func:`reference_decode`. Returns o' [B*T, Hq, D] float32."""
    out = torch.empty(q_rot.shape, dtype=torch.float32, device=q_rot.device)
    b_count, t = ancestors.shape[:2]
    s, w = layer.sink_tokens, layer.recent_window
    if b_count * t == 0:
        return out
    k_int2 = dequantise(unpack(layer.k_packed[slots.long()]), layer.k_scales[slots.long()])
    v_int2 = dequantise(unpack(layer.v_packed[slots.long()]), layer.v_scales[slots.long()])
    for b in range(b_count):
        row, n = int(rows[b]), int(prefix_lens[b])
        c = int(sink_slot_for(index, req_to_token[row, :1])[0])
        vf = int(index.ring_valid_from[row])
        for i in range(t):
            tok = b * t + i
            n_i = int(positions[tok]) + 1
            kp, vp, var_p = hybrid_kv(layer, index, req_to_token, row, n, window_end=n_i, with_var=True)
            anc = b * t + torch.nonzero(ancestors[b, i]).flatten()
            pa = positions[anc].long()
            bf16 = (pa < s) & (c >= 0)
            if w > 0:
                bf16 |= pa >= max(n_i - w, vf)
            kd = torch.where(bf16[:, None, None], k_rot[anc].float(), k_int2[anc])
            vd = torch.where(bf16[:, None, None], v_rot[anc].float(), v_int2[anc])
            var_d = torch.where(bf16[:, None, None], 0.0, key_scales_squared(layer, slots[anc]))
            out[tok] = _attend(q_rot[tok:tok + 1], torch.cat([kp, kd]), torch.cat([vp, vd]), sm_scale,
                               sinks=sinks, k_var=torch.cat([var_p, var_d]) if key_debias else None)[0]
    return out
