"""Triton kernels vs their PyTorch reference under TRITON_INTERPRET=1 (CPU, small shapes)."""
import contextlib
import functools
import itertools
from dataclasses import replace
import importlib
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: run this file alone with TRITON_INTERPRET=1 (interpreted kernels)",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from oscar_kernels import testing as kc  # noqa: E402
import kernel_helpers as kh  # noqa: E402
from oscar_kernels import reference as ref  # noqa: E402

_, _, triton_store_mod, triton_decode_mod, triton_materialize_mod, triton_extend_mod = kh.interpreted_kernel_modules()

# The interpreter's tl.dot runs on numpy, whose rounding can depend on shapes, alignment and
# the CPU: bitwise properties are asserted on the GPU (test_kernels_gpu.py); here, the launch
# plan and outputs equal within two bf16 ulps.
_INTERP_RTOL, _INTERP_ATOL = 2 ** -7, 1e-3


@contextlib.contextmanager
def _recorded_launches(monkeypatch, module, *names):
    """Record (kernel name, grid, keyword arguments) of every launch of ``module``'s kernels."""
    seen = []

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((self.name, tuple(grid), kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    with monkeypatch.context() as m:
        for name in names:
            m.setattr(module, name, Recorder(name, getattr(module, name)))
        yield seen


def _same_plan(alone, batched, batch_axis):
    """Each kernel launched with the same keyword arguments and the same grid off the batch
    axis, alone and in the batch (the batch axis is 1 alone)."""
    assert [n for n, _, _ in alone] == [n for n, _, _ in batched]
    for (name, ga, ka), (_, gb, kb) in zip(alone, batched):
        assert ka == kb, f"{name}: launch parameters changed with the batch"
        axis = batch_axis[name]
        if axis is not None:
            assert ga[axis] == 1 and ga[:axis] + ga[axis + 1:] == gb[:axis] + gb[axis + 1:], (name, ga, gb)


# ---------------------------------------------------------------- store
@pytest.mark.parametrize("cfg", [
    dict(D=64, G=16, S=4, W=8, page=8),
    dict(D=64, G=64, S=0, W=8, page=8),
    dict(D=128, G=32, S=4, W=0, page=4),
    dict(D=128, G=8, S=2, W=16, page=16),
])
@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True)])
def test_store_matches_reference(cfg, flags):
    lens = [21, 9, 5, 12]
    starts = [20, 3, 0, 0]  # decode token, extend chunk, two new sequences (sinks)
    sc = kc.build(lens, H=2, fill=False, no_sink=(3,), seed=1, **cfg)
    got = kh.check_store(sc, starts, triton_store_mod.triton_store, *flags)
    if flags[0] and cfg["S"]:
        assert got.k_sink.abs().sum() > 0  # sinks were written for the new sequences
    if flags[1] and cfg["W"]:
        assert got.k_ring.abs().sum() > 0


# ---------------------------------------------------------------- decode
# several INT2 splits per request at these small lengths (the launch shapes are the tuned ones)
_SMALL = dict(min_chunk=16, target_programs=64, max_splits=4)


def _check_decode(sc, hq, config):
    kh.check_decode(sc, hq, triton_decode_mod.triton_decode, config)


@pytest.mark.parametrize("case", [
    # (D, G, Hq, H, S, W, page)
    (64, 16, 4, 2, 4, 8, 8),
    (64, 64, 2, 2, 4, 8, 8),
    (128, 32, 8, 1, 2, 16, 4),
    (128, 8, 8, 2, 4, 8, 8),
    (64, 4, 4, 2, 0, 8, 8),
    (64, 16, 16, 2, 4, 0, 8),
    (64, 32, 4, 1, 0, 0, 8),
])
def test_decode_matches_reference(case):
    """Five requests: the large-batch tiles and the query-head merge."""
    d, grp, hq, h, s, w, page = case
    lens = [1, 3, 13, 40, 77]  # shorter than S+W, page boundaries, several splits
    sc = kc.build(lens, H=h, D=d, G=grp, S=s, W=w, page=page, seed=d + grp + hq)
    _check_decode(sc, hq, triton_decode_mod.DecodeConfig(**_SMALL))


@pytest.mark.parametrize("hq, h, grp", [(8, 1, 16), (2, 2, 64), (16, 2, 16), (4, 2, 64)])
def test_decode_small_batch_matches_reference(hq, h, grp):
    """Three requests: the small-batch tiles (128-token steps where groups span the head) and
    the split merge with its un-rotation launch."""
    sc = kc.build([1, 13, 140], H=h, D=64, G=grp, S=4, W=8, page=8, seed=hq + h)
    _check_decode(sc, hq, triton_decode_mod.DecodeConfig(**_SMALL))


@pytest.mark.parametrize("grp", [16, 64])  # G >= D/4 (group pairs) and G = D
def test_float8_scales_store_decode_extend_match_reference(grp):
    """float8_e4m3fn (scale, min): groups of 64 at the bytes of float16 groups of 128."""
    f8 = torch.float8_e4m3fn
    sc = kc.build([21, 9, 5], H=2, D=64, G=grp, S=4, W=8, page=8, fill=False, seed=4, scale_dtype=f8)
    kh.check_store(sc, [20, 3, 0], triton_store_mod.triton_store, True, True)
    sc = kc.build([1, 13, 77], H=2, D=64, G=grp, S=4, W=8, page=8, seed=5, scale_dtype=f8)
    _check_decode(sc, 4, triton_decode_mod.DecodeConfig(**_SMALL))
    sc = kc.build([0, 13, 40], H=2, D=64, G=grp, S=4, W=8, page=8, seed=6, scale_dtype=f8)
    kh.check_extend(sc, 4, [7, 1, 9], triton_extend_mod.triton_extend, "int2")


def test_int2_buffers_are_head_major_and_decode_reads_either_order():
    """allocate_layer stores codes and scales head-major ([H, slots, ...] under [slots, H,
    ...] views; the test scenarios keep that order); the kernels take strides, so a
    slot-major copy of the same cache decodes to the same output (bitwise on the GPU)."""
    f8 = torch.float8_e4m3fn
    sc = kc.build([13, 40, 77], H=2, D=128, G=32, GV=128, S=4, W=8, page=8, seed=3, scale_dtype=f8)
    hm = sc.layer
    slots, q = hm.k_packed.shape[0], hm.k_packed.shape[2]
    assert hm.k_packed.stride() == hm.v_packed.stride() == (q, slots * q, 1)
    assert hm.k_scales.stride() == hm.v_scales.stride() == (10, slots * 10, 2, 1)  # 4 + 1 float8 pairs
    slot_major = kh.slot_major(hm)
    assert slot_major.k_packed.stride(0) == 2 * q and slot_major.k_scales.stride(0) == 20
    q_rows = torch.randn(3, 4, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    lens = torch.tensor(sc.lens, dtype=torch.int32)
    cfg = triton_decode_mod.DecodeConfig(**_SMALL)
    outs = [triton_decode_mod.triton_decode(q_rows, layer, sc.index, sc.rotation, sc.req_to_token, sc.rows, lens,
                                            sc.sm_scale, config=cfg) for layer in (hm, slot_major)]
    torch.testing.assert_close(outs[0], outs[1], rtol=_INTERP_RTOL, atol=_INTERP_ATOL)


def test_int64_offsets_follow_the_buffers_extent():
    """Slot and head offsets switch to int64 once any INT2 buffer reaches 2^31 bytes from its
    first element (head-major: the last head's offset is most of the buffer)."""
    from oscar_kernels.hybrid_cache import allocate_layer
    from oscar_kernels.triton_common import element_extent, needs_int64_slots
    per_slot = 8 * 32  # 8 heads x 32 bytes of codes (head_dim 128)
    below = allocate_layer(2 ** 31 // per_slot - 1, 8, 128, 32, 16, 64, 2, 2, torch.float8_e4m3fn, "meta",
                           value_group_size=128)
    at = allocate_layer(2 ** 31 // per_slot, 8, 128, 32, 16, 64, 2, 2, torch.float8_e4m3fn, "meta",
                        value_group_size=128)
    assert element_extent(below.k_packed) == below.k_packed.numel() < 2 ** 31
    assert not needs_int64_slots(below) and needs_int64_slots(at)
    assert element_extent(torch.empty(0)) == 0


def test_float8_words_view_addresses_every_pair_or_declines():
    """float8 (scale, min) pairs read as int32 words: pair i of the view is in word i >> 1,
    bits 16 (i & 1) up; a view that starts or a storage that ends off a 4-byte boundary
    gets no word view (the kernels then read int16 pairs)."""
    from oscar_kernels.triton_common import float8_words_view
    full = torch.arange(40, dtype=torch.int16).view(torch.float8_e4m3fn).view(2, 2, 10, 2)  # [slot, head, pair]
    for start in (0, 4):  # pair offsets 0 and 4 within each (slot, head) record
        view = full[:, :, start:start + 4]
        words = float8_words_view(view)
        assert words is not None
        pairs = view.view(torch.int16)
        for slot, head, g in itertools.product(range(2), range(2), range(4)):
            i = slot * pairs.stride(0) + head * pairs.stride(1) + g
            got = (int(words[i >> 1]) >> (16 * (i & 1))) & 0xFFFF
            assert got == int(pairs[slot, head, g]) & 0xFFFF
    assert float8_words_view(full[:, :, 1:5]) is None  # starts 2 bytes into a word
    assert float8_words_view(torch.zeros(3, 2, dtype=torch.float8_e4m3fn)) is None  # 6 bytes: ends mid-word


def test_float8_pairs_decode_without_a_word_view(monkeypatch):
    """Where no int32 word view exists (float8_words_view declines) the kernels read each
    float8 (scale, min) pair as one int16: the same output."""
    common = importlib.import_module("oscar_kernels.triton_common")
    sc = kc.build([1, 13, 77], H=2, D=64, G=16, S=4, W=8, page=8, seed=5, scale_dtype=torch.float8_e4m3fn)
    assert common.group_scale_args(sc.layer)[0].dtype == torch.int32
    monkeypatch.setattr(common, "float8_words_view", lambda scales: None)
    assert common.group_scale_args(sc.layer)[0].dtype == torch.int16
    _check_decode(sc, 4, triton_decode_mod.DecodeConfig(**_SMALL))


@pytest.mark.parametrize("gk,gv,dt", [
    (16, 64, torch.float8_e4m3fn),  # keys a group per plane, values one group (the split layout)
    (64, 16, torch.float16),  # the other way round
    (8, 64, torch.float16),  # keys dequantised per channel (G < D/4), values grouped
])
def test_split_group_sizes_store_decode_extend_materialize_match_reference(gk, gv, dt):
    """Keys and values at their own group sizes (one scales tensor, two views)."""
    kw = dict(H=2, D=64, G=gk, GV=gv, S=4, W=8, page=8, scale_dtype=dt)
    sc = kc.build([21, 9, 5], fill=False, seed=4, **kw)
    assert (sc.layer.key_group_size, sc.layer.value_group_size) == (gk, gv)
    kh.check_store(sc, [20, 3, 0], triton_store_mod.triton_store, True, True)
    sc = kc.build([1, 13, 77], seed=5, **kw)
    _check_decode(sc, 4, triton_decode_mod.DecodeConfig(**_SMALL))
    sc = kc.build([0, 13, 40], seed=6, **kw)
    kh.check_extend(sc, 4, [7, 1, 9], triton_extend_mod.triton_extend, "int2")
    lens = [0, 13, 40]
    pre = torch.tensor(lens, dtype=torch.int32)
    want = ref.reference_materialize_prefix(sc.layer, sc.index, sc.req_to_token, sc.rows, pre)
    got = triton_materialize_mod.triton_materialize_prefix(sc.layer, sc.index, sc.req_to_token, sc.rows, pre,
                                                           lens)
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g.float(), w_.float(), rtol=2 ** -7, atol=1e-6)


def test_kernels_refuse_other_scale_dtypes():
    sc = kc.build([9, 20], H=2, D=64, G=16, S=4, W=8, page=8, seed=3, scale_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="scales, not torch.float8_e5m2"):
        _check_decode(sc, 4, triton_decode_mod.DecodeConfig(**_SMALL))


def test_decode_invalid_sink_and_late_ring_start():
    lens = [30, 45, 12]
    # request 0's sink slot evicted -> INT2; ring valid only from 40 / 11 for requests 1 / 2
    sc = kc.build(lens, H=2, D=64, G=16, S=4, W=8, page=8, evict_sink_of=(0,), no_sink=(2,),
                  valid_from=[0, 40, 11], seed=5)
    _check_decode(sc, 4, triton_decode_mod.DecodeConfig(**_SMALL))


@pytest.mark.parametrize("variant", ["one_split", "int64_slots"])
def test_decode_one_split_and_int64_offsets(variant, monkeypatch):
    sc = kc.build([9, 50], H=2, D=64, G=16, S=4, W=8, page=8, seed=11)
    cfg = {**_SMALL, "max_splits": 1} if variant == "one_split" else _SMALL
    if variant == "int64_slots":  # the path of caches with 2^31 or more elements per buffer
        monkeypatch.setattr(triton_decode_mod, "needs_int64_slots", lambda layer: True)
    _check_decode(sc, 4, triton_decode_mod.DecodeConfig(**cfg))


@pytest.mark.parametrize("layout", [dict(D=64, G=16), dict(D=64, G=64), dict(D=64, G=8), dict(D=128, G=32, GV=128)])
@pytest.mark.parametrize("max_splits", [1, 3])
@pytest.mark.parametrize("lens", [
    [12, 13, 44, 76, 140, 160],  # S + W = 12: INT2 lengths 0, 1, 32, 64, 128, 148 (64-token steps)
    [13, 140, 268, 290],  # 1, 128, 256, 278: 128-token steps where groups span the head
], ids=["large_batch", "small_batch"])
def test_decode_int2_loop_matches_reference(layout, max_splits, lens):
    """The INT2 loop (each block's slots loaded a step ahead) over INT2 ranges that are
    empty, one partial block, exactly one / two full blocks, full blocks then a tail."""
    sc = kc.build(lens, H=2, S=4, W=8, page=8, seed=23, **layout)
    _check_decode(sc, 4, triton_decode_mod.DecodeConfig(**{**_SMALL, "max_splits": max_splits}))


def test_rotate_queries_column_blocks_match_the_full_rotation():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 8, 64, generator=g).bfloat16()
    rot = torch.randn(2, 64, 64, generator=g)
    for transpose in (False, True):
        r = rot.transpose(-1, -2) if transpose else rot
        want = torch.einsum("thc,hce->the", q.float(), r.repeat_interleave(4, 0))
        for block in (0, 16, 32):
            got = triton_decode_mod.rotate_queries(q, rot, torch.empty(3, 8, 64), transpose=transpose,
                                                   out_block=block)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="out_block"):
        triton_decode_mod.rotate_queries(q, rot, torch.empty(3, 8, 64), out_block=24)


@pytest.mark.parametrize("hq, tokens", [(8, 4), (6, 4), (4, 16)])  # 6: padded head rows
def test_rotate_token_blocks_match_the_full_rotation(hq, tokens):
    """Several tokens per program (extend), token counts not a multiple of the block."""
    g = torch.Generator().manual_seed(hq)
    q = torch.randn(tokens + 3, hq, 64, generator=g).bfloat16()
    rot = torch.randn(2, 64, 64, generator=g)
    for transpose in (False, True):
        r = rot.transpose(-1, -2) if transpose else rot
        want = torch.einsum("thc,hce->the", q.float(), r.repeat_interleave(hq // 2, 0))
        got = triton_decode_mod.rotate_queries(q, rot, torch.full((tokens + 3, hq, 64), float("nan")),
                                               transpose=transpose, tokens_per_program=tokens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        got = triton_decode_mod.rotate_tokens(q, rot, torch.full((tokens + 3, hq, 64), float("nan")),
                                              transpose=transpose)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="power of two"):
        triton_decode_mod.rotate_queries(q, rot, torch.empty(tokens + 3, hq, 64), tokens_per_program=3)


def test_programmatic_launch_needs_a_cuda_device():
    """PDL launch attributes are only set for CUDA devices of compute capability 9.0+, never
    in the interpreter (the kernels' griddepcontrol calls are then compiled out)."""
    from oscar_kernels import triton_common
    assert not triton_common.pdl_supported("cpu")


def test_stage1_tiles_follow_the_layout_class_and_the_batch():
    """One tuned table per layout class: groups spanning the head run 128-token steps uncapped
    up to 4 requests, then 64 under the 168-register cap (BF16 steps 64, then 16); smaller
    groups run uncapped 64-token steps, 2 stages with int32 offsets at batch 1 and 3 stages
    with int64 above. A batch-invariant config runs the large-batch tiles at every batch."""
    td = triton_decode_mod
    cfg = td.DecodeConfig()
    shape = [(t.block_n, t.max_registers, t.block_n_bf16) for t in (cfg.stage1_tiles(b) for b in (1, 4, 5, 64))]
    assert shape == [(128, None, 64), (128, None, 64), (64, 168, 16), (64, 168, 16)]
    assert [cfg.resident_per_sm(b) for b in (1, 64)] == [8, 12]  # 232 registers uncapped, 168 capped
    split = [cfg.stage1_tiles(b, groups_span_head=False) for b in (1, 2, 64)]
    assert [(t.block_n, t.max_registers, t.num_stages, t.int64_slots) for t in split] == [
        (64, None, 2, False), (64, None, 3, True), (64, None, 3, True)]
    assert cfg.resident_per_sm(64, groups_span_head=False) == 8
    inv = td.batch_invariant_config(4096, 8, 4, 128)
    for span in (True, False):
        assert {inv.stage1_tiles(b, span) for b in (1, 2, 64)} == {cfg.stage1_tiles(64, span)}
    sc = kc.build([40, 300], H=2, D=64, G=64, S=4, W=8, page=8, seed=21)
    small = dict(min_chunk=16, target_programs=8, max_splits=4)
    for c in (td.DecodeConfig(**small), replace(td.DecodeConfig(**small), batch_invariant=True)):
        _check_decode(sc, 4, c)  # batch 2: 128-token steps, then the large-batch tiles


def test_batch_invariant_decode_plans_a_request_the_same_alone_and_batched(monkeypatch):
    """batch_invariant_config (deterministic inference): a request is decoded with the same
    launches alone and in a batch (bitwise the same output: test_kernels_gpu.py); the default
    config changes its split count with the batch."""
    td = triton_decode_mod
    assert td.DecodeConfig().splits_for(1, 2, "cpu") != td.DecodeConfig().splits_for(3, 2, "cpu")
    per_row = 3 * 4 * (64 + 1) * 4
    cfg = td.batch_invariant_config(512, 3, 4, 64, workspace_bytes=per_row * 5, base=td.DecodeConfig(min_chunk=16))
    assert [cfg.splits_for(b, 2, "cpu") for b in (1, 3)] == [4, 4] and cfg.min_chunk == 128
    assert cfg.stage1_tiles(1) == cfg.stage1_tiles(3) and cfg.merge_grid_for(1) == cfg.merge_grid_for(3)
    sc = kc.build([5, 300, 77], H=2, D=64, G=64, S=4, W=8, page=8, seed=31)
    kh.check_decode(sc, 4, td.triton_decode, cfg)
    q = kc.random_q(sc, 4)
    lens = torch.tensor(sc.lens, dtype=torch.int32)
    args = (sc.layer, sc.index, sc.rotation, sc.req_to_token)
    kernels = ("_decode_stage1", "_decode_merge_row", "_decode_merge_split")
    axes = dict.fromkeys(kernels, 0)  # grid axis 0: the requests

    def decode(i, j, config):
        with _recorded_launches(monkeypatch, td, *kernels) as seen:
            out = td.triton_decode(q[i:j], *args, sc.rows[i:j], lens[i:j], sc.sm_scale, config=config)
        return out, seen

    batched, batched_plan = decode(0, 3, cfg)
    assert batched_plan[0][0] == "_decode_stage1" and len(batched_plan) == 2
    for i in range(3):
        alone, alone_plan = decode(i, i + 1, cfg)
        _same_plan(alone_plan, batched_plan, axes)
        torch.testing.assert_close(alone[0], batched[i], rtol=_INTERP_RTOL, atol=_INTERP_ATOL,
                                   msg=lambda m, i=i: f"request {i} changed with the batch: {m}")
    # the check has teeth: with the default splits (8 alone, 2 in this batch) the plan moves
    default = td.DecodeConfig(min_chunk=16)
    with pytest.raises(AssertionError):
        _same_plan(decode(1, 2, default)[1], decode(0, 3, default)[1], axes)


def test_merge_splits_small_batches_only():
    """The split merge up to 4 requests, the query-head merge above (and at every batch when
    batch-invariant); one workspace serves both, its o' buffer sized for the split batches."""
    td = triton_decode_mod
    cfg = td.DecodeConfig(**_SMALL)
    assert [cfg.merge_grid_for(b) for b in (1, 4, 5, 64)] == ["split", "split", "query_head", "query_head"]
    assert {replace(cfg, batch_invariant=True).merge_grid_for(b) for b in (1, 4, 64)} == {"query_head"}
    ws = td.DecodeWorkspace(6, 4, 2, 64, "cpu", cfg)
    assert ws.o_rot.numel() == 4 * 4 * 64  # the o' buffer only for the batches that split
    for lens in ([9, 50], [3, 17, 40, 5, 9]):  # one batch through each merge, one workspace
        sc = kc.build(lens, H=2, D=64, G=16, S=4, W=8, page=8, seed=len(lens))
        q = kc.random_q(sc, 4)
        got = td.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                               torch.tensor(lens, dtype=torch.int32), sc.sm_scale, workspace=ws)
        kh.assert_attention_close(got, kh.decode_reference(sc, q))


def test_large_batches_rotate_in_row_blocks():
    """From block_rotation_min_batch requests on, q' and o' are rotated in row blocks (the merge
    leaves o' un-rotated in the workspace): same outputs as the reference, below the threshold
    the per-row rotations, and never when batch-invariant (one shape at every batch)."""
    td = triton_decode_mod
    cfg = td.DecodeConfig(**_SMALL, block_rotation_min_batch=6)
    assert [cfg.block_rotation(b) for b in (1, 5, 6, 64)] == [False, False, True, True]
    assert not replace(cfg, batch_invariant=True).block_rotation(64)
    ws = td.DecodeWorkspace(7, 8, 2, 64, "cpu", cfg)
    assert ws.o_rot.numel() == 7 * 8 * 64  # o' rows for the largest batch
    lens = [9, 50, 3, 17, 40, 5, 30]
    sc = kc.build(lens, H=2, D=64, G=16, S=4, W=8, page=8, seed=21)
    q = kc.random_q(sc, 8)
    launch = ws.launch(len(lens), False)
    assert launch.block_rotation and not launch.split_merge
    got = td.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                           torch.tensor(lens, dtype=torch.int32), sc.sm_scale, launch=launch)
    kh.assert_attention_close(got, kh.decode_reference(sc, q))


def test_decode_workspace_reuse_and_out():
    sc = kc.build([20, 33], H=2, D=64, G=16, S=4, W=8, page=8, seed=12)
    cfg = triton_decode_mod.DecodeConfig(**_SMALL)
    ws = triton_decode_mod.DecodeWorkspace(4, 4, 2, 64, "cpu", cfg)
    q = kc.random_q(sc, 4)
    out = torch.empty(2, 4, 64, dtype=torch.bfloat16)
    lens = torch.tensor(sc.lens, dtype=torch.int32)
    r = triton_decode_mod.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                                        lens, sc.sm_scale, out=out, workspace=ws)
    assert r is out
    kh.assert_attention_close(out, kh.decode_reference(sc, q))
    with pytest.raises(ValueError, match="max_batch"):
        triton_decode_mod.triton_decode(torch.randn(5, 4, 64).bfloat16(), sc.layer, sc.index, sc.rotation,
                                        sc.req_to_token, torch.zeros(5, dtype=torch.int32),
                                        torch.ones(5, dtype=torch.int32), 1.0, workspace=ws)


# ---------------------------------------------------------------- learned sinks (gpt-oss)
def _sinks(hq, seed):
    """Sink logits around the scores' scale, one far above them (the head attends to almost
    nothing) and one far below (no effect)."""
    s = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2
    s[0], s[-1] = 30.0, -30.0
    return s.bfloat16()  # SGLang's gpt-oss keeps them in bf16


@pytest.mark.parametrize("lens", [[1, 13, 140], [1, 3, 13, 40, 77]])  # split merge, query-head merge
def test_decode_with_learned_sinks_matches_reference(lens):
    sc = kc.build(lens, H=2, D=64, G=16, S=4, W=8, page=8, seed=len(lens))
    kh.check_decode(sc, 8, triton_decode_mod.triton_decode, triton_decode_mod.DecodeConfig(**_SMALL),
                    sinks=_sinks(8, 1))


@pytest.mark.parametrize("prefix_read", ["int2", "bf16"])
def test_extend_with_learned_sinks_matches_reference(prefix_read):
    sc = kc.build([0, 5, 13, 90], H=2, D=64, G=16, S=4, W=8, page=8, seed=11)
    fn = functools.partial(triton_extend_mod.triton_extend, prefix_lens_host=[0, 5, 13, 90])
    kh.check_extend(sc, 8, [7, 1, 70, 9], fn, prefix_read, sinks=_sinks(8, 2))


def test_kernels_refuse_sinks_of_another_shape():
    sc = kc.build([9, 4], H=2, D=64, G=16, S=4, W=8, page=8, seed=2)
    q, lens = kh.random_q(sc, 4, 0), torch.tensor(sc.lens, dtype=torch.int32)
    with pytest.raises(ValueError, match="one logit per query head"):
        triton_decode_mod.triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows, lens,
                                        sc.sm_scale, sinks=torch.zeros(2))


# ---------------------------------------------------------------- extend
@pytest.mark.parametrize("case", [
    # (D, G, Hq, H, S, W, page)
    (64, 16, 4, 2, 4, 8, 8),
    (64, 4, 2, 2, 0, 8, 8),
    (128, 32, 8, 2, 2, 0, 4),
    (64, 64, 16, 2, 4, 16, 8),
])
def test_extend_matches_reference(case):
    d, grp, hq, h, s, w, page = case
    prefix = [0, 5, 13, 90]  # empty prefix, shorter than S+W, several pages and INT2 blocks
    new = [7, 1, 70, 9]  # one request longer than a block of rows
    sc = kc.build(prefix, H=h, D=d, G=grp, S=s, W=w, page=page, seed=d + hq)
    kh.check_extend(sc, hq, new, triton_extend_mod.triton_extend, "int2")


# ---------------------------------------------------------------- BF16-materialised prefix
@pytest.mark.parametrize("case", [
    # (D, G, S, W, page, scale dtype, valid_from, evicted sink of, no sink for)
    (64, 16, 4, 8, 8, torch.float16, None, (), ()),
    (64, 64, 0, 8, 8, torch.float16, None, (), ()),
    (128, 8, 2, 0, 4, torch.bfloat16, None, (), ()),
    (64, 16, 4, 8, 8, torch.float8_e4m3fn, [24, 10, 0, 0], (2,), (3,)),
])
def test_materialize_prefix_matches_reference(case):
    d, grp, s, w, page, dt, vf, evict, no_sink = case
    lens = [30, 19, 40, 9] if vf else [0, 5, 13, 77]
    sc = kc.build(lens, H=2, D=d, G=grp, S=s, W=w, page=page, seed=d + grp, scale_dtype=dt,
                  valid_from=vf, evict_sink_of=evict, no_sink=no_sink)
    pre = torch.tensor(lens, dtype=torch.int32)
    want = ref.reference_materialize_prefix(sc.layer, sc.index, sc.req_to_token, sc.rows, pre)
    got = triton_materialize_mod.triton_materialize_prefix(sc.layer, sc.index, sc.req_to_token, sc.rows, pre, lens)
    assert got[0].shape == (sum(lens), 2, d) and got[0].dtype == torch.bfloat16
    for g, w_ in zip(got, want):  # one bf16 ulp: the interpreter's float32 -> bf16 cast truncates
        torch.testing.assert_close(g.float(), w_.float(), rtol=2 ** -7, atol=1e-6)


def test_materialize_prefix_refuses_small_buffers():
    sc = kc.build([9, 4], H=2, D=64, G=16, S=4, W=8, page=8, seed=2)
    small = torch.empty(12, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_out/v_out"):
        triton_materialize_mod.triton_materialize_prefix(sc.layer, sc.index, sc.req_to_token, sc.rows,
                                                         torch.tensor([9, 4]), [9, 4], small, small.clone())


@pytest.mark.parametrize("case", [
    # (prefix lens, new lens, D, G, Hq, H, S, W, scale dtype, valid_from, evicted sink of)
    ([0, 5, 13, 40], [7, 1, 20, 9], 64, 16, 4, 2, 4, 8, torch.float16, None, ()),
    ([24, 30, 19], [5, 12, 0], 64, 16, 4, 2, 4, 8, torch.float16, [24, 10, 0], (2,)),
    ([21, 9], [3, 18], 128, 32, 8, 2, 2, 0, torch.float8_e4m3fn, None, ()),
    ([33], [17], 64, 64, 16, 2, 0, 16, torch.float16, None, ()),
])
def test_extend_with_bf16_prefix_matches_reference(case):
    prefix, new, d, grp, hq, h, s, w, dt, vf, evict = case
    sc = kc.build(prefix, H=h, D=d, G=grp, S=s, W=w, page=8, seed=3 + d, scale_dtype=dt,
                  valid_from=vf, evict_sink_of=evict)
    cfg = "bf16"
    fn = functools.partial(triton_extend_mod.triton_extend, prefix_lens_host=prefix)
    kh.check_extend(sc, hq, new, fn, cfg)
    kh.check_extend(sc, hq, new, triton_extend_mod.triton_extend, cfg)  # lengths read back from the device


def test_extend_bf16_prefix_over_the_scratch_cap_reads_int2(monkeypatch):
    calls = []
    real = triton_extend_mod.triton_materialize_prefix
    monkeypatch.setattr(triton_extend_mod, "triton_materialize_prefix",
                        lambda *a, **k: calls.append(list(a[5])) or real(*a, **k))
    sc = kc.build([21, 9], H=2, D=64, G=16, S=4, W=8, page=8, seed=8)
    for cap, materialized in ((30, [[21, 9]]), (29, [])):
        calls.clear()
        monkeypatch.setattr(triton_extend_mod, "MAX_MATERIALIZED_TOKENS", cap)
        cfg = "bf16"
        kh.check_extend(sc, 4, [3, 5], functools.partial(triton_extend_mod.triton_extend, prefix_lens_host=[21, 9]),
                        cfg)
        assert calls == materialized


def test_extend_runs_each_reads_tiles_and_the_fallback_the_int2_tiles(monkeypatch):
    ext = triton_extend_mod
    with pytest.raises(ValueError, match="prefix_read"):
        ext.check_prefix_read("fp8")
    launches = []
    real = ext._extend_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(ext, "_extend_kernel", Recording())
    sc = kc.build([21, 9], H=2, D=64, G=16, S=4, W=8, page=8, seed=8)
    for cap in (30, 0):  # materialised (BF16 tiles), then over the cap (INT2 read and tiles)
        monkeypatch.setattr(ext, "MAX_MATERIALIZED_TOKENS", cap)
        kh.check_extend(sc, 4, [3, 40], functools.partial(ext.triton_extend, prefix_lens_host=[21, 9]),
                        "bf16")
    gqp = 2  # 4 query heads over 2 KV heads; 40 = the longest chunk
    for (grid, kwargs), read in zip(launches, ("bf16", "int2")):
        tiles = ext.EXTEND_TILES[read]
        assert grid[0] == -(-40 // (tiles.block_rows // gqp)) and kwargs["BF16_PREFIX"] == (read == "bf16")
        assert (kwargs["BN"], kwargs["BN_BF16"], kwargs["num_stages"]) == (tiles.block_n, tiles.block_n_bf16,
                                                                          tiles.num_stages)


def test_bf16_read_at_head_dim_256_launches_the_int2_tiles():
    """The BF16 read's tiles need 256 KiB of shared memory at D = 256 (sm_90 has 227; the
    geometry GPU test failed to compile there): past MAX_BF16_TILE_HEAD_DIM it takes the INT2 tiles."""
    ext = triton_extend_mod
    lens = torch.tensor([5, 3])
    for d, tiles in ((128, ext.EXTEND_TILES["bf16"]), (256, ext.EXTEND_TILES["int2"])):
        launch = ext.plan_extend_launch(lens, [5, 3], 4, 8, 8, 1, d, prefix_read="bf16")
        assert launch.bf16_prefix and launch.tiles == tiles
    assert ext.plan_extend_launch(lens, [5, 3], 4, 8, 8, 1, 256, prefix_read="int2").tiles == ext.EXTEND_TILES["int2"]


def test_int2_read_extend_plans_a_request_the_same_alone_and_batched(monkeypatch):
    """The INT2 prefix read (what deterministic inference runs): a request's prefill output
    is launched with the same tiles alone and in a batch, and its output agrees (bitwise on
    the GPU: test_kernels_gpu.py)."""
    ext = triton_extend_mod
    sc = kc.build([40, 0, 77], H=2, D=64, G=64, S=4, W=8, page=8, seed=41)
    new_lens, hq, d = [9, 20, 5], 4, 64
    g = torch.Generator().manual_seed(5)
    t = sum(new_lens)
    q = (torch.randn(t, hq, d, generator=g) * 2).bfloat16()
    k_rot, v_rot = torch.randn(2, t, 2, d, generator=g).bfloat16()
    starts = [0, *itertools.accumulate(new_lens)]
    pre = torch.tensor(sc.lens, dtype=torch.int32)
    args = (sc.layer, sc.index, sc.rotation, sc.req_to_token)

    def extend(i, j):  # requests i..j-1
        lo, hi = starts[i], starts[j]
        qo = torch.tensor([x - lo for x in starts[i:j + 1]], dtype=torch.int32)
        with _recorded_launches(monkeypatch, ext, "_extend_kernel") as seen:
            out = ext.triton_extend(q[lo:hi], k_rot[lo:hi].contiguous(), v_rot[lo:hi].contiguous(), *args,
                                    sc.rows[i:j], pre[i:j], qo, max(new_lens[i:j]), sc.sm_scale)
        return out, seen

    batched, batched_plan = extend(0, 3)
    bm = batched_plan[0][2]["BM"]
    for i in range(3):
        alone, alone_plan = extend(i, i + 1)
        # grid (query-row blocks, requests, KV heads): alone, the blocks of this request only
        (_, grid, kwargs), = alone_plan
        assert kwargs == batched_plan[0][2] and grid == (-(-new_lens[i] // bm), 1, 2)
        torch.testing.assert_close(alone, batched[starts[i]:starts[i + 1]], rtol=_INTERP_RTOL, atol=_INTERP_ATOL,
                                   msg=lambda m, i=i: f"request {i} changed with the batch: {m}")


def test_extend_unknown_prefix_read_is_refused():
    sc = kc.build([9], H=2, D=64, G=16, S=4, W=8, page=8, seed=1)
    with pytest.raises(ValueError, match="prefix_read"):
        kh.check_extend(sc, 4, [3], triton_extend_mod.triton_extend,
                        "fp8")


def test_extend_chunked_prefill_after_prefix_hit():
    # request 0: prefix hit of 24 tokens, ring valid from 24 (nothing of the prefix in BF16
    # but the sinks); request 1: second chunk, ring valid from 10; request 2: evicted sink
    prefix = [24, 30, 19]
    sc = kc.build(prefix, H=2, D=64, G=16, S=4, W=8, page=8, valid_from=[24, 10, 0],
                  evict_sink_of=(2,), seed=9)
    kh.check_extend(sc, 4, [5, 12, 0], triton_extend_mod.triton_extend, "int2")


# ---------------------------------------------------------------- long histories, truncating tensor cores
@pytest.mark.parametrize("kind", ["extend", "decode"])
def test_long_int2_history_under_truncating_tensor_cores(kind):
    """Tensor cores add into their float32 accumulator with truncation, so a dot chain
    carried across a long INT2 history drifts; with the +128 code offset the drift swamps
    the signal (the 128k-prefix extend failure on the H200: 21% of outputs off by up to
    0.11). Emulated here with dot results truncated to 16 mantissa bits: one program
    attends to the INT2 history in 64 blocks (32-token steps in extend, 128 in decode at
    batch 1) and must still match the reference."""
    common = importlib.import_module("oscar_kernels.triton_common")
    sc = kc.build([2048 if kind == "extend" else 8192], H=1, D=64, G=64, S=4, W=8, page=64, seed=6)
    common.set_interp_tc_bits(16)
    try:
        if kind == "extend":
            kh.check_extend(sc, 4, [3], triton_extend_mod.triton_extend, "int2")
        else:
            kh.check_decode(sc, 4, triton_decode_mod.triton_decode,
                            triton_decode_mod.DecodeConfig(max_splits=1, target_programs=1))
    finally:
        common.set_interp_tc_bits(0)


# ---------------------------------------------------------------- HybridAttention, end to end
@pytest.mark.parametrize("learned_sinks", [False, True])
def test_hybrid_attention_triton_matches_reference_end_to_end(monkeypatch, learned_sinks):
    from oscar_kernels.hybrid_attention import use_triton
    sc = kc.build([48, 48], H=2, D=64, G=16, S=4, W=8, page=8, fill=False, seed=13)
    steps = [13, 20, 1, 1, 1]  # two prefill chunks, three decode steps
    sinks = _sinks(4, 5) if learned_sinks else None
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "0")
    assert not use_triton(torch.zeros(1))
    want, lay_ref = kh.attention_session(sc, steps, 4, sinks=sinks)
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1")
    assert use_triton(torch.zeros(1))
    got, lay_tri = kh.attention_session(sc, steps, 4, sinks=sinks)
    kh.assert_layers_close(lay_tri, lay_ref)
    for a, w in zip(got, want):
        kh.assert_attention_close(a, w.float())


# ---------------------------------------------------------------- speculative verify / commit (issue 49)
def test_store_sinks_apart_from_int2():
    """write_sink apart from write_int2 (verify: INT2 without sinks; commit: sinks without INT2)."""
    sc = kc.build([21, 9, 5, 12], H=2, D=64, G=16, S=4, W=8, page=8, fill=False, no_sink=(3,), seed=1)
    for write_int2, write_sink in ((True, False), (False, True)):
        k, v, slots, pos, rows, ends = kh.store_batch(sc, [20, 3, 0, 0])
        want, got = kh.clone_layer(sc.layer), kh.clone_layer(sc.layer)
        ref.reference_store(want, sc.index, sc.rotation, sc.req_to_token, k, v, slots, pos, rows, ends, write_int2,
                            False, write_sink)
        triton_store_mod.triton_store(got, sc.index, sc.rotation, sc.req_to_token, k, v, slots, pos, rows, ends,
                                      write_int2, False, write_sink=write_sink)
        kh.assert_layers_close(got, want)
        assert bool(got.k_sink.abs().sum() > 0) == write_sink
        assert bool(got.k_packed.abs().sum() > 0) == write_int2


@pytest.mark.parametrize("parents, accepted", [
    ([[-1, 0, 1, 2, 3]] * 3, [[0, 1, 2, 3, 4], [], [0, 1]]),  # chain: all, none, k of n
    ([[-1, 0, 0, 1, 2]] * 3, [[0, 2, 4], [0, 1, 3], [0]]),  # tree (topk 2), second branch
], ids=["chain", "tree"])
def test_speculative_verify_commit_triton_equals_decode(monkeypatch, parents, accepted):
    """The protocol on the Triton path (store, staging, the verify's virtual decode batch,
    commit) against Triton decode of the accepted drafts: prefixes 2 (< S), 13 (drafts across
    a page and the ring's wrap), 21 with its full first page request 1's (a radix hit)."""
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1")
    vd = importlib.import_module("oscar_kernels.verify_decode")
    views = []
    monkeypatch.setattr(vd, "verify_layer_view", lambda *a: views.append(1) or _real_layer_view(*a))
    sc = kc.build([2, 13, 21], H=2, D=64, G=16, S=4, W=8, page=8, seed=17, valid_from=[0, 0, 21])
    r1, r2 = int(sc.rows[1]), int(sc.rows[2])
    sc.req_to_token[r2, :8] = sc.req_to_token[r1, :8]
    kh.speculative_vs_decode(sc, 4, parents, accepted, exact=False)
    assert views == [1]  # the verify attention ran through the decode kernel


_real_layer_view = importlib.import_module("oscar_kernels.verify_decode").verify_layer_view


def test_speculative_triton_drafts_deeper_than_the_window_with_learned_sinks(monkeypatch):
    """W = 4 < 6 drafts (ancestors read as INT2 through the virtual rows), an evicted sink
    slot (request 1: its position 0 is read as INT2, no virtual sink page) and sink logits."""
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1")
    sc = kc.build([3, 10], H=2, D=64, G=16, S=4, W=4, page=8, seed=19, evict_sink_of=(1,))
    kh.speculative_vs_decode(sc, 4, [[-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 2, 3]],
                             [[0, 1, 2, 3, 4, 5], [0, 2, 4]], exact=False, sinks=_sinks(4, 3))
