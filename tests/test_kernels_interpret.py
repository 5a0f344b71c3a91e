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

_KERNEL_MODULES = ["oscar_kernels.triton_common", "oscar_kernels.triton_store"]


def _interpreted_modules():
    """Import (or re-import, if something loaded them compiled) the kernel modules."""
    mods = []
    for name in _KERNEL_MODULES:
        mod = importlib.import_module(name)
        if not getattr(sys.modules["oscar_kernels.triton_common"], "INTERPRET", False):
            mod = importlib.reload(mod)
        mods.append(mod)
    return mods


_, triton_store_mod = _interpreted_modules()


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
