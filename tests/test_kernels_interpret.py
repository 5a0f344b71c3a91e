"""Triton kernels vs their PyTorch reference under TRITON_INTERPRET=1 (CPU, small shapes)."""
import importlib
import os
import sys

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: run this file alone with TRITON_INTERPRET=1 (interpreted kernels)",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernel_cases as kc  # noqa: E402
from oscar_kernels import reference as ref  # noqa: E402

_KERNEL_MODULES = ["oscar_kernels.triton_common", "oscar_kernels.triton_hybrid_attn", "oscar_kernels.triton_store",
                   "oscar_kernels.triton_decode", "oscar_kernels.triton_extend"]


def _interpreted_modules():
    """Import the kernel modules; re-import them if something loaded them compiled."""
    common = sys.modules.get("oscar_kernels.triton_common")
    stale = common is not None and not common.INTERPRET
    mods = []
    for name in _KERNEL_MODULES:
        mod = importlib.import_module(name)
        mods.append(importlib.reload(mod) if stale else mod)
    return mods


_, _, triton_store_mod, triton_decode_mod, triton_extend_mod = _interpreted_modules()


# ---------------------------------------------------------------- store
def _store_batch(sc, starts):
    """New tokens: request i stores positions starts[i]..lens[i]-1 (seq_end = lens[i])."""
    g = torch.Generator().manual_seed(7)
    h, d = sc.layer.num_kv_heads, sc.layer.head_dim
    slots, pos, rows, ends = [], [], [], []
    for i, (s0, n) in enumerate(zip(starts, sc.lens)):
        r = int(sc.rows[i])
        p = torch.arange(s0, n)
        pos.append(p)
        slots.append(sc.req_to_token[r, s0:n].long())
        rows.append(torch.full_like(p, r))
        ends.append(torch.full_like(p, n))
    t = sum(n - s0 for s0, n in zip(starts, sc.lens))
    k = (torch.randn(t, h, d, generator=g) * 2).bfloat16()
    v = torch.randn(t, h, d, generator=g).bfloat16()
    return k, v, torch.cat(slots), torch.cat(pos), torch.cat(rows).int(), torch.cat(ends).int()


@pytest.mark.parametrize("cfg", [
    dict(D=64, G=16, S=4, W=8, page=8),
    dict(D=64, G=64, S=0, W=8, page=8),
    dict(D=128, G=32, S=4, W=0, page=4),
    dict(D=128, G=8, S=2, W=16, page=16),
])
@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True)])
def test_store_matches_reference(cfg, flags):
    write_int2, write_ring = flags
    lens = [21, 9, 5, 12]
    starts = [20, 3, 0, 0]  # decode token, extend chunk, two new sequences (sinks)
    sc = kc.build(lens, H=2, fill=False, no_sink=(3,), seed=1, **cfg)
    k, v, slots, pos, rows, ends = _store_batch(sc, starts)
    want = kc.clone_layer(sc.layer)
    got = kc.clone_layer(sc.layer)
    k_rot, v_rot = ref.reference_store(want, sc.index, sc.rotation, sc.req_to_token, k, v, slots, pos,
                                       rows, ends, write_int2, write_ring)
    ko = torch.zeros(k.shape, dtype=torch.bfloat16)
    vo = torch.zeros(k.shape, dtype=torch.bfloat16)
    triton_store_mod.triton_store(got, sc.index, sc.rotation, sc.req_to_token, k, v, slots, pos, rows,
                                  ends, write_int2, write_ring, rotated_out=(ko, vo))
    kc.assert_layers_close(got, want)
    torch.testing.assert_close(ko.float(), k_rot.bfloat16().float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(vo.float(), v_rot.bfloat16().float(), rtol=1e-2, atol=1e-2)
    if write_int2 and cfg["S"]:
        assert got.k_sink.abs().sum() > 0  # sinks were written for the new sequences
    if write_ring and cfg["W"]:
        assert got.k_ring.abs().sum() > 0


# ---------------------------------------------------------------- decode
def _decode_reference(sc, q):
    hq = q.shape[1]
    q_rot = ref.rotate(q, ref.expand_gqa(sc.rotation.k_rot, hq))
    o_rot = ref.reference_decode(q_rot, sc.layer, sc.index, sc.req_to_token, sc.rows,
                                 torch.tensor(sc.lens), sc.sm_scale)
    return ref.rotate(o_rot, ref.expand_gqa(sc.rotation.v_rot, hq).transpose(-1, -2))


def _check_decode(sc, hq, config, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(len(sc.lens), hq, sc.layer.head_dim, generator=g) * 2).bfloat16()
    want = _decode_reference(sc, q)
    got = triton_decode_mod.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                                          torch.tensor(sc.lens, dtype=torch.int32), sc.sm_scale,
                                          config=config)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


_SMALL = dict(block_n=16, block_n_bf16=16, min_chunk=16, target_programs=64, max_splits=4)


@pytest.mark.parametrize("case", [
    # (D, G, Hq, H, S, W, page, magic, extra)
    (64, 16, 4, 2, 4, 8, 8, True, {}),
    (64, 64, 2, 2, 4, 8, 8, False, {}),
    (128, 32, 8, 1, 2, 16, 4, True, {}),
    (128, 8, 8, 2, 4, 8, 8, True, {}),
    (64, 4, 4, 2, 0, 8, 8, False, {}),
    (64, 16, 16, 2, 4, 0, 8, True, {}),
    (64, 32, 4, 1, 0, 0, 8, True, {}),
])
def test_decode_matches_reference(case):
    d, grp, hq, h, s, w, page, magic, extra = case
    lens = [1, 3, 13, 40, 77]  # shorter than S+W, page boundaries, several splits
    sc = kc.build(lens, H=h, D=d, G=grp, S=s, W=w, page=page, seed=d + grp + hq, **extra)
    cfg = triton_decode_mod.DecodeConfig(magic_unpack=magic, **_SMALL)
    _check_decode(sc, hq, cfg)


def test_decode_invalid_sink_and_late_ring_start():
    lens = [30, 45, 12]
    # request 0's sink slot evicted -> INT2; ring valid only from 40 / 11 for requests 1 / 2
    sc = kc.build(lens, H=2, D=64, G=16, S=4, W=8, page=8, evict_sink_of=(0,), no_sink=(2,),
                  valid_from=[0, 40, 11], seed=5)
    cfg = triton_decode_mod.DecodeConfig(**_SMALL)
    _check_decode(sc, 4, cfg)


@pytest.mark.parametrize("variant", [dict(use_dot=False), dict(min_block_h=1), dict(max_splits=1)])
def test_decode_variants(variant):
    sc = kc.build([9, 50], H=2, D=64, G=16, S=4, W=8, page=8, seed=11)
    cfg = triton_decode_mod.DecodeConfig(**{**_SMALL, **variant})
    _check_decode(sc, 4, cfg)


def test_decode_workspace_reuse_and_out():
    sc = kc.build([20, 33], H=2, D=64, G=16, S=4, W=8, page=8, seed=12)
    cfg = triton_decode_mod.DecodeConfig(**_SMALL)
    ws = triton_decode_mod.DecodeWorkspace(4, 4, 2, 64, "cpu", cfg)
    q = torch.randn(2, 4, 64).bfloat16()
    out = torch.empty(2, 4, 64, dtype=torch.bfloat16)
    lens = torch.tensor(sc.lens, dtype=torch.int32)
    r = triton_decode_mod.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                                        lens, sc.sm_scale, out=out, workspace=ws)
    assert r is out
    torch.testing.assert_close(out.float(), _decode_reference(sc, q), rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="max_batch"):
        triton_decode_mod.triton_decode(torch.randn(5, 4, 64).bfloat16(), sc.layer, sc.index, sc.rotation,
                                        sc.req_to_token, torch.zeros(5, dtype=torch.int32),
                                        torch.ones(5, dtype=torch.int32), 1.0, workspace=ws)


# ---------------------------------------------------------------- extend
def _check_extend(sc, hq, new_lens, config, seed=4):
    g = torch.Generator().manual_seed(seed)
    h, d = sc.layer.num_kv_heads, sc.layer.head_dim
    t = sum(new_lens)
    q = (torch.randn(t, hq, d, generator=g) * 2).bfloat16()
    k_rot = torch.randn(t, h, d, generator=g).bfloat16()
    v_rot = torch.randn(t, h, d, generator=g).bfloat16()
    qo = torch.tensor([0] + new_lens).cumsum(0).to(torch.int32)
    pre = torch.tensor(sc.lens, dtype=torch.int32)
    q_rot = ref.rotate(q, ref.expand_gqa(sc.rotation.k_rot, hq))
    o_rot = ref.reference_extend(q_rot, k_rot, v_rot, sc.layer, sc.index, sc.req_to_token, sc.rows, pre,
                                 qo, sc.sm_scale)
    want = ref.rotate(o_rot, ref.expand_gqa(sc.rotation.v_rot, hq).transpose(-1, -2))
    got = triton_extend_mod.triton_extend(q, k_rot, v_rot, sc.layer, sc.index, sc.rotation, sc.req_to_token,
                                          sc.rows, pre, qo, max(new_lens), sc.sm_scale, config=config)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


_SMALL_EXT = dict(block_rows=16, block_n=16, block_n_bf16=16)


@pytest.mark.parametrize("case", [
    # (D, G, Hq, H, S, W, page, magic)
    (64, 16, 4, 2, 4, 8, 8, True),
    (64, 4, 2, 2, 0, 8, 8, False),
    (128, 32, 8, 1, 2, 0, 4, True),
    (64, 64, 16, 2, 4, 16, 8, True),
])
def test_extend_matches_reference(case):
    d, grp, hq, h, s, w, page, magic = case
    prefix = [0, 5, 13, 40]  # empty prefix, shorter than S+W, several pages
    new = [7, 1, 20, 9]  # one request longer than a block of rows
    sc = kc.build(prefix, H=h, D=d, G=grp, S=s, W=w, page=page, seed=d + hq)
    cfg = triton_extend_mod.ExtendConfig(magic_unpack=magic, **_SMALL_EXT)
    _check_extend(sc, hq, new, cfg)


def test_extend_chunked_prefill_after_prefix_hit():
    # request 0: prefix hit of 24 tokens, ring valid from 24 (nothing of the prefix in BF16
    # but the sinks); request 1: second chunk, ring valid from 10; request 2: evicted sink
    prefix = [24, 30, 19]
    sc = kc.build(prefix, H=2, D=64, G=16, S=4, W=8, page=8, valid_from=[24, 10, 0],
                  evict_sink_of=(2,), seed=9)
    _check_extend(sc, 4, [5, 12, 0], triton_extend_mod.ExtendConfig(**_SMALL_EXT))


# ---------------------------------------------------------------- api dispatch, end to end
def _api_session(force_triton, monkeypatch, sc, steps, hq, seed=21):
    """Prefill chunks then decode steps through oscar_kernels.api (the server's call order);
    returns the outputs of every step."""
    from oscar_kernels import api
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1" if force_triton else "0")
    assert api.use_triton(torch.zeros(1)) == force_triton
    g = torch.Generator().manual_seed(seed)
    lay, idx = kc.clone_layer(sc.layer), kc.HybridCacheIndex(
        sc.index.page_size, sc.index.sink_slot_of_page.clone(), sc.index.page_of_sink_slot.clone(),
        sc.index.ring_valid_from.clone(), sc.index.sink_cursor)
    h, d = lay.num_kv_heads, lay.head_dim
    b = len(sc.rows)
    rows = sc.rows.long()
    n = torch.zeros(b, dtype=torch.long)
    outs = []
    for t in steps:
        tok_rows = rows.repeat_interleave(t)
        pos = (n[:, None] + torch.arange(t)[None, :]).flatten()
        slots = sc.req_to_token[tok_rows, pos]
        ends = (n + t).repeat_interleave(t)
        q = torch.randn(b * t, hq, d, generator=g).bfloat16()
        k = torch.randn(b * t, h, d, generator=g).bfloat16()
        v = torch.randn(b * t, h, d, generator=g).bfloat16()
        common = (lay, idx, sc.rotation, sc.req_to_token)
        if t == 1 and int(n[0]) > 0:
            api.store_kv(*common, k, v, slots, pos, tok_rows, ends)
            outs.append(api.decode_attention(q, *common, rows, n + 1, sc.sm_scale))
        else:
            k_rot, v_rot = torch.empty_like(k), torch.empty_like(v)
            api.store_kv(*common, k, v, slots, pos, tok_rows, ends, write_ring=False,
                         rotated_out=(k_rot, v_rot))
            qo = torch.arange(b + 1) * t
            outs.append(api.extend_attention(q, k_rot, v_rot, *common, rows, n, qo, t, sc.sm_scale))
            api.store_kv(*common, k, v, slots, pos, tok_rows, ends, write_int2=False, write_ring=True)
        n += t
    return outs, lay


def test_api_triton_matches_reference_end_to_end(monkeypatch):
    sc = kc.build([48, 48], H=2, D=64, G=16, S=4, W=8, page=8, fill=False, seed=13)
    from oscar_kernels.hybrid_cache import assign_sink_slots
    assign_sink_slots(sc.index, sc.req_to_token[sc.rows.long(), 0], sc.layer.k_sink.shape[0])
    steps = [13, 20, 1, 1, 1]  # two prefill chunks, three decode steps
    want, lay_ref = _api_session(False, monkeypatch, sc, steps, 4)
    got, lay_tri = _api_session(True, monkeypatch, sc, steps, 4)
    kc.assert_layers_close(lay_tri, lay_ref)
    for a, w in zip(got, want):
        torch.testing.assert_close(a.float(), w.float(), rtol=3e-2, atol=3e-2)
