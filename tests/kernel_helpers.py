"""Checks the kernel tests make on oscar_kernels.testing scenarios (CPU and GPU): each kernel
against its PyTorch twin (oscar_kernels.reference) on a copy of the cache, and the
interpreted kernel modules."""
from __future__ import annotations

import copy
import importlib
import sys
from dataclasses import replace

import torch

from oscar_kernels import reference as ref
from oscar_kernels.hybrid_cache import HybridCache, HybridLayerCache, LayerRotation
from oscar_kernels.int2 import unpack
from oscar_kernels.testing import Scenario, index_to, joined_scales, random_q


def slot_major(layer: HybridLayerCache) -> HybridLayerCache:
    """The layer with its INT2 codes and scales copied to slot-major storage ([slots, H, ...]
    contiguous; allocate_layer's are head-major), K/V scales still views of one tensor."""
    k_scales, v_scales = joined_scales(layer.k_scales, layer.v_scales, storage_head_major=False)
    return replace(layer, k_packed=layer.k_packed.contiguous(), v_packed=layer.v_packed.contiguous(),
                   k_scales=k_scales, v_scales=v_scales)


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


# The kernels' error is absolute, at the scale of the cached values (bf16 weights p * scale, and
# the float32 cancellation of the codes' offset, whose rounding follows the summation order of
# the CPU's BLAS under the interpreter): up to 0.041 over the decode geometries on an AMD EPYC
# (2026-12-03), where atol 0.03 failed one near-zero output; a wrong read is off by >= 0.5.
ATTENTION_ATOL = 0.05


def assert_attention_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """A kernel's attention output (bf16) against its float32 reference."""
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=ATTENTION_ATOL)


def decode_reference(sc: Scenario, q: torch.Tensor, sinks: torch.Tensor | None = None,
                     key_debias: bool = False) -> torch.Tensor:
    """Un-rotated reference decode output (float32) of q [B, Hq, D]."""
    hq = q.shape[1]
    q_rot = ref.rotate(q, ref.expand_gqa(sc.rotation.k_rot, hq))
    o_rot = ref.reference_decode(q_rot, sc.layer, sc.index, sc.req_to_token, sc.rows,
                                 torch.tensor(sc.lens, device=q.device), sc.sm_scale, sinks, key_debias)
    return ref.rotate(o_rot, ref.expand_gqa(sc.rotation.v_rot, hq).transpose(-1, -2))


def check_decode(sc: Scenario, hq: int, decode_fn, config=None, seed=3, sinks=None, key_debias=False):
    """The kernel against the reference; returns the kernel's output."""
    q = random_q(sc, hq, seed)
    want = decode_reference(sc, q, sinks, key_debias)
    got = decode_fn(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                    torch.tensor(sc.lens, dtype=torch.int32, device=sc.device), sc.sm_scale, config=config,
                    **({"key_debias": True} if key_debias else {}), **({} if sinks is None else {"sinks": sinks}))
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert_attention_close(got, want)
    return got


def check_extend(sc: Scenario, hq: int, new_lens, extend_fn, prefix_read="int2", sinks=None, key_debias=False):
    """The kernel against the reference; returns the kernel's output."""
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
                                 qo, sc.sm_scale, sinks, key_debias)
    want = ref.rotate(o_rot, ref.expand_gqa(sc.rotation.v_rot, hq).transpose(-1, -2))
    got = extend_fn(q, k_rot, v_rot, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows, pre, qo,
                    max(new_lens), sc.sm_scale, prefix_read=prefix_read, **({"key_debias": True} if key_debias else {}),
                    **({} if sinks is None else {"sinks": sinks}))
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert_attention_close(got, want)
    return got


def attention_session(sc: Scenario, steps, hq, prefix_read="int2", sinks=None):
    """Prefill chunks then decode steps through HybridAttention (one plan per step, the
    store -> attend -> ring protocol per call) on a copy of the scenario's cache; a step of
    one token after the first is a decode; ``sinks``: learned sink logits [hq] or None. Returns (outputs of every step, final layer)."""
    from oscar_kernels.hybrid_attention import HybridAttention

    g = torch.Generator().manual_seed(21)
    dev = sc.device
    lay = clone_layer(sc.layer)
    cache = HybridCache([lay], [sc.rotation], index_to(sc.index, dev), sc.req_to_token)
    attn = HybridAttention(cache, hq, sc.sm_scale, prefix_read=prefix_read, learned_sinks=sinks is not None)
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
            outs.append(attn.decode(0, q, k, v, sinks=sinks))
        else:
            full = torch.full((b,), n, device=dev)
            attn.plan_extend(rows, full, torch.full((b,), t, device=dev), pos, slots, prefix_lens_host=[n] * b,
                             extend_lens_host=[t] * b, owners=torch.zeros(b, dtype=torch.int64, device=dev))
            outs.append(attn.extend(0, q, k, v, sinks=sinks))
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


def tree_depths(parents: list[list[int]]) -> list[list[int]]:
    """Depth of every draft (0 for a draft whose parent is the prefix)."""
    out = []
    for par in parents:
        d = []
        for i, p in enumerate(par):
            assert p < i, "parents come before their children"
            d.append(0 if p < 0 else d[p] + 1)
        out.append(d)
    return out


def speculative_vs_decode(sc: Scenario, hq: int, parents: list[list[int]], accepted: list[list[int]], *,
                          seed: int = 5, sinks=None, exact: bool = True, extra_layer_seed: int | None = None):
    """Speculative verify of drafts (``parents`` per request, speculative module layout; draft i
    of request b at position n_b + depth in slot req_to_token[row, n_b + i], as SGLang lays out
    a verify) then, after move (trees) and commit of ``accepted`` (draft indices in path order),
    against plain decode of the accepted drafts one by one on a copy of the cache. Asserts:
    the accepted drafts' verify outputs equal decode's (``exact``: to bf16 rounding, the
    reference path; else within the kernels' tolerance); the INT2 cells of every slot but the
    drafts' are untouched (bitwise) and the accepted drafts' final cells, the whole sink and
    ring buffers (kh.assert_layers_close) and the index (ring end, validity, sink slots) are
    decode's. With
    ``extra_layer_seed`` a second layer (its own rotation and cache) runs too."""
    from oscar_kernels.hybrid_attention import HybridAttention
    from oscar_kernels.hybrid_cache import move_int2_cells
    from oscar_kernels.testing import another_layer

    dev = sc.device
    scs = [sc] if extra_layer_seed is None else [sc, another_layer(sc, extra_layer_seed)]
    b, t = len(parents), len(parents[0])
    assert all(len(p) == t for p in parents) and len(accepted) == b
    depths = tree_depths(parents)
    g = torch.Generator().manual_seed(seed)
    rows = sc.rows.long()
    n = [int(x) for x in sc.lens]
    positions = torch.tensor([n[i] + d for i in range(b) for d in depths[i]], device=dev)
    slots = torch.stack([sc.req_to_token[int(rows[i]), n[i] + j] for i in range(b) for j in range(t)]).long()
    h, d = sc.layer.num_kv_heads, sc.layer.head_dim
    qkv = [[(torch.randn(b * t, hh, d, generator=g) * 2).bfloat16().to(dev) for hh in (hq, h, h)] for _ in scs]

    base_index = index_to(sc.index, dev)
    base_index.ring_end[rows] = torch.tensor(n, dtype=base_index.ring_end.dtype, device=dev)  # the last step's end

    def fresh_cache():
        return HybridCache([clone_layer(s.layer) for s in scs], [s.rotation for s in scs], index_to(base_index, dev),
                           sc.req_to_token)

    spec = fresh_cache()
    attn = HybridAttention(spec, hq, sc.sm_scale, max_draft_tokens=t, max_batch=b, learned_sinks=sinks is not None)
    attn.plan_verify(sc.rows, torch.tensor(n, device=dev), positions, slots, num_draft_tokens=t,
                     parents=torch.tensor(parents, device=dev))
    outs = [attn.verify(layer, *qkv[layer], sinks=sinks) for layer in range(len(scs))]
    width = max(max((len(a) for a in accepted), default=0), 1)
    acc = torch.tensor([a + [-1] * (width - len(a)) for a in accepted], dtype=torch.int64, device=dev)
    tgt = [sc.req_to_token[int(rows[i]), n[i] + k] for i in range(b) for k in range(len(accepted[i]))]
    src = [slots[i * t + a] for i in range(b) for a in accepted[i]]
    if tgt:  # SGLang's move of the accepted path to the front (a no-op for a chain)
        move_int2_cells(spec.layers, torch.stack(tgt), torch.stack(src))
    attn.commit(acc)

    plain = fresh_cache()
    dec = HybridAttention(plain, hq, sc.sm_scale, learned_sinks=sinks is not None)
    for i in range(b):
        row = sc.rows[i:i + 1]
        for k, a in enumerate(accepted[i]):
            assert depths[i][a] == k, "an accepted path goes down the tree from the root"
            tok = i * t + a
            p = n[i] + k
            dec.plan_decode(row, torch.tensor([p + 1], device=dev), torch.tensor([p], device=dev),
                            sc.req_to_token[int(rows[i]), p:p + 1])
            for layer in range(len(scs)):
                q, kk, vv = (x[tok:tok + 1] for x in qkv[layer])
                want = dec.decode(layer, q, kk, vv, sinks=sinks)
                got = outs[layer][tok:tok + 1]
                if exact:
                    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
                else:
                    assert_attention_close(got, want.float())

    rejected = [int(sc.req_to_token[int(rows[i]), n[i] + j]) for i in range(b) for j in range(len(accepted[i]), t)]
    final = torch.tensor([int(x) for x in tgt], dtype=torch.long, device=dev)
    untouched = torch.ones(sc.layer.k_packed.shape[0], dtype=torch.bool, device=dev)
    untouched[torch.tensor(rejected, dtype=torch.long, device=dev)] = False
    untouched[final] = False
    int2 = ("k_packed", "v_packed", "k_scales", "v_scales")
    for got, want in zip(spec.layers, plain.layers):
        for name in int2:  # cells neither run wrote: bitwise
            assert torch.equal(getattr(got, name)[untouched].view(torch.uint8),
                               getattr(want, name)[untouched].view(torch.uint8)), name
        # the accepted drafts' cells, sinks and rings: the same up to the rounding of the rotation, whose
        # float32 summation order follows the number of tokens stored at once (BLAS on the CPU)
        assert_layers_close(replace(got, **{f: getattr(got, f)[final] for f in int2}),
                            replace(want, **{f: getattr(want, f)[final] for f in int2}))
    for name in ("ring_end", "ring_valid_from", "sink_slot_of_page", "page_of_sink_slot"):
        assert torch.equal(getattr(spec.index, name), getattr(plain.index, name)), name
    return outs
