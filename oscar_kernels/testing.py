"""Builders of small hybrid-cache scenarios shared by the kernel tests (CPU and GPU) and benchmarks.

A scenario holds B requests with given cached lengths; each request's positions map to
slots on randomly permuted pages (page 0 is never used, as in SGLang). Content is written
with the *reference* store, so every kernel under test reads a cache the oracle produced.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

import importlib
import sys

from oscar_kernels import reference as ref
from oscar_kernels.hybrid_cache import (HybridCache, HybridCacheIndex, HybridLayerCache, LayerRotation,  # noqa: F401
                                        allocate_index, allocate_layer, assign_sink_slots, head_major)
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


def random_rotation(h: int, d: int, generator: torch.Generator) -> LayerRotation:
    """Per-head random orthogonal K/V rotations; half the channels get finite clips."""
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
    return LayerRotation(orth(), orth(), klo, khi, vlo, vhi)


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


def slot_major(layer: HybridLayerCache) -> HybridLayerCache:
    """The layer with its INT2 codes and scales copied to slot-major storage ([slots, H, ...]
    contiguous; allocate_layer's are head-major), K/V scales still views of one tensor."""
    k_scales, v_scales = joined_scales(layer.k_scales, layer.v_scales, storage_head_major=False)
    return replace(layer, k_packed=layer.k_packed.contiguous(), v_packed=layer.v_packed.contiguous(),
                   k_scales=k_scales, v_scales=v_scales)


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


def clone_layer(layer: HybridLayerCache) -> HybridLayerCache:
    """A deep copy that keeps K/V scales as views of one tensor (deepcopy alone does not on CUDA)."""
    out = copy.deepcopy(layer)
    out.k_scales, out.v_scales = joined_scales(layer.k_scales, layer.v_scales)
    return out


def assert_codes_close(packed_a, packed_b, max_fraction=2e-3):
    """INT2 codes equal except rare +-1 level differences (rounding ties)."""
    a = unpack(packed_a).int()
    b = unpack(packed_b).int()
    diff = (a - b).abs()
    if diff.numel():
        assert int(diff.max()) <= 1, "codes differ from the reference by more than one level"
    frac = float((diff > 0).float().mean()) if diff.numel() else 0.0
    assert frac <= max_fraction, f"{frac:.2e} of the codes differ from the reference"


def assert_layers_close(test: HybridLayerCache, want: HybridLayerCache):
    """Codes and (scale, min) of two stores of the same tokens. With float8 scales, an fp32
    rounding difference in the rotation can move a group's scale or min by one float8 step
    (1/8 relative) and with it many of the group's codes by one level: looser bounds."""
    f8 = test.k_scales.element_size() == 1
    assert_codes_close(test.k_packed, want.k_packed, 0.05 if f8 else 2e-3)
    assert_codes_close(test.v_packed, want.v_packed, 0.05 if f8 else 2e-3)
    for name in ("k_scales", "v_scales"):
        a, b = getattr(test, name).float(), getattr(want, name).float()
        torch.testing.assert_close(a, b, rtol=0.13 if f8 else 2e-3, atol=2e-3, msg=name)
    for name in ("k_sink", "v_sink", "k_ring", "v_ring"):
        a, b = getattr(test, name).float(), getattr(want, name).float()
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=name)


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


def head_subset(sc: Scenario, heads: list[int]) -> Scenario:
    """The scenario restricted to some KV heads (copies of their buffers), for a cheaper
    reference on large caches."""
    hs = torch.tensor(heads, device=sc.device)
    parts = {f: getattr(sc.layer, f).index_select(-3 if f.endswith("scales") else -2, hs)
             for f in sc.layer.__dataclass_fields__}
    parts["k_scales"], parts["v_scales"] = joined_scales(parts["k_scales"], parts["v_scales"])
    lay = HybridLayerCache(**parts)
    rot = LayerRotation(*(getattr(sc.rotation, f)[hs] for f in LayerRotation.FIELDS))
    return Scenario(lay, sc.index, rot, sc.req_to_token, sc.rows, sc.lens, sc.sm_scale)


# ---------------------------------------------------------------- checks shared by CPU / GPU tests
def store_batch(sc: Scenario, starts):
    """New tokens: request i stores positions starts[i]..lens[i]-1 (seq_end = lens[i])."""
    g = torch.Generator().manual_seed(7)
    h, d, dev = sc.layer.num_kv_heads, sc.layer.head_dim, sc.device
    slots, pos, rows, ends = [], [], [], []
    for i, (s0, n) in enumerate(zip(starts, sc.lens)):
        r = int(sc.rows[i])
        p = torch.arange(s0, n, device=dev)
        pos.append(p)
        slots.append(sc.req_to_token[r, s0:n].long())
        rows.append(torch.full_like(p, r))
        ends.append(torch.full_like(p, n))
    t = sum(n - s0 for s0, n in zip(starts, sc.lens))
    k = (torch.randn(t, h, d, generator=g) * 2).bfloat16().to(dev)
    v = torch.randn(t, h, d, generator=g).bfloat16().to(dev)
    return k, v, torch.cat(slots), torch.cat(pos), torch.cat(rows).int(), torch.cat(ends).int()


def check_store(sc: Scenario, starts, store_fn, write_int2=True, write_ring=True):
    """store_fn (triton_store signature) against reference_store on clones of the cache."""
    k, v, slots, pos, rows, ends = store_batch(sc, starts)
    want = clone_layer(sc.layer)
    got = clone_layer(sc.layer)
    k_rot, v_rot = ref.reference_store(want, sc.index, sc.rotation, sc.req_to_token, k, v, slots, pos,
                                       rows, ends, write_int2, write_ring)
    ko = torch.zeros(k.shape, dtype=torch.bfloat16, device=k.device)
    vo = torch.zeros_like(ko)
    store_fn(got, sc.index, sc.rotation, sc.req_to_token, k, v, slots, pos, rows, ends, write_int2,
             write_ring, rotated_out=(ko, vo))
    assert_layers_close(got, want)
    torch.testing.assert_close(ko.float(), k_rot.bfloat16().float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(vo.float(), v_rot.bfloat16().float(), rtol=1e-2, atol=1e-2)
    return got


def decode_reference(sc: Scenario, q: torch.Tensor) -> torch.Tensor:
    """Un-rotated reference decode output (float32) of q [B, Hq, D]."""
    hq = q.shape[1]
    q_rot = ref.rotate(q, ref.expand_gqa(sc.rotation.k_rot, hq))
    o_rot = ref.reference_decode(q_rot, sc.layer, sc.index, sc.req_to_token, sc.rows,
                                 torch.tensor(sc.lens, device=q.device), sc.sm_scale)
    return ref.rotate(o_rot, ref.expand_gqa(sc.rotation.v_rot, hq).transpose(-1, -2))


def random_q(sc: Scenario, hq: int, seed=3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(len(sc.lens), hq, sc.layer.head_dim, generator=g) * 2).bfloat16().to(sc.device)


def check_decode(sc: Scenario, hq: int, decode_fn, config=None, seed=3):
    q = random_q(sc, hq, seed)
    want = decode_reference(sc, q)
    got = decode_fn(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                    torch.tensor(sc.lens, dtype=torch.int32, device=sc.device), sc.sm_scale, config=config)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def check_extend(sc: Scenario, hq: int, new_lens, extend_fn, prefix_read="int2"):
    g = torch.Generator().manual_seed(4)
    h, d, dev = sc.layer.num_kv_heads, sc.layer.head_dim, sc.device
    t = sum(new_lens)
    q = (torch.randn(t, hq, d, generator=g) * 2).bfloat16().to(dev)
    k_rot = torch.randn(t, h, d, generator=g).bfloat16().to(dev)
    v_rot = torch.randn(t, h, d, generator=g).bfloat16().to(dev)
    qo = torch.tensor([0] + list(new_lens)).cumsum(0).to(torch.int32).to(dev)
    pre = torch.tensor(sc.lens, dtype=torch.int32, device=dev)
    q_rot = ref.rotate(q, ref.expand_gqa(sc.rotation.k_rot, hq))
    o_rot = ref.reference_extend(q_rot, k_rot, v_rot, sc.layer, sc.index, sc.req_to_token, sc.rows, pre,
                                 qo, sc.sm_scale)
    want = ref.rotate(o_rot, ref.expand_gqa(sc.rotation.v_rot, hq).transpose(-1, -2))
    got = extend_fn(q, k_rot, v_rot, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows, pre, qo,
                    max(new_lens), sc.sm_scale, prefix_read=prefix_read)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def index_to(index: HybridCacheIndex, device) -> HybridCacheIndex:
    """A copy of the index on ``device`` (tensors copied even on the same device)."""
    return HybridCacheIndex(**{f: (v.to(device, copy=True) if isinstance(v, torch.Tensor) else v)
                               for f, v in vars(index).items()})


def attention_session(sc: Scenario, steps, hq, prefix_read="int2"):
    """Prefill chunks then decode steps through HybridAttention (one plan per step, the
    store -> attend -> ring protocol per call) on a copy of the scenario's cache; a step of
    one token after the first is a decode. Returns (outputs of every step, final layer)."""
    from .hybrid_attention import HybridAttention

    g = torch.Generator().manual_seed(21)
    dev = sc.device
    lay = clone_layer(sc.layer)
    cache = HybridCache([lay], [sc.rotation], index_to(sc.index, dev), sc.req_to_token)
    attn = HybridAttention(cache, hq, sc.sm_scale, prefix_read=prefix_read)
    h, d = lay.num_kv_heads, lay.head_dim
    b = len(sc.rows)
    rows = sc.rows.long()
    n = 0
    outs = []
    for t in steps:
        pos = (n + torch.arange(t, device=dev)).repeat(b)
        slots = sc.req_to_token[rows.repeat_interleave(t), pos]
        q = torch.randn(b * t, hq, d, generator=g).bfloat16().to(dev)
        k = torch.randn(b * t, h, d, generator=g).bfloat16().to(dev)
        v = torch.randn(b * t, h, d, generator=g).bfloat16().to(dev)
        if t == 1 and n > 0:
            attn.plan_decode(rows, torch.full((b,), n + 1, device=dev), pos, slots)
            outs.append(attn.decode(0, q, k, v))
        else:
            full = torch.full((b,), n, device=dev)
            attn.plan_extend(rows, full, torch.full((b,), t, device=dev), pos, slots, prefix_lens_host=[n] * b,
                             extend_lens_host=[t] * b, owners=torch.zeros(b, dtype=torch.int64, device=dev))
            outs.append(attn.extend(0, q, k, v))
        n += t
    return outs, lay


KERNEL_MODULES = ("triton_common", "triton_hybrid_attn", "triton_store", "triton_decode", "triton_materialize",
                  "triton_extend")


def interpreted_kernel_modules() -> list:
    """The oscar_kernels Triton modules (KERNEL_MODULES order) as the interpreter runs them
    (TRITON_INTERPRET=1 set by the caller), re-imported if something loaded them compiled."""
    common = sys.modules.get("oscar_kernels.triton_common")
    stale = common is not None and not common.INTERPRET
    mods = [importlib.import_module(f"oscar_kernels.{name}") for name in KERNEL_MODULES]
    return [importlib.reload(m) for m in mods] if stale else mods
