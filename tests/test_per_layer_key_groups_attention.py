"""A cache whose layers store keys in groups of different sizes (a version-4 rotations file)
runs through HybridAttention with one plan per batch shared by every layer: each layer's
outputs and buffers equal those of the same layer served alone. Reference path, and the Triton
kernels under the interpreter (OSCAR_FORCE_TRITON=1), with the keys' debias on (its prefix
rows are planned for the layer with the most groups and sliced per layer); on a GPU (-m gpu)
the compiled kernels. Bit for bit on the reference path and on the GPU; the interpreter's tl.dot
rounds in the CPU's BLAS order, so there the outputs and buffers are compared within the
kernel tests' tolerances (a layer read at another layer's groups is off by far more)."""
import copy

import pytest
import torch
from kernel_helpers import assert_attention_close, assert_layers_close

from oscar_kernels import testing as kc
from oscar_kernels.hybrid_attention import HybridAttention
from oscar_kernels.hybrid_cache import HybridCache, allocate_layer

GROUPS = (32, 8, 16)  # layer 0 is not the one with the most groups
HQ, H, D = 4, 2, 64
STEPS = (24, 20, 1, 1, 1)  # two prefill chunks (the second reads an INT2 prefix), three decode steps


def _layers(sc):
    lc = sc.layer
    slots, rows, sink_slots = lc.k_packed.shape[0], lc.k_ring.shape[0], lc.k_sink.shape[0]
    return [allocate_layer(slots, H, D, g, lc.sink_tokens, lc.recent_window, sink_slots, rows,
                           lc.k_scales.dtype, sc.device, value_group_size=64) for g in GROUPS]


def _session(sc, layer_ids, layers, rotations, key_debias, prefix_read):
    """Outputs [step][layer] of ``layers`` (model layers ``layer_ids``' inputs) through one HybridAttention."""
    cache = HybridCache(layers, rotations, copy.deepcopy(sc.index), sc.req_to_token)
    attn = HybridAttention(cache, HQ, sc.sm_scale, key_debias=key_debias, prefix_read=prefix_read)
    rows, b, dev = sc.rows.long(), len(sc.rows), sc.device
    outs, n = [], 0
    for step, t in enumerate(STEPS):
        pos = (n + torch.arange(t, device=dev)).repeat(b)
        slots = sc.req_to_token[rows.repeat_interleave(t), pos]
        full = lambda x: torch.full((b,), x, device=dev)
        if t == 1:
            attn.plan_decode(rows, full(n + 1), pos, slots)
        else:
            attn.plan_extend(rows, full(n), full(t), pos, slots, prefix_lens_host=[n] * b,
                             extend_lens_host=[t] * b, owners=torch.zeros(b, dtype=torch.int64, device=dev))
        row = []
        for i, model_layer in enumerate(layer_ids):
            g = torch.Generator().manual_seed(1000 * step + model_layer)  # a layer's inputs wherever it is served
            q, k, v = (torch.randn(b * t, heads, D, generator=g).bfloat16().to(dev) for heads in (HQ, H, H))
            row.append((attn.decode if t == 1 else attn.extend)(i, q, k, v))
        outs.append(row)
        n += t
    return outs


def _layers_equal_alone(sc, triton, prefix_read, bitwise=True):
    g = torch.Generator().manual_seed(7)
    rotations = [kc.random_rotation(H, D, g).to(sc.device) for _ in GROUPS]
    layers = _layers(sc)
    debias = triton and prefix_read != "flashinfer"  # FlashInfer's prefill cannot apply it
    together = _session(sc, range(len(GROUPS)), layers, rotations, debias, prefix_read)
    for i in range(len(GROUPS)):
        alone_layer = _layers(sc)[i]
        alone = _session(sc, [i], [alone_layer], [rotations[i]], debias, prefix_read)
        for step, (a, b) in enumerate(zip(together, alone)):
            if bitwise:
                assert torch.equal(a[i], b[0]), (GROUPS[i], step)
            else:
                assert_attention_close(a[i], b[0].float())
        if bitwise:
            for name in layers[i].__dataclass_fields__:
                assert torch.equal(getattr(layers[i], name), getattr(alone_layer, name)), (GROUPS[i], name)
        else:
            assert_layers_close(layers[i], alone_layer)
    assert [lc.key_group_size for lc in layers] == list(GROUPS)


@pytest.mark.parametrize("triton,prefix_read", [(False, "int2"), (True, "int2"), (True, "bf16")])
def test_layers_of_different_key_groups_share_one_plan(monkeypatch, triton, prefix_read):
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1" if triton else "0")
    _layers_equal_alone(kc.build([64, 64], H=H, D=D, G=16, S=4, W=8, page=8, seed=5, fill=False), triton, prefix_read,
                        bitwise=not triton)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix_read", ["int2", "bf16", "flashinfer"])
def test_layers_of_different_key_groups_share_one_plan_on_the_gpu(prefix_read):
    _layers_equal_alone(kc.build([64, 64], H=H, D=D, G=16, S=4, W=8, page=8, seed=5, fill=False, device="cuda"),
                        True, prefix_read)


def test_warm_up_compiles_every_layout(monkeypatch):
    """The warm-up runs one private layer per distinct key group, each with its own rotation."""
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "0")
    sc = kc.build([40, 24], H=H, D=D, G=16, S=4, W=8, page=8, seed=3)
    g = torch.Generator().manual_seed(7)
    layers = _layers(sc) + _layers(sc)[:1]  # 32, 8, 16, 32
    cache = HybridCache(layers, [kc.random_rotation(H, D, g) for _ in layers], sc.index, sc.req_to_token)
    attn = HybridAttention(cache, HQ, sc.sm_scale)
    seen = []
    real_decode = attn.decode

    def decode(layer, *a, **kw):
        seen.append(attn.cache.layers[layer].key_group_size)
        return real_decode(layer, *a, **kw)

    monkeypatch.setattr(attn, "decode", decode)
    assert attn.warm_up() > 0 and attn.cache is cache
    assert seen == [32, 8, 16] * 2  # two decode steps, each over the three layouts
