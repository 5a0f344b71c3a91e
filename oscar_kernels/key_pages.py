"""Per-channel key pages in the server, for measurement (issue 29: the quantizer study's
runner-up through the server's kernels).

``per-channel-keys`` (calibration.fidelity.quantizers) keeps one (scale, min) per channel per
page of keys, quantised once the page is complete. Served here on a cache whose keys have
INT2 groups of one channel: the store writes each token as usual, and once a page is complete
this pass rewrites its key codes from the page's BF16 copies (ring, or the batch's rotated
keys) and gives every token of the page the page's per-channel (scale, min). The decode,
extend and materialise kernels then read exactly the per-channel-keys values, at more bytes
than a native layout (which this is not). Per KV head h, channel c, page positions P:
    x_c = clamp(x'[p, h, c], clip_min, clip_max)   (sink positions p < S take x_c at S)
    lo = min_p x_c, scale = (max_p x_c - lo) / 3, both in the scale dtype, nearest code
Tokens that the ring no longer holds as valid BF16 (a re-admitted request) enter with their
stored INT2 value.
"""
from __future__ import annotations

import torch

from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation
from .int2 import clip, pack, quantise, unpack


def check_key_pages(layer: HybridLayerCache, page_size: int) -> None:
    if layer.key_group_size != 1:
        raise ValueError(f"per-channel key pages need keys in INT2 groups of 1 channel, "
                         f"the cache has {layer.key_group_size}")
    if layer.recent_window < page_size:
        raise ValueError(f"per-channel key pages need the recent window ({layer.recent_window}) "
                         f"to hold a page ({page_size} tokens)")


def _stored_keys(layer: HybridLayerCache, slots: torch.Tensor) -> torch.Tensor:
    """float32 [..., H, D]: the INT2 keys at ``slots`` (groups of one channel)."""
    sc = layer.k_scales[slots].float()
    return sc[..., 1] + unpack(layer.k_packed[slots]).float() * sc[..., 0]


def _write_pages(layer: HybridLayerCache, rot: LayerRotation, x: torch.Tensor, pos: torch.Tensor,
                 slots: torch.Tensor, write: torch.Tensor | None) -> None:
    """Quantise pages x [M, P, H, D] (rotated keys at positions pos [M, P]) per channel and
    store them at slots [M, P]; ``write`` [M] bool: pages to store (None: all)."""
    s = layer.sink_tokens
    xc = clip(x.float(), rot.k_clip_min, rot.k_clip_max)
    if s:  # sinks are read as BF16: left out of the page's range
        xc = torch.where((pos < s)[:, :, None, None], xc[:, min(s, x.shape[1] - 1)][:, None], xc)
    codes, scales = quantise(xc.permute(0, 2, 3, 1), x.shape[1], layer.k_scales.dtype)  # [M,H,D,P], [M,H,D,1,2]
    packed = pack(codes.permute(0, 3, 1, 2))  # [M, P, H, D/4]
    scales = scales.squeeze(-2)[:, None].expand(-1, x.shape[1], -1, -1, -1)  # [M, P, H, D, 2]
    if write is not None:
        packed = torch.where(write[:, None, None, None], packed, layer.k_packed[slots])
        scales = torch.where(write[:, None, None, None, None], scales, layer.k_scales[slots])
    layer.k_packed[slots] = packed
    layer.k_scales[slots] = scales


def _page_keys(layer: HybridLayerCache, index: HybridCacheIndex, rows: torch.Tensor, pos: torch.Tensor,
               slots: torch.Tensor, fresh: torch.Tensor | None = None,
               is_fresh: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [M, P, H, D] keys of the page positions pos [M, P] of rows [M]: ``fresh`` where
    ``is_fresh`` [M, P], else the ring cell while valid, else the stored INT2."""
    w = layer.recent_window
    ring = layer.k_ring[rows[:, None], pos % w].float()
    valid = (pos >= index.ring_valid_from[rows].long()[:, None])[:, :, None, None]
    x = torch.where(valid, ring, _stored_keys(layer, slots))
    if fresh is not None:
        x = torch.where(is_fresh[:, :, None, None], fresh, x)
    return x


def quantise_decode_pages(layer: HybridLayerCache, rot: LayerRotation, index: HybridCacheIndex,
                          req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """After a decode step's store: the page that each request's new token completes
    (seq_len % page == 0). Device ops, static shapes: recordable in a CUDA graph."""
    p = index.page_size
    rows, n = rows.long(), seq_lens.long()
    pos = (n[:, None] - p + torch.arange(p, device=n.device)).clamp(min=0)  # [B, P]
    slots = req_to_token[rows[:, None], pos].long()
    x = _page_keys(layer, index, rows, pos, slots)
    _write_pages(layer, rot, x, pos, slots, (n % p == 0) & (n > 0))


def plan_extend_pages(rows: torch.Tensor, prefix_lens: list[int], extend_lens: list[int], page_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The pages an extend batch completes: (row [M], first position [M], index in the
    batch's new tokens of that position, negative when the page began earlier [M]) int64 on
    rows' device, or None. rows [B]; *_lens: host ints [B]."""
    out, start = [], 0
    for b, (pre, ext) in enumerate(zip(prefix_lens, extend_lens)):
        for page in range(pre // page_size, (pre + ext) // page_size):
            out.append((b, page * page_size, start + page * page_size - pre))
        start += ext
    if not out:
        return None
    b, first, new_at = (torch.tensor(c, dtype=torch.int64).to(rows.device) for c in zip(*out))
    return rows.long()[b], first, new_at


def quantise_extend_pages(layer: HybridLayerCache, rot: LayerRotation, index: HybridCacheIndex,
                          req_to_token: torch.Tensor, pages, k_rot: torch.Tensor) -> None:
    """After an extend's INT2 store, before its ring store: the pages of ``pages``
    (plan_extend_pages), from the batch's rotated keys k_rot [T, H, D] and the ring."""
    if pages is None:
        return
    rows, first, new_at = pages
    p = index.page_size
    step = torch.arange(p, device=first.device)
    pos = first[:, None] + step
    slots = req_to_token[rows[:, None], pos].long()
    t = new_at[:, None] + step
    x = _page_keys(layer, index, rows, pos, slots, k_rot[t.clamp(min=0)].float(), t >= 0)
    _write_pages(layer, rot, x, pos, slots, None)
