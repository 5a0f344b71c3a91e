"""Builders of hybrid-cache scenarios for the kernel benchmarks and tests (CPU and GPU); the
checks the tests make on them are in tests/kernel_helpers.py.

A scenario holds B requests with given cached lengths; each request's positions map to
slots on randomly permuted pages (page 0 is never used, as in SGLang). Content is written
with the *reference* store, so every kernel under test reads a cache the oracle produced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_kernels import reference as ref
from oscar_kernels.hybrid_cache import (HybridCacheIndex, HybridLayerCache, LayerRotation, allocate_index,
                                        allocate_layer, assign_sink_slots, head_major)


@dataclass
class Scenario:
    layer: HybridLayerCache
    index: HybridCacheIndex
    rotation: LayerRotation
    req_to_token: torch.Tensor  # int32 [R, max_ctx]
    rows: torch.Tensor  # int32 [B]
    lens: list[int]
    sm_scale: float

    @property
    def device(self):
        return self.req_to_token.device


def random_rotation(h: int, d: int, generator: torch.Generator) -> LayerRotation:
    """Per-head random orthogonal K/V rotations and key shifts; half the channels get finite clips."""
    def orth():
        return torch.linalg.qr(torch.randn(h, d, d, generator=generator, dtype=torch.float64))[0].float()

    def clips():
        lo = torch.full((h, d), -float("inf"))
        hi = torch.full((h, d), float("inf"))
        lo[:, ::2] = -1.5 - torch.rand(h, d // 2, generator=generator)
        hi[:, ::2] = 1.5 + torch.rand(h, d // 2, generator=generator)
        return lo, hi

    klo, khi = clips()
    vlo, vhi = clips()
    return LayerRotation(orth(), orth(), klo, khi, vlo, vhi, k_shift=0.5 * torch.randn(h, d, generator=generator))


def build(lens, *, H=2, D=64, G=16, S=4, W=8, page=8, sink_slots=4, seed=0,
          device="cpu", valid_from=None, evict_sink_of=(), no_sink=(), fill=True,
          scale_dtype=torch.float16, GV=None) -> Scenario:
    """lens: cached length per request. G: the keys' group size, GV the values' (default G). valid_from: per-request ring_valid_from (default 0).
    evict_sink_of: requests whose sink slot is re-assigned to another page (read as INT2).
    no_sink: requests that never get a sink slot. fill: write random K/V for every cached
    position through the reference store (seq_end = len)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    max_ctx = max(max(lens, default=1), 1) + 2 * page
    pages_per_req = [-(-max(n, 1) // page) + 1 for n in lens]  # +1: room for extend
    num_pages = sum(pages_per_req) + 2
    num_slots = num_pages * page
    num_rows = b + 2
    layer = allocate_layer(num_slots, H, D, G, S, W, sink_slots, num_rows, scale_dtype, value_group_size=GV)
    index = allocate_index(num_slots, page, sink_slots, num_rows)
    rotation = random_rotation(H, D, g)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 unused
    rows = (torch.randperm(num_rows - 1, generator=g)[:b] + 1).to(torch.int32)  # row 0 unused
    req_to_token = torch.zeros(num_rows, max_ctx, dtype=torch.int32)
    cursor = 0
    for i, npg in enumerate(pages_per_req):
        pg = torch.tensor(perm[cursor:cursor + npg])
        cursor += npg
        slots = (pg[:, None] * page + torch.arange(page)[None, :]).flatten()
        req_to_token[int(rows[i]), :slots.numel()] = slots.to(torch.int32)
    with_sink = [i for i in range(b) if i not in no_sink]
    if with_sink and S > 0:
        assign_sink_slots(index, req_to_token[rows[with_sink].long(), 0], sink_slots)
    if valid_from is not None:
        index.ring_valid_from[rows.long()] = torch.tensor(valid_from, dtype=torch.int32)
    sc = Scenario(layer, index, rotation, req_to_token, rows, list(lens), D ** -0.5)
    if fill:
        for i, n in enumerate(lens):
            if n:
                k = torch.randn(n, H, D, generator=g).bfloat16()
                v = torch.randn(n, H, D, generator=g).bfloat16()
                r = int(rows[i])
                pos = torch.arange(n)
                ref.reference_store(layer, index, rotation, req_to_token, k, v,
                                    req_to_token[r, :n], pos, torch.full((n,), r), torch.full((n,), n))
    for i in evict_sink_of:  # hand the request's sink slot to page 0 (never read)
        first = req_to_token[int(rows[i]), 0].long()
        c = int(index.sink_slot_of_page[first // page])
        if c >= 0:
            index.page_of_sink_slot[c] = 0
    return to_device(sc, device)


def joined_scales(k_scales: torch.Tensor, v_scales: torch.Tensor, storage_head_major: bool = True):
    """K and V scales as views of one [slots, H, D/G_K + D/G_V, 2] tensor (allocate_layer's
    layout: the kernels read both with one set of strides), stored head-major as
    allocate_layer does, or slot-major."""
    if storage_head_major:
        both = head_major(torch.cat([head_major(k_scales), head_major(v_scales)], dim=2))
    else:
        both = torch.cat([k_scales, v_scales], dim=2)
    return both[:, :, :k_scales.shape[2]], both[:, :, k_scales.shape[2]:]


def layer_to(layer: HybridLayerCache, device) -> HybridLayerCache:
    """The layer on ``device``, K/V scales still views of one tensor (a plain .to copies each
    view on its own, and the kernels refuse K/V scales with different strides)."""
    out = HybridLayerCache(*(getattr(layer, f).to(device) for f in layer.__dataclass_fields__))
    out.k_scales, out.v_scales = joined_scales(out.k_scales, out.v_scales)
    return out


def to_device(sc: Scenario, device) -> Scenario:
    lay = layer_to(sc.layer, device)
    idx = index_to(sc.index, device)
    return Scenario(lay, idx, sc.rotation.to(device), sc.req_to_token.to(device), sc.rows.to(device),
                    sc.lens, sc.sm_scale)


def build_random(lens, *, H=8, D=128, G=128, S=16, W=128, page=64, device="cuda", seed=0,
                 scale_dtype=torch.float16, GV=None) -> Scenario:
    """Large scenario filled with random INT2 codes/scales and BF16 sinks/rings directly on
    ``device`` (no store pass: for long-context GPU tests and benchmarks). Every request
    owns whole pages (permuted) and a sink slot."""
    g = torch.Generator(device=device).manual_seed(seed)
    b = len(lens)
    pages_per_req = [-(-max(n, 1) // page) for n in lens]
    num_pages = sum(pages_per_req) + 1
    num_slots = num_pages * page
    sink_slots = max(b, 1)
    layer = allocate_layer(num_slots, H, D, G, S, W, sink_slots, b + 1, scale_dtype, device=device,
                           value_group_size=GV)
    index = allocate_index(num_slots, page, sink_slots, b + 1, device=device)
    fill_random(layer, g)
    perm = torch.randperm(num_pages - 1, generator=g, device=device) + 1
    max_ctx = max(max(lens), 1)
    req_to_token = torch.zeros(b + 1, max_ctx, dtype=torch.int32, device=device)
    cursor = 0
    ar = torch.arange(page, device=device)
    for i, (n, npg) in enumerate(zip(lens, pages_per_req)):
        slots = (perm[cursor:cursor + npg, None] * page + ar[None, :]).flatten()[:max_ctx]
        req_to_token[i + 1, :slots.numel()] = slots.to(torch.int32)
        cursor += npg
    rows = torch.arange(1, b + 1, dtype=torch.int32, device=device)
    if S > 0:
        assign_sink_slots(index, req_to_token[rows.long(), 0], sink_slots)
    rotation = random_rotation(H, D, torch.Generator().manual_seed(seed)).to(device)
    return Scenario(layer, index, rotation, req_to_token, rows, list(lens), D ** -0.5)


def fill_random(layer: HybridLayerCache, g: torch.Generator) -> None:
    """Random INT2 codes, (scale, min) pairs and BF16 sinks/rings, in place on the layer's device."""
    device = layer.k_packed.device
    for t in (layer.k_packed, layer.v_packed):
        t.copy_(torch.randint(0, 256, t.shape, generator=g, device=device, dtype=torch.uint8))
    for sc in (layer.k_scales, layer.v_scales):
        sc[..., 0] = (0.2 + 0.4 * torch.rand(sc.shape[:-1], generator=g, device=device)).to(sc.dtype)
        sc[..., 1] = (-0.3 - 0.2 * torch.rand(sc.shape[:-1], generator=g, device=device)).to(sc.dtype)
    for t in (layer.k_sink, layer.v_sink, layer.k_ring, layer.v_ring):
        t.copy_(torch.randn(t.shape, generator=g, device=device).to(t.dtype))


def another_layer(sc: Scenario, seed: int) -> Scenario:
    """The same requests in another layer of the model: its own random cache and rotation,
    the request table and sink index shared (one per server, read by every layer)."""
    lay = sc.layer
    layer = allocate_layer(lay.k_packed.shape[0], lay.num_kv_heads, lay.head_dim, lay.key_group_size,
                           lay.sink_tokens, lay.recent_window, lay.k_sink.shape[0], lay.k_ring.shape[0],
                           lay.k_scales.dtype, device=sc.device, value_group_size=lay.value_group_size)
    fill_random(layer, torch.Generator(device=sc.device).manual_seed(seed))
    rotation = random_rotation(lay.num_kv_heads, lay.head_dim, torch.Generator().manual_seed(seed)).to(sc.device)
    return Scenario(layer, sc.index, rotation, sc.req_to_token, sc.rows, sc.lens, sc.sm_scale)


def random_q(sc: Scenario, hq: int, seed=3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(len(sc.lens), hq, sc.layer.head_dim, generator=g) * 2).bfloat16().to(sc.device)


def index_to(index: HybridCacheIndex, device) -> HybridCacheIndex:
    """A copy of the index on ``device`` (tensors copied even on the same device)."""
    return HybridCacheIndex(**{f: (v.to(device, copy=True) if isinstance(v, torch.Tensor) else v)
                               for f, v in vars(index).items()})
