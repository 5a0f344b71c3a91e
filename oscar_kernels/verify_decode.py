"""Speculative verify attention through the decode kernel: one virtual decode request per draft.

reference.reference_verify defines the attention: draft t (request row r, prefix n, depth d,
position p_t = n + d) attends to what decode at length n_t = p_t + 1 would read had its
ancestors been accepted. That IS a decode over a virtual request v = t whose
    req_to_token_v[v, j] = req_to_token[r, j] for j < n, and the slot of t's ancestor at depth
                           j - n for n <= j <= p_t (the INT2 the verify stored there);
    ring_v[v, j % W]     = the drafts' BF16 k', v' for ancestors at positions j in
                           [n_t - W, n_t) with j >= n, else ring[r, j % W] (the prefix's cells;
                           distinct positions of one window never share a cell);
    sink_v[v, j]         = the ancestor's k', v' for n <= j < S, else sink[c_r, j];
    ring_valid_from_v[v] = ring_valid_from[r],
so triton_decode (read rule S_b / INT2 / ring with n = n_t) runs it unchanged. The virtual
sinks live on virtual pages P + v (P = the real page count): req_to_token_v[v, 0] is
(P + v) * page_size when the request's first page owns a sink slot (else its real slot, read
as INT2), sink_slot_of_page_v[P + v] = v and page_of_sink_slot_v[v] = P + v.

Cost: the plan copies the requests' req_to_token rows once per verify batch (B*T x context
int32); each layer gathers B*T x (W + S) BF16 side rows (the decode then reads them once, as
it reads a ring). Device ops only, but the plan allocates (sized by the batch): not yet
recordable in a CUDA graph (a workspace sized by max tokens x context would make it so).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .hybrid_cache import HybridCacheIndex, HybridLayerCache, sink_slot_for


@dataclass(frozen=True)
class VerifyView:
    """A verify batch as B*T virtual decode requests (plan_verify_view); tensors on the cache's device."""

    rows: torch.Tensor  # int32 [BT]: virtual rows 0..BT-1
    seq_lens: torch.Tensor  # int32 [BT]: p_t + 1
    req_to_token: torch.Tensor  # int32 [BT, context]
    index: HybridCacheIndex  # virtual sink pages and ring validity
    token_rows: torch.Tensor  # int64 [BT]: real row of each draft
    sink_of_token: torch.Tensor  # int64 [BT]: real sink slot (clamped to >= 0)
    ring_src: torch.Tensor  # int64 [BT, W]: draft token whose k', v' fills the cell, -1: the real ring's
    sink_src: torch.Tensor  # int64 [BT, S]: draft token whose k', v' fills the sink position, -1: the real sink's


def ancestor_at_depth(ancestors: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """int64 [B*T, T]: for draft t = b * T + i and depth j, the token (b * T + a) of i's ancestor
    (or i itself) at depth j, -1 past i's depth. ancestors bool [B, T, T], depths int [B, T]."""
    b, t = depths.shape
    m = ancestors[:, :, None, :] & (depths[:, None, None, :] == torch.arange(t, device=depths.device)[None, None, :, None])
    a = m.to(torch.int8).argmax(-1)  # [B, T, T(depth)]
    glob = a + (torch.arange(b, device=depths.device) * t)[:, None, None]
    return torch.where(m.any(-1), glob, -1).reshape(b * t, t)


def plan_verify_view(index: HybridCacheIndex, req_to_token: torch.Tensor, rows: torch.Tensor,
                     prefix_lens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     ancestors: torch.Tensor, sink_tokens: int, recent_window: int) -> VerifyView:
    """The virtual decode batch of a verify (module doc). rows, prefix_lens [B]; positions,
    slots [B*T]; ancestors bool [B, T, T]."""
    b, t = ancestors.shape[:2]
    bt = b * t
    dev = positions.device
    token_rows = rows.long().repeat_interleave(t, output_size=bt)
    n = prefix_lens.long().repeat_interleave(t, output_size=bt)
    pos = positions.long()
    depths = (pos - n).view(b, t)
    at = ancestor_at_depth(ancestors, depths)  # [BT, T]
    r2t = req_to_token[token_rows].clone()
    j = torch.arange(t, device=dev)
    cols = n[:, None] + j[None, :]  # [BT, T] positions n..n+T-1 (inside the row: the verify's slots)
    r2t.scatter_(1, cols, torch.where(at >= 0, slots.to(r2t.dtype)[at.clamp(min=0)], r2t.gather(1, cols)))
    c = sink_slot_for(index, req_to_token[token_rows, 0])
    num_pages = index.sink_slot_of_page.shape[0]
    vt = torch.arange(bt, device=dev)
    vpage = num_pages + vt
    r2t[:, 0] = torch.where(c >= 0, vpage * index.page_size, r2t[:, 0].long()).to(r2t.dtype)
    sink_slot_of_page = torch.full((num_pages + bt,), -1, dtype=index.sink_slot_of_page.dtype, device=dev)
    sink_slot_of_page[num_pages:] = torch.where(c >= 0, vt, -1).to(sink_slot_of_page.dtype)
    virtual = HybridCacheIndex(
        page_size=index.page_size, sink_slot_of_page=sink_slot_of_page,
        page_of_sink_slot=vpage.to(index.page_of_sink_slot.dtype),
        ring_valid_from=index.ring_valid_from[token_rows], ring_owner=index.ring_owner[token_rows],
        ring_end=index.ring_end[token_rows], sink_generation=torch.zeros(bt, dtype=torch.int64, device=dev))

    def draft_at(p):  # [BT, K] positions -> the ancestor token holding it, -1 if a prefix position
        d = p - n[:, None]
        ok = (d >= 0) & (d < t)
        return torch.where(ok, at.gather(1, d.clamp(0, t - 1)), -1)

    w, s = recent_window, sink_tokens
    n_t = pos + 1
    if w > 0:  # the position each cell holds in the window [n_t - W, n_t)
        cell = torch.arange(w, device=dev)
        start = n_t - w
        ring_src = draft_at(start[:, None] + (cell[None, :] - start[:, None]) % w)
    else:
        ring_src = torch.empty(bt, 0, dtype=torch.int64, device=dev)
    sink_src = draft_at(torch.arange(s, device=dev).expand(bt, s)) if s > 0 else ring_src[:, :0]
    return VerifyView(rows=vt.to(torch.int32), seq_lens=n_t.to(torch.int32), req_to_token=r2t, index=virtual,
                      token_rows=token_rows, sink_of_token=c.clamp(min=0), ring_src=ring_src, sink_src=sink_src)


def verify_layer_view(view: VerifyView, layer: HybridLayerCache, k_rot: torch.Tensor,
                      v_rot: torch.Tensor) -> HybridLayerCache:
    """The layer as the virtual requests read it: its INT2 buffers, and virtual sinks
    [BT, S, H, D] and rings [BT, W, H, D] composed from the real ones and the drafts' BF16
    k'/v' [BT, H, D] (module doc)."""
    def compose(real_rows, src, drafts):
        return torch.where((src >= 0)[..., None, None], drafts[src.clamp(min=0)], real_rows)

    rs, ss = view.ring_src, view.sink_src
    if layer.k_sink.shape[0] == 0:  # no sink slots at all: every sink read is INT2 (c = -1)
        return replace(layer, k_ring=compose(layer.k_ring[view.token_rows], rs, k_rot),
                       v_ring=compose(layer.v_ring[view.token_rows], rs, v_rot))
    return replace(
        layer,
        k_ring=compose(layer.k_ring[view.token_rows], rs, k_rot), v_ring=compose(layer.v_ring[view.token_rows], rs, v_rot),
        k_sink=compose(layer.k_sink[view.sink_of_token], ss, k_rot),
        v_sink=compose(layer.v_sink[view.sink_of_token], ss, v_rot))
