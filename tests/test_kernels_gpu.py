"""Triton kernels vs the PyTorch reference on a GPU, plus long contexts and CUDA graphs.

Run on the GPU machine:  python -m pytest -m gpu tests/test_kernels_gpu.py --durations=10
(Skipped without CUDA by tests/conftest.py; never under TRITON_INTERPRET.) Most of the time
goes into compiling kernels, so parametrisations are kept to distinct code paths.
"""
import functools
import os

import pytest
import torch

from oscar_kernels import testing as kc
import kernel_helpers as kh

pytestmark = pytest.mark.gpu

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("GPU tests need compiled kernels (unset TRITON_INTERPRET)", allow_module_level=True)


@pytest.fixture(scope="module")
def kernels():
    from oscar_kernels import hybrid_attention, triton_decode, triton_extend, triton_store
    return hybrid_attention, triton_store, triton_decode, triton_extend


def _gpu(sc):
    return kc.to_device(sc, "cuda")


# ---------------------------------------------------------------- same checks as on CPU
_STORE_CFGS = [
    dict(D=64, G=16, S=4, W=8, page=8),
    dict(D=128, G=128, S=16, W=64, page=64),
    dict(D=128, G=32, S=4, W=0, page=16),
    dict(D=128, G=8, S=0, W=16, page=16),
]


@pytest.mark.parametrize("cfg, flags", [(c, (True, True)) for c in _STORE_CFGS]
                         + [(_STORE_CFGS[1], (True, False)), (_STORE_CFGS[1], (False, True))])
def test_store_gpu(kernels, cfg, flags):
    _, ts, _, _ = kernels
    lens = [211, 90, 65, 128]
    starts = [210, 3, 0, 0]
    sc = kc.build(lens, H=4, fill=False, no_sink=(3,), seed=1, device="cuda", **cfg)
    kh.check_store(sc, starts, ts.triton_store, *flags)


_DECODE_CASES = [
    # (D, G, Hq, H, S, W, page)
    (128, 128, 32, 8, 16, 128, 64),
    (128, 64, 16, 8, 16, 64, 64),
    (128, 32, 8, 8, 4, 16, 16),
    (128, 8, 16, 2, 4, 16, 16),
    (64, 64, 4, 4, 4, 16, 16),
    (64, 16, 2, 2, 0, 16, 16),
    (128, 128, 16, 2, 16, 0, 64),
    (128, 128, 8, 8, 0, 0, 64),
]


@pytest.mark.parametrize("case", _DECODE_CASES)
def test_decode_gpu(kernels, case):
    _, _, td, _ = kernels
    d, g, hq, h, s, w, page = case
    lens = [1, 7, max(s + w, 1), s + w + 1, 300, 1000, 4099]  # empty history, boundaries, splits
    sc = kc.build(lens, H=h, D=d, G=g, S=s, W=w, page=page, seed=d + g + hq, device="cuda")
    kh.check_decode(sc, hq, td.triton_decode)


def test_decode_gpu_invalid_sink_and_late_ring(kernels):
    _, _, td, _ = kernels
    lens = [300, 450, 120, 2000]
    sc = kc.build(lens, H=4, D=128, G=128, S=16, W=64, page=64, evict_sink_of=(0,), no_sink=(2,),
                  valid_from=[0, 420, 100, 1990], seed=5, device="cuda")
    kh.check_decode(sc, 16, td.triton_decode)


@pytest.mark.parametrize("split_policy", [dict(max_splits=1), dict(min_chunk=64, target_programs=4096),
                                          dict(batch_invariant=True)])
def test_decode_gpu_split_policies(kernels, split_policy):
    """One split, many small splits, and the batch-invariant shape (large-batch tiles and the
    query-head merge at batch 3)."""
    _, _, td, _ = kernels
    sc = kc.build([5, 900, 3000], H=8, D=128, G=128, S=16, W=64, page=64, seed=11, device="cuda")
    kh.check_decode(sc, 32, td.triton_decode, td.DecodeConfig(**split_policy))


def _sinks(hq: int) -> torch.Tensor:
    """gpt-oss's learned sink logits (bf16 on the device), one far above the scores, one far below."""
    s = torch.randn(hq, generator=torch.Generator().manual_seed(hq)) * 2
    s[0], s[-1] = 30.0, -30.0
    return s.bfloat16().cuda()


@pytest.mark.parametrize("lens", [[5, 900, 3000], [1, 7, 300, 1000, 4099, 80]])  # split merge, query-head merge
def test_decode_with_learned_sinks_gpu(kernels, lens):
    """gpt-oss's geometry: 64 query / 8 KV heads, head_dim 64."""
    _, _, td, _ = kernels
    sc = kc.build(lens, H=8, D=64, G=16, S=16, W=64, page=64, seed=len(lens), device="cuda")
    kh.check_decode(sc, 64, td.triton_decode, sinks=_sinks(64))


@pytest.mark.parametrize("prefix_read", ["int2", "bf16"])
def test_extend_with_learned_sinks_gpu(kernels, prefix_read):
    _, _, _, te = kernels
    prefix, new = [0, 5, 130, 700], [70, 1, 200, 33]
    sc = kc.build(prefix, H=8, D=64, G=16, S=16, W=64, page=64, seed=7, device="cuda")
    kh.check_extend(sc, 64, new, functools.partial(te.triton_extend, prefix_lens_host=prefix), prefix_read,
                    sinks=_sinks(64))


@pytest.mark.parametrize("case", [
    (128, 128, 32, 8, 16, 64, 64),
    (128, 32, 8, 8, 4, 16, 16),
    (64, 16, 4, 2, 4, 8, 8),
    (128, 8, 16, 2, 0, 0, 16),
])
def test_extend_gpu(kernels, case):
    _, _, _, te = kernels
    d, g, hq, h, s, w, page = case
    prefix = [0, 5, 130, 700]
    new = [70, 1, 200, 33]
    sc = kc.build(prefix, H=h, D=d, G=g, S=s, W=w, page=page, seed=d + hq, device="cuda")
    kh.check_extend(sc, hq, new, te.triton_extend)


def test_float8_scales_gpu(kernels):
    """Groups of 64 with float8 (scale, min): store, decode and extend against the reference."""
    _, ts, td, te = kernels
    f8 = torch.float8_e4m3fn
    sc = kc.build([211, 90, 65], H=4, D=128, G=64, S=16, W=64, page=64, fill=False, seed=2, device="cuda",
                  scale_dtype=f8)
    kh.check_store(sc, [210, 3, 0], ts.triton_store)
    sc = kc.build([5, 900, 3000], H=8, D=128, G=64, S=16, W=64, page=64, seed=3, device="cuda", scale_dtype=f8)
    kh.check_decode(sc, 32, td.triton_decode)
    sc = kc.build([0, 130, 700], H=8, D=128, G=64, S=16, W=64, page=64, seed=4, device="cuda", scale_dtype=f8)
    kh.check_extend(sc, 32, [70, 1, 200], te.triton_extend)


def test_decode_reads_head_major_and_slot_major_caches_bitwise_the_same_gpu(kernels):
    """The kernels take strides: a slot-major copy of a head-major cache decodes to bitwise
    the same output (the interpreter test checks it within two bf16 ulps)."""
    _, _, td, _ = kernels
    sc = kc.build([13, 400, 3000], H=2, D=128, G=32, GV=128, S=16, W=64, page=64, seed=3, device="cuda",
                  scale_dtype=torch.float8_e4m3fn)
    q = kc.random_q(sc, 8, seed=5)
    lens = torch.tensor(sc.lens, dtype=torch.int32, device="cuda")
    outs = [td.triton_decode(q, layer, sc.index, sc.rotation, sc.req_to_token, sc.rows, lens, sc.sm_scale)
            for layer in (sc.layer, kh.slot_major(sc.layer))]
    assert torch.equal(outs[0], outs[1])


def test_split_group_sizes_gpu(kernels):
    """Keys at 32 and values at 128 with float8 (scale, min), the per-tensor layout: store,
    decode (also at 128k) and extend against the reference."""
    _, ts, td, te = kernels
    kw = dict(H=8, D=128, G=32, GV=128, S=16, W=64, page=64, scale_dtype=torch.float8_e4m3fn)
    sc = kc.build([211, 90, 65], fill=False, seed=2, device="cuda", **kw)
    kh.check_store(sc, [210, 3, 0], ts.triton_store)
    sc = kc.build([5, 900, 3000], seed=3, device="cuda", **kw)
    kh.check_decode(sc, 32, td.triton_decode)
    sc = kc.build([0, 130, 700], seed=4, device="cuda", **kw)
    kh.check_extend(sc, 32, [70, 1, 200], te.triton_extend)
    lens = [131072, 4096, 1]
    sc = kc.build_random(lens, seed=5, **{**kw, "W": 128})
    q = kc.random_q(sc, 32, seed=4)
    out = td.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                           torch.tensor(lens, dtype=torch.int32, device="cuda"), sc.sm_scale)
    assert torch.isfinite(out.float()).all()
    _check_subset(sc, 32, out, q, [0, 1, 2], [0, 5])


@pytest.mark.parametrize("scale_reads", ["words", "int16_pairs"])
def test_default_layout_pipelines_gpu(kernels, monkeypatch, scale_reads):
    """The default layout (keys 32 / values 128, float8) at batch 6 and 3 (3 stages, int64
    offsets) and batch 1 (2 stages, int32): short, medium and 128k requests against the
    reference; float8 (scale, min) pairs read as int32 words, and as int16 pairs where no
    word view exists."""
    from oscar_kernels import triton_common
    _, _, td, _ = kernels
    if scale_reads == "int16_pairs":
        monkeypatch.setattr(triton_common, "float8_words_view", lambda scales: None)
    kw = dict(H=8, D=128, G=32, GV=128, S=16, W=64, page=64, scale_dtype=torch.float8_e4m3fn)
    sc = kc.build([5, 80, 81, 144, 900, 3000], seed=3, device="cuda", **kw)
    kh.check_decode(sc, 32, td.triton_decode)
    lens = [131072, 4096, 1]
    sc = kc.build_random(lens, seed=5, **{**kw, "W": 128})
    q = kc.random_q(sc, 32, seed=4)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = td.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows, seq, sc.sm_scale)
    _check_subset(sc, 32, out, q, [0, 1, 2], [0, 5])
    alone = td.triton_decode(q[:1], sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows[:1], seq[:1],
                             sc.sm_scale)
    torch.testing.assert_close(alone.float(), out[:1].float(), rtol=3e-2, atol=3e-2)


def test_extend_gpu_chunked_prefill_after_prefix_hit(kernels):
    _, _, _, te = kernels
    sc = kc.build([240, 300, 190], H=4, D=128, G=128, S=16, W=64, page=64, valid_from=[240, 100, 0],
                  evict_sink_of=(2,), seed=9, device="cuda")
    kh.check_extend(sc, 16, [50, 120, 0], te.triton_extend)


@pytest.mark.parametrize("prefix, new", [([0, 5, 130, 700], [70, 1, 200, 33]), ([240, 300, 190], [50, 120, 9])])
def test_extend_bf16_prefix_reads_gpu(kernels, prefix, new):
    """prefix_read="bf16" (our attention) and FlashInferExtend (FlashInfer's prefill) over
    the materialised prefix, against the reference; the second batch has a late ring and
    an evicted sink."""
    import functools

    _, _, _, te = kernels
    extra = dict(valid_from=[240, 100, 0], evict_sink_of=(2,)) if len(prefix) == 3 else {}
    sc = kc.build(prefix, H=8, D=128, G=128, S=16, W=64, page=64, seed=11, device="cuda", **extra)
    kh.check_extend(sc, 32, new, functools.partial(te.triton_extend, prefix_lens_host=prefix),
                    "bf16")
    pytest.importorskip("flashinfer")
    from oscar_kernels.flashinfer_extend import FlashInferExtend

    fi = FlashInferExtend("cuda")
    fi.plan(prefix, new, 32, 8, 128, sc.sm_scale)
    assert fi.fits and fi.has_prefix == (sum(prefix) > 0)

    def via_flashinfer(q, k_rot, v_rot, layer, index, rotation, r2t, rows, pre, qo, max_len, sm_scale,
                       prefix_read=None, key_debias=False):
        return fi.run(q, k_rot, v_rot, layer, index, rotation, r2t, rows, pre)
    kh.check_extend(sc, 32, new, via_flashinfer, key_debias=False)  # FlashInfer's prefill has no debias term


@pytest.mark.parametrize("prefix_read", ["int2", "bf16", "flashinfer"])
def test_hybrid_attention_end_to_end_gpu_vs_cpu_reference(kernels, prefix_read):
    sc = kc.build([400, 400, 400], H=4, D=128, G=128, S=16, W=64, page=64, fill=False, seed=13)
    steps = [130, 200, 1, 1, 1]
    want, lay_ref = kh.attention_session(sc, steps, 16)  # CPU tensors: the reference path
    got, lay_gpu = kh.attention_session(_gpu(sc), steps, 16, prefix_read=prefix_read)  # CUDA: Triton / FlashInfer
    kh.assert_layers_close(kc.layer_to(lay_gpu, "cpu"), lay_ref)
    for a, w in zip(got, want):
        torch.testing.assert_close(a.float().cpu(), w.float(), rtol=3e-2, atol=3e-2)


# ---------------------------------------------------------------- long contexts
def _check_subset(sc, hq, out, q, requests, heads):
    """Compare decode outputs of some requests and KV heads with the reference."""
    sub = kh.head_subset(sc, heads)
    gq = hq // sc.layer.num_kv_heads
    qh = torch.cat([torch.arange(h * gq, (h + 1) * gq) for h in heads]).cuda()
    part = kc.Scenario(sub.layer, sub.index, sub.rotation, sub.req_to_token, sc.rows[requests],
                       [sc.lens[i] for i in requests], sc.sm_scale)
    want = kh.decode_reference(part, q[requests][:, qh])
    torch.testing.assert_close(out[requests][:, qh].float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("lens", [
    [131072, 65536, 4096, 77, 1],
    "batch64",
    "one_split",  # 128k INT2 positions in one program: the longest accumulation
])
def test_decode_long_context(kernels, lens):
    _, _, td, _ = kernels
    cfg = None
    if lens == "batch64":
        g = torch.Generator().manual_seed(3)
        lens = [131072] * 8 + torch.randint(1, 131072, (56,), generator=g).tolist()
    elif lens == "one_split":
        lens, cfg = [131072, 1000, 1], td.DecodeConfig(max_splits=1)
    sc = kc.build_random(lens, H=8, D=128, G=128, S=16, W=128, page=64, seed=2)
    q = kc.random_q(sc, 32, seed=4)
    out = td.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                           torch.tensor(lens, dtype=torch.int32, device="cuda"), sc.sm_scale, config=cfg)
    assert torch.isfinite(out.float()).all()
    last = len(lens) - 1
    _check_subset(sc, 32, out, q, [0, 1, last], [0, 5])


def test_extend_long_prefix(kernels):
    _, _, _, te = kernels
    sc = kc.build_random([131072, 3000], H=8, D=128, G=32, S=16, W=128, page=64, seed=6)
    sub = kh.head_subset(sc, [3])
    part = kc.Scenario(sub.layer, sub.index, sub.rotation, sub.req_to_token, sc.rows, sc.lens, sc.sm_scale)
    # the reference on one KV head; the kernel on that head alone too (same math per head)
    kh.check_extend(part, 4, [256, 64], te.triton_extend)


# ---------------------------------------------------------------- CUDA graphs
def test_cuda_graph_store_and_decode(kernels):
    _, ts, td, _ = kernels
    from oscar_kernels import reference as ref
    lens0 = [1000, 3000, 50, 64]
    sc = kc.build_random([n + 8 for n in lens0], H=8, D=128, G=128, S=16, W=64, page=64, seed=8)
    b, hq, h, d = len(lens0), 32, 8, 128
    rows = sc.rows.long()
    ref_layer = kh.clone_layer(sc.layer)
    ws = td.DecodeWorkspace(b, hq, h, d, "cuda")
    n = torch.tensor(lens0, device="cuda")
    st = dict(q=torch.zeros(b, hq, d, dtype=torch.bfloat16, device="cuda"),
              k=torch.zeros(b, h, d, dtype=torch.bfloat16, device="cuda"),
              v=torch.zeros(b, h, d, dtype=torch.bfloat16, device="cuda"),
              pos=n.clone(), slots=sc.req_to_token[rows, n].long(), ends=n + 1, lens=(n + 1).int(),
              out=torch.zeros(b, hq, d, dtype=torch.bfloat16, device="cuda"))

    def step():
        ts.triton_store(sc.layer, sc.index, sc.rotation, sc.req_to_token, st["k"], st["v"], st["slots"],
                     st["pos"], rows, st["ends"])
        td.triton_decode(st["q"], sc.layer, sc.index, sc.rotation, sc.req_to_token, rows, st["lens"],
                         sc.sm_scale, out=st["out"], workspace=ws)

    gen = torch.Generator(device="cuda").manual_seed(1)

    def fill(step_idx):
        cur = n + step_idx
        for key in ("q", "k", "v"):
            st[key].copy_(torch.randn(st[key].shape, generator=gen, device="cuda").to(torch.bfloat16))
        st["pos"].copy_(cur)
        st["slots"].copy_(sc.req_to_token[rows, cur].long())
        st["ends"].copy_(cur + 1)
        st["lens"].copy_((cur + 1).int())

    # warm up (compiles) on a side stream, then undo nothing: the reference replays the same steps
    fill(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    ref.reference_store(ref_layer, sc.index, sc.rotation, sc.req_to_token, st["k"], st["v"], st["slots"],
                        st["pos"], rows, st["ends"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(1, 4):
        fill(i)
        graph.replay()
        ref.reference_store(ref_layer, sc.index, sc.rotation, sc.req_to_token, st["k"], st["v"],
                            st["slots"], st["pos"], rows, st["ends"])
        cur = kc.Scenario(ref_layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                          [int(x) for x in (n + i + 1).tolist()], sc.sm_scale)
        want = kh.decode_reference(cur, st["q"])
        torch.cuda.synchronize()
        torch.testing.assert_close(st["out"].float(), want, rtol=3e-2, atol=3e-2)
    kh.assert_layers_close(sc.layer, ref_layer)


# ---------------------------------------------------------------- start-up cost
@pytest.mark.parametrize("layout", [dict(G=128), dict(G=32, GV=128, scale_dtype=torch.float8_e4m3fn)])
def test_one_compilation_serves_every_batch_size(kernels, layout):
    """CUDA-graph capture runs decode and store at ~36 batch sizes; each kernel must compile
    once for all of them (a batch-dependent constexpr cost ~3 s per size at server start)."""
    _, ts, td, _ = kernels

    def variants(fn):
        return sum(len(caches[0]) for caches in fn.device_caches.values())

    watched = (td._decode_stage1, td._decode_merge_row, td._decode_merge_split, ts._store_kernel)
    before = {fn: variants(fn) for fn in watched}
    h, hq, d = 2, 4, 128
    ws = td.DecodeWorkspace(64, hq, h, d, "cuda")
    for b in (1, 3, 8, 17, 64):
        lens = [700 + 37 * i for i in range(b)]
        sc = kc.build_random(lens, H=h, D=d, S=16, W=128, page=64, seed=b, **layout)
        q = kc.random_q(sc, hq, seed=b)
        td.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                         torch.tensor(lens, dtype=torch.int32, device="cuda"), sc.sm_scale, workspace=ws)
        rows = sc.rows.long()
        pos = torch.tensor(lens, device="cuda") - 1
        kv = torch.randn(b, h, d, dtype=torch.bfloat16, device="cuda")
        ts.triton_store(sc.layer, sc.index, sc.rotation, sc.req_to_token, kv, kv, sc.req_to_token[rows, pos].long(),
                     pos, rows, pos + 1)
    torch.cuda.synchronize()
    added = {fn.__name__: variants(fn) - n for fn, n in before.items()}
    # stage 1 compiles once per entry of its layout class's table (DecodeConfig.stage1_tiles:
    # G = D, one up to 4 requests and one above; keys 32, one at batch 1 and one above), the
    # others once
    spans = layout["G"] == d
    shapes = len({ws.config.stage1_tiles(b, spans) for b in (1, 3, 8, 17, 64)})
    assert shapes == 2
    allowed = {"_decode_stage1": shapes, "_decode_merge_row": 1, "_decode_merge_split": 1, "_store_kernel": 1}
    assert all(v <= allowed[k] for k, v in added.items()), (added, allowed)


# ---------------------------------------------------------------- deterministic inference
def test_kernels_are_batch_invariant(kernels):
    """--enable-deterministic-inference: store, decode (batch_invariant_config, CUDA-graph
    style padding rows) and INT2 extend give a request bitwise the same result alone and in
    a batch of others, with the compiled kernels (the interpreter's dots are numpy's)."""
    _, ts, td, te = kernels
    h, hq, d = 2, 4, 128
    lens = [700, 3000, 9000, 150, 4100, 64, 12000, 2000]
    sc = kc.build_random(lens, H=h, D=d, G=128, S=16, W=128, page=64, seed=5)
    cfg = td.batch_invariant_config(16384, 64, hq, d)
    ws = td.DecodeWorkspace(64, hq, h, d, "cuda", cfg)
    q = kc.random_q(sc, hq, seed=5)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    args = (sc.layer, sc.index, sc.rotation, sc.req_to_token)
    pad = 5  # the graph runner's padding: row 0, length 1
    rows_p = torch.cat([sc.rows, torch.zeros(pad, dtype=sc.rows.dtype, device="cuda")])
    seq_p = torch.cat([seq, torch.ones(pad, dtype=seq.dtype, device="cuda")])
    q_p = torch.cat([q, torch.zeros(pad, hq, d, dtype=q.dtype, device="cuda")])
    batched = td.triton_decode(q_p, *args, rows_p, seq_p, sc.sm_scale, workspace=ws).clone()
    for i in range(len(lens)):
        alone = td.triton_decode(q[i:i + 1], *args, sc.rows[i:i + 1], seq[i:i + 1], sc.sm_scale, workspace=ws)
        assert torch.equal(alone[0], batched[i]), f"decode: request {i} changed with the batch"

    sc = kc.build([211, 90, 65, 128], H=h, D=d, G=128, S=16, W=64, page=64, fill=False, seed=6, device="cuda")
    starts = [190, 3, 0, 0]
    k, v, slots, pos, rows, ends = kh.store_batch(sc, starts)
    together, apart = kh.clone_layer(sc.layer), kh.clone_layer(sc.layer)
    ts.triton_store(together, sc.index, sc.rotation, sc.req_to_token, k, v, slots, pos, rows, ends)
    cut = 0
    for s0, n in zip(starts, sc.lens):
        seg = slice(cut, cut + n - s0)
        cut = seg.stop
        ts.triton_store(apart, sc.index, sc.rotation, sc.req_to_token, k[seg], v[seg], slots[seg], pos[seg],
                        rows[seg], ends[seg])
    for f in together.__dataclass_fields__:
        a, b = getattr(together, f), getattr(apart, f)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"store: {f} differs"

    prefix, new = [0, 700, 3000, 130], [1024, 300, 77, 1]
    sc = kc.build(prefix, H=h, D=d, G=128, S=16, W=64, page=64, seed=7, device="cuda")
    g = torch.Generator().manual_seed(7)
    t = sum(new)
    qx = (torch.randn(t, hq, d, generator=g) * 2).bfloat16().cuda()
    k_rot = torch.randn(t, h, d, generator=g).bfloat16().cuda()
    v_rot = torch.randn(t, h, d, generator=g).bfloat16().cuda()
    qo = torch.tensor([0] + new).cumsum(0).to(torch.int32).cuda()
    pre = torch.tensor(prefix, dtype=torch.int32, device="cuda")
    ext = (sc.layer, sc.index, sc.rotation, sc.req_to_token)
    batched = te.triton_extend(qx, k_rot, v_rot, *ext, sc.rows, pre, qo, max(new), sc.sm_scale).clone()
    for i, n in enumerate(new):
        seg = slice(int(qo[i]), int(qo[i + 1]))
        one = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        alone = te.triton_extend(qx[seg], k_rot[seg], v_rot[seg], *ext, sc.rows[i:i + 1], pre[i:i + 1], one, n,
                                 sc.sm_scale)
        assert torch.equal(alone, batched[seg]), f"extend: request {i} changed with the batch"


# ---------------------------------------------------------------- programmatic dependent launch
@pytest.mark.parametrize("lens", [[20000], [3000, 3037, 3074], [5000 + 37 * i for i in range(8)]])
def test_programmatic_launch_gives_the_same_output(kernels, lens, monkeypatch):
    """Stage 1, the merge and the un-rotation launched with PDL (sm_90+) give bitwise the
    output of plain launches (what older GPUs run), eagerly and replayed from a CUDA graph,
    close to the reference (batch 1 runs the split merge and its un-rotation launch, batch 8
    the query_head merge)."""
    _, _, td, _ = kernels
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    sc = kc.build_random(lens, H=8, D=128, G=32, GV=128, S=16, W=64, page=64,
                         scale_dtype=torch.float8_e4m3fn, seed=len(lens))
    b = len(lens)
    q = kc.random_q(sc, 32)
    seq = torch.tensor(sc.lens, dtype=torch.int32, device="cuda")
    want = kh.decode_reference(sc, q)
    outs = {}
    for pdl in (True, False):
        monkeypatch.setattr(td, "pdl_supported", lambda device, pdl=pdl: pdl)
        ws = td.DecodeWorkspace(b, 32, 8, 128, "cuda")
        out = torch.empty_like(q)

        def run():
            td.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows, seq, sc.sm_scale,
                             out=out, workspace=ws)
        run()
        torch.cuda.synchronize()
        eager = out.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        out.zero_()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"pdl={pdl}: graph replay differs from the eager launch"
        torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)
        outs[pdl] = out.clone()
    assert torch.equal(outs[True], outs[False])
