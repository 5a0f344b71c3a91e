"""Builders of small hybrid-cache scenarios shared by the kernel tests (CPU and GPU).

A scenario holds B requests with given cached lengths; each request's positions map to
slots on randomly permuted pages (page 0 is never used, as in SGLang). Content is written
with the *reference* store, so every kernel under test reads a cache the oracle produced.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from oscar_kernels import reference as ref
from oscar_kernels.hybrid_cache import (HybridCacheIndex, HybridLayerCache, LayerRotation,  # noqa: F401
                                        allocate_index, allocate_layer, assign_sink_slots)
from oscar_kernels.int2 import unpack


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


def random_rotation(h: int, d: int, generator: torch.Generator, clip: bool = True) -> LayerRotation:
    """Per-head random orthogonal K/V rotations; half the channels get finite clips."""
    def orth():
        return torch.linalg.qr(torch.randn(h, d, d, generator=generator, dtype=torch.float64))[0].float()

    def clips():
        lo = torch.full((h, d), -float("inf"))
        hi = torch.full((h, d), float("inf"))
        if clip:
            lo[:, ::2] = -1.5 - torch.rand(h, d // 2, generator=generator)
            hi[:, ::2] = 1.5 + torch.rand(h, d // 2, generator=generator)
        return lo, hi

    klo, khi = clips()
    vlo, vhi = clips()
    return LayerRotation(orth(), orth(), klo, khi, vlo, vhi)


def build(lens, *, H=2, D=64, G=16, S=4, W=8, page=8, sink_slots=4, hq=None, seed=0,
          device="cpu", valid_from=None, evict_sink_of=(), no_sink=(), fill=True,
          scale_dtype=torch.float16, extra_rows=2) -> Scenario:
    """lens: cached length per request. valid_from: per-request ring_valid_from (default 0).
    evict_sink_of: requests whose sink slot is re-assigned to another page (read as INT2).
    no_sink: requests that never get a sink slot. fill: write random K/V for every cached
    position through the reference store (seq_end = len)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    max_ctx = max(max(lens, default=1), 1) + 2 * page
    pages_per_req = [-(-max(n, 1) // page) + 1 for n in lens]  # +1: room for extend
    num_pages = sum(pages_per_req) + 2
    num_slots = num_pages * page
    num_rows = b + extra_rows
    layer = allocate_layer(num_slots, H, D, G, S, W, sink_slots, num_rows, scale_dtype)
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


def to_device(sc: Scenario, device) -> Scenario:
    lay = HybridLayerCache(*(getattr(sc.layer, f).to(device) for f in sc.layer.__dataclass_fields__))
    idx = HybridCacheIndex(sc.index.page_size, sc.index.sink_slot_of_page.to(device),
                           sc.index.page_of_sink_slot.to(device), sc.index.ring_valid_from.to(device),
                           sc.index.sink_cursor)
    return Scenario(lay, idx, sc.rotation.to(device), sc.req_to_token.to(device), sc.rows.to(device),
                    sc.lens, sc.sm_scale)


def clone_layer(layer: HybridLayerCache) -> HybridLayerCache:
    return copy.deepcopy(layer)


def assert_codes_close(packed_a, packed_b, max_fraction=2e-3):
    """INT2 codes equal except rare +-1 level differences (rounding ties)."""
    a = unpack(packed_a).int()
    b = unpack(packed_b).int()
    diff = (a - b).abs()
    if diff.numel():
        assert int(diff.max()) <= 1, "codes differ from the reference by more than one level"
    frac = float((diff > 0).float().mean()) if diff.numel() else 0.0
    assert frac <= max_fraction, f"{frac:.2e} of the codes differ from the reference"


def assert_layers_close(test: HybridLayerCache, want: HybridLayerCache, max_fraction=2e-3):
    assert_codes_close(test.k_packed, want.k_packed, max_fraction)
    assert_codes_close(test.v_packed, want.v_packed, max_fraction)
    for name in ("k_scales", "v_scales"):
        a, b = getattr(test, name).float(), getattr(want, name).float()
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=name)
    for name in ("k_sink", "v_sink", "k_ring", "v_ring"):
        a, b = getattr(test, name).float(), getattr(want, name).float()
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=name)
