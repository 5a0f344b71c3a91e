"""Storage of the hybrid BF16/INT2 KV cache (plain tensors, no sglang).

Every token slot holds the token's INT2 K and V (rotated, clipped, packed; see
:mod:`oscar_kernels.int2`). BF16 copies (rotated, *not* clipped) exist only in two side
caches:

- **sinks**, positions ``p < S`` of a sequence. They live on the sequence's first page
  (``slot % page_size == p`` and ``S <= page_size``), so they are keyed by that page:
  ``sink_slot_of_page[page] = c`` and ``page_of_sink_slot[c] = page``; slot ``c`` of
  ``k_sink/v_sink [C, S, H, D]`` is valid for ``page`` only while both agree. Slots are
  handed out round-robin when a sequence starts at position 0 (:func:`assign_sink_slots`),
  skipping those a live sequence reads when the caller says which (:func:`sink_slots_in_use`),
  so only sinks of finished or radix-cached sequences are evicted (and fall back to INT2),
  and a page shared by a prefix hit keeps the sinks of whoever computed it (a shared first
  page means identical tokens < S). ``sink_generation[c]`` counts the times slot ``c`` was
  handed out: a copy of a first page that noted (c, generation) finds its sinks still in
  slot ``c`` while the count is unchanged (the HiCache host tier, sglang_ext.host_pool).
- **recent ring**, per request row: ``k_ring/v_ring [R, W, H, D]``, cell ``p % W``, valid
  for positions ``p >= ring_valid_from[row]`` (where the request began computing); a
  continuation keeps it, a new or re-admitted request restarts it (:func:`update_ring_validity`).

Read rule for position j of a sequence of cached length n (row r, first page f):
    j < S and sink valid for f      -> sink[c, j]
    j >= max(n - W, valid_from[r])  -> ring[r, j % W]
    otherwise                       -> INT2 at the slot of j
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .contract.layout import check_group_sizes, packed_dim
from .int2 import DEFAULT_TORCH_SCALE_DTYPE


@dataclass
class LayerRotation:
    """One layer's OSCAR transform, per KV head: k' = clamp(k @ R_K - k_shift, clip_min, clip_max),
    v' = clamp(v @ R_V, clip_min, clip_max). ``k_shift`` (the keys' calibrated mean in the rotated
    space) is subtracted from every stored key, BF16 copies included: each query's logits all move
    by -q'.k_shift, which softmax ignores, while the INT2 groups lose the offset that set their range."""

    FIELDS = ("k_rot", "v_rot", "k_clip_min", "k_clip_max", "v_clip_min", "v_clip_max", "k_shift")
    k_rot: torch.Tensor  # [H, D, D]
    v_rot: torch.Tensor  # [H, D, D]
    k_clip_min: torch.Tensor  # [H, D]  (-inf = no clip)
    k_clip_max: torch.Tensor  # [H, D]  (+inf = no clip)
    v_clip_min: torch.Tensor
    v_clip_max: torch.Tensor
    k_shift: torch.Tensor | None = None  # [H, D]; None: zeros (no shift)

    def __post_init__(self):
        if self.k_shift is None:
            self.k_shift = torch.zeros(self.k_clip_min.shape, dtype=torch.float32, device=self.k_clip_min.device)

    def to(self, device) -> "LayerRotation":
        """float32 copies on ``device``."""
        return LayerRotation(*(getattr(self, f).to(device, torch.float32).contiguous() for f in self.FIELDS))


@dataclass
class HybridLayerCache:
    """One layer's buffers, all in the rotated space."""

    # INT2 buffers: any strides with a unit last one (allocate_layer's: head-major storage)
    k_packed: torch.Tensor  # uint8 [num_slots, H, D/4]
    v_packed: torch.Tensor  # uint8 [num_slots, H, D/4]
    k_scales: torch.Tensor  # scale dtype [num_slots, H, D/G_K, 2]  (scale, min)
    v_scales: torch.Tensor  # scale dtype [num_slots, H, D/G_V, 2]; same strides as k_scales
    k_sink: torch.Tensor  # bf16 [num_sink_slots, S, H, D]
    v_sink: torch.Tensor
    k_ring: torch.Tensor  # bf16 [num_rows, W, H, D]
    v_ring: torch.Tensor

    @property
    def head_dim(self) -> int:
        return self.k_ring.shape[-1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_packed.shape[1]

    @property
    def key_group_size(self) -> int:
        return self.head_dim // self.k_scales.shape[2]

    @property
    def value_group_size(self) -> int:
        return self.head_dim // self.v_scales.shape[2]

    @property
    def sink_tokens(self) -> int:
        return self.k_sink.shape[1]

    @property
    def recent_window(self) -> int:
        return self.k_ring.shape[1]


@dataclass
class HybridCacheIndex:
    """Bookkeeping shared by all layers (int32 tensors on the cache's device)."""

    page_size: int
    sink_slot_of_page: torch.Tensor  # int32 [num_pages], -1 = none
    page_of_sink_slot: torch.Tensor  # int32 [num_sink_slots], -1 = free
    ring_valid_from: torch.Tensor  # int32 [num_rows]
    ring_owner: torch.Tensor  # int64 [num_rows], caller's id of the request that wrote the ring
    ring_end: torch.Tensor  # int64 [num_rows], sequence length the row's last batch reached
    sink_generation: torch.Tensor  # int64 [num_sink_slots], times each sink slot was handed out
    sink_cursor: int = 0  # next sink slot handed out (host-side counter, no sync)


def allocate_layer(num_slots: int, num_kv_heads: int, head_dim: int, group_size: int,
                   sink_tokens: int, recent_window: int, num_sink_slots: int, num_rows: int,
                   scale_dtype: torch.dtype = DEFAULT_TORCH_SCALE_DTYPE, device="cpu", *,
                   value_group_size: int | None = None) -> HybridLayerCache:
    """Zeroed buffers of one layer. ``group_size`` is the keys' INT2 group size and, unless
    ``value_group_size`` says otherwise, the values'. k_scales and v_scales are views of one
    [num_slots, H, D/G_K + D/G_V, 2] tensor: one set of strides, and a token's K and V scales
    share a cache line.

    The INT2 buffers are stored head-major ([H, num_slots, ...] in memory, [num_slots, H, ...]
    views): a decode program (one KV head) then reads a page as whole cache lines, not pieces
    shared with the other heads' programs."""
    group_size, gv = check_group_sizes(head_dim, group_size, value_group_size)
    h, d, q = num_kv_heads, head_dim, packed_dim(head_dim)
    ngk = d // group_size

    def z(*shape, dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    numel = num_slots * h * (ngk + d // gv) * 2
    # storage rounded up to whole 4-byte words: float8 pairs are then read as words
    # (triton_common.float8_words_view) whatever the slot and head counts
    words = -(-numel * torch.empty(0, dtype=scale_dtype).element_size() // 4)
    scales = head_major(z(words * 4, dtype=torch.uint8).view(scale_dtype)[:numel].view(h, num_slots, ngk + d // gv, 2))
    return HybridLayerCache(
        k_packed=head_major(z(h, num_slots, q, dtype=torch.uint8)),
        v_packed=head_major(z(h, num_slots, q, dtype=torch.uint8)),
        k_scales=scales[:, :, :ngk],
        v_scales=scales[:, :, ngk:],
        k_sink=z(num_sink_slots, sink_tokens, h, d, dtype=torch.bfloat16),
        v_sink=z(num_sink_slots, sink_tokens, h, d, dtype=torch.bfloat16),
        k_ring=z(num_rows, recent_window, h, d, dtype=torch.bfloat16),
        v_ring=z(num_rows, recent_window, h, d, dtype=torch.bfloat16),
    )


def head_major(t: torch.Tensor) -> torch.Tensor:
    """[H, slots, ...] storage as a [slots, H, ...] view."""
    return t.transpose(0, 1)


def allocate_index(num_slots: int, page_size: int, num_sink_slots: int, num_rows: int,
                   device="cpu") -> HybridCacheIndex:
    num_pages = -(-num_slots // page_size)
    return HybridCacheIndex(
        page_size=page_size,
        sink_slot_of_page=torch.full((num_pages,), -1, dtype=torch.int32, device=device),
        page_of_sink_slot=torch.full((max(num_sink_slots, 1),), -1, dtype=torch.int32, device=device),
        ring_valid_from=torch.zeros(num_rows, dtype=torch.int32, device=device),
        ring_owner=torch.zeros(num_rows, dtype=torch.int64, device=device),
        ring_end=torch.zeros(num_rows, dtype=torch.int64, device=device),
        sink_generation=torch.zeros(max(num_sink_slots, 1), dtype=torch.int64, device=device),
    )


@dataclass
class HybridCache:
    """All layers of one hybrid cache: what :class:`oscar_kernels.hybrid_attention.HybridAttention`
    attends over (layer i = layers[i] with rotations[i])."""

    layers: list[HybridLayerCache]
    rotations: list[LayerRotation]  # float32, on the cache's device
    index: HybridCacheIndex
    req_to_token: torch.Tensor  # int32 [num_rows, max_context]: slot of position j of row r


def update_ring_validity(index: HybridCacheIndex, rows: torch.Tensor, prefix_lens: torch.Tensor,
                         seq_ends: torch.Tensor, owners: torch.Tensor) -> None:
    """Ring bookkeeping of one extend batch (device ops, no sync): a row whose ring another
    request wrote (``ring_owner`` != ``owners``) or that does not end where this batch starts
    (``ring_end`` != ``prefix_lens``: re-admission, a radix hit in a reused row) restarts its
    ring at its prefix (the prefix is then read as INT2 and sinks); a chunked-prefill
    continuation keeps it. rows, prefix_lens, seq_ends, owners: int [B]."""
    vf = index.ring_valid_from
    reset = (index.ring_owner[rows] != owners) | (index.ring_end[rows] != prefix_lens)
    vf[rows] = torch.where(reset, prefix_lens.to(vf.dtype), vf[rows])
    index.ring_owner[rows] = owners.to(index.ring_owner.dtype)
    index.ring_end[rows] = seq_ends.to(index.ring_end.dtype)


def assign_sink_slots(index: HybridCacheIndex, first_slots: torch.Tensor, num_sink_slots: int,
                      in_use: torch.Tensor | None = None) -> None:
    """Give each sequence that starts at position 0 a sink slot: the next ones round-robin
    from the host cursor, skipping the slots marked in ``in_use`` (int [C], nonzero: read by a
    live sequence, see :func:`sink_slots_in_use`) while enough others are left. first_slots:
    slot of position 0 of each such sequence. Device ops and a host counter: no host sync."""
    k = first_slots.numel()
    if k == 0 or num_sink_slots == 0:
        return
    if k > num_sink_slots:  # more new sequences than slots: only the last ones keep sinks
        first_slots = first_slots[-num_sink_slots:]
        k = num_sink_slots
    pages = (first_slots.long() // index.page_size)
    if in_use is None:
        slots = (index.sink_cursor + torch.arange(k, device=pages.device)) % num_sink_slots
    else:  # the k free slots nearest after the cursor (slots in use rank after every free one)
        ahead = (torch.arange(num_sink_slots, device=pages.device) - index.sink_cursor) % num_sink_slots
        slots = torch.topk(ahead + num_sink_slots * (in_use[:num_sink_slots] != 0).long(), k,
                           largest=False).indices
    index.sink_slot_of_page[pages] = slots.to(torch.int32)
    index.page_of_sink_slot[slots] = pages.to(torch.int32)
    # after the mapping: a reader that sees the new count also sees the new owner
    index.sink_generation[slots] += 1
    index.sink_cursor = (index.sink_cursor + k) % num_sink_slots


def sink_slots_in_use(index: HybridCacheIndex, req_to_token: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """int32 [C]: 1 at the sink slots that the sequences in ``rows`` (req_to_token rows of
    live requests) read, i.e. their first page's slot while it is registered to that page."""
    used = torch.zeros(index.page_of_sink_slot.shape[0], dtype=torch.int32, device=index.page_of_sink_slot.device)
    if rows.numel() == 0:
        return used
    c = sink_slot_for(index, req_to_token[rows.long(), 0])
    return used.scatter_reduce_(0, c.clamp(min=0), (c >= 0).to(torch.int32), reduce="amax")


def sink_slot_for(index: HybridCacheIndex, first_slot: torch.Tensor) -> torch.Tensor:
    """Sink slot valid for sequences whose position 0 is at ``first_slot`` (-1 if none)."""
    page = first_slot.long() // index.page_size
    c = index.sink_slot_of_page[page].long()
    owner = index.page_of_sink_slot[c.clamp(min=0)]
    return torch.where((c >= 0) & (owner.long() == page), c, torch.full_like(c, -1))


def move_int2_cells(layers: list[HybridLayerCache], tgt_slots: torch.Tensor, src_slots: torch.Tensor) -> None:
    """Pool-level move (SGLang's move_kv_cache after a tree verify, topk > 1): every layer's
    INT2 cell (codes and scales of K and V) at src_slots[i] is copied to tgt_slots[i], all
    sources read before any target is written (a source may be another entry's target).
    tgt_slots, src_slots: int [M] on the cache's device; device ops, no sync. Sinks and rings
    are keyed by position, not slot: a move leaves them alone (the verify wrote none; commit
    writes the accepted tokens' from the staged K/V)."""
    tgt, src = tgt_slots.long(), src_slots.long()
    for lc in layers:
        for buf in (lc.k_packed, lc.v_packed, lc.k_scales, lc.v_scales):
            buf[tgt] = buf[src]  # advanced indexing gathers a copy first
