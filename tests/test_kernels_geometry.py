"""The served models' attention geometries (issue 30) through the Triton store, decode and
extend kernels under TRITON_INTERPRET=1, against their PyTorch twins (oscar_kernels.reference).

Query heads per KV head 1, 2, 4, 5, 6, 7, 8, 9, 12, 16 and head_dim 64, 128, 256, in both
layout classes of the decode tiles (key and value groups spanning the head, G = D with
float16 scales; or the default layout, keys D/4, values min(128, D), float8 scales), and
every decode batch branch of the tile heuristics (DecodeConfig.stage1_tiles,
merge_grid_for: batch 1, 2..SPLIT_MERGE_MAX_BATCH with the split merge, above it the
query-head merge; batch-invariant decode). The public upstream OSCAR decode kernel read
another KV head's cache for 6 query heads per KV head at batch >= 16 and for 9-15 at
batch < 16: every decode and extend case here identifies, per request and query head,
which KV head's cache and rotations the kernel's output came from, and fails unless it is
head hq // (Hq / H). Short contexts (the interpreter runs every program in numpy).
"""
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: run this file alone with TRITON_INTERPRET=1 (interpreted kernels)",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from oscar_kernels import reference as ref  # noqa: E402
from oscar_kernels import testing as kc  # noqa: E402
import kernel_helpers as kh  # noqa: E402
from oscar_kernels.contract.layout import KVLayout  # noqa: E402

_, _, store_mod, decode_mod, _, extend_mod = kh.interpreted_kernel_modules()

# several INT2 splits per request at these small lengths (the launch shapes are the tuned ones)
# block_rotation_min_batch 8: the cases' batches of 8-16 take the large-batch rotations
_SMALL = dict(min_chunk=16, target_programs=64, max_splits=4, block_rotation_min_batch=8)
# lengths: 1 is shorter than S + W = 12, 40 has 28 INT2 positions (two splits of 16)
_LENS = [40, 1, 13, 25, 7, 33, 9, 18, 3, 29, 16, 37, 5, 21, 11, 40]
# an output that came from another KV head's cache differs from the true one by at least
# this much (max over channels): measured >= 0.83 on these cases, the kernel's own error <= 0.06
_WRONG_HEAD_MIN_ERROR = 0.5


def _layout(d: int, span: bool) -> dict:
    """build() keywords of a layout class: groups spanning the head (G = D, float16), or the default layout."""
    if span:
        return dict(G=d, GV=d, scale_dtype=torch.float16)
    lay = KVLayout.resolve(d)
    return dict(G=lay.key_group_size, GV=lay.value_group_size, scale_dtype=lay.torch_scale_dtype)


def _scenario(lens, h, d, span, seed):
    return kc.build(lens, H=h, D=d, S=4, W=8, page=8, seed=seed, **_layout(d, span))


def _same_head_everywhere(sc, c: int):
    """The scenario with every KV head's cache and rotations replaced by head c's: the
    reference on it is what every query head would give if it read head c."""
    return kh.head_subset(sc, [c] * sc.layer.num_kv_heads)


def _assert_each_query_head_reads_its_kv_head(got, candidates, gq, what):
    """got [N, Hq, D]; candidates [H, N, Hq, D]: the reference output of every row and query
    head had it read KV head c. Each query head hq must match candidate hq // gq and be
    clearly off every other (which head it read is named when not)."""
    err = (got.float()[None] - candidates).abs().amax(-1)  # [H, N, Hq]
    h, n, hq = err.shape
    want = (torch.arange(hq) // gq).expand(n, hq)
    read = err.argmin(0)
    wrong = (read != want).nonzero().tolist()
    assert not wrong, f"{what}: " + ", ".join(
        f"row {r} query head {q} reads KV head {int(read[r, q])}, not {int(want[r, q])}" for r, q in wrong[:6])
    own = err.gather(0, want[None]).squeeze(0)
    others = err.scatter(0, want[None], float("inf")).amin(0) if h > 1 else torch.full_like(own, float("inf"))
    assert float(others.min()) > _WRONG_HEAD_MIN_ERROR, (
        f"{what}: another KV head's output is within {float(others.min()):.3f} of the kernel's "
        "(the heads' caches do not differ enough to tell a wrong head)")
    assert float(own.max()) < float(others.min()) / 4, (float(own.max()), float(others.min()))


def _decode_candidates(sc, q):
    """[H, B, Hq, D] float32: kh.decode_reference had every query head read KV head c."""
    return torch.stack([kh.decode_reference(_same_head_everywhere(sc, c), q)
                        for c in range(sc.layer.num_kv_heads)])


def _run_decode(sc, hq, config, seed=3):
    """kh.check_decode (kernel vs reference within its tolerance); returns (q, kernel output)."""
    seen = []

    def decode(*args, **kwargs):
        seen.append(decode_mod.triton_decode(*args, **kwargs))
        return seen[-1]

    kh.check_decode(sc, hq, decode, config, seed=seed)
    return kc.random_q(sc, hq, seed), seen[0]


def _branch(config, batch: int, span: bool) -> tuple:
    """(layout class, stage-1 tiles regime, merge, rotations in row blocks) a decode batch runs."""
    tiles = config.stage1_tiles(batch, span)
    regime = "small" if tiles == decode_mod.STAGE1_TILES[span].small and not config.batch_invariant else "large"
    return ("G=D" if span else "default", regime, config.merge_grid_for(batch), config.block_rotation(batch))


# ---------------------------------------------------------------- builder: distinct heads

def test_builder_gives_every_kv_head_its_own_cache_and_rotation():
    """What the wrong-head checks rely on: per KV head, different cached keys/values (as
    the kernels read them) and different rotations."""
    sc = _scenario([40, 13], 4, 128, False, seed=1)
    k, v = ref.hybrid_kv(sc.layer, sc.index, sc.req_to_token, int(sc.rows[0]), 40)  # [n, H, D]
    for a in range(4):
        for b in range(a + 1, 4):
            for x in (k, v):
                assert float((x[:, a] - x[:, b]).abs().mean()) > 0.3
            assert float((sc.rotation.k_rot[a] - sc.rotation.k_rot[b]).abs().max()) > 0.1
            assert float((sc.rotation.v_rot[a] - sc.rotation.v_rot[b]).abs().max()) > 0.1


# ---------------------------------------------------------------- store

@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("span", [True, False], ids=["G=D", "default"])
def test_store_geometry_matches_reference(d, span):
    """Every head_dim in both layout classes (the store sees KV heads only): a decode
    token, an extend chunk and two new sequences (sinks)."""
    sc = kc.build([21, 9, 5, 12], H=4, D=d, S=4, W=8, page=8, fill=False, no_sink=(3,), seed=d,
                  **_layout(d, span))
    got = kh.check_store(sc, [20, 3, 0, 0], store_mod.triton_store, True, True)
    assert got.k_sink.abs().sum() > 0 and got.k_ring.abs().sum() > 0


# ---------------------------------------------------------------- decode

# (query heads per KV head, KV heads, head_dim, groups span the head, batch)
DECODE_CASES = [
    (1, 2, 128, False, 5),
    (1, 4, 64, True, 1),
    (2, 2, 64, False, 2),
    (2, 2, 256, True, 4),
    (4, 2, 256, False, 1),
    (4, 2, 128, True, 5),
    (5, 2, 128, False, 4),  # Qwen3-14B: 40 / 8
    (5, 2, 64, True, 8),
    (6, 2, 64, False, 1),
    (6, 2, 128, False, 3),
    (6, 2, 128, False, 16),  # the upstream bug: 6 per KV head at batch >= 16
    (6, 2, 64, True, 16),
    (6, 2, 256, True, 2),
    (7, 2, 128, False, 3),  # Qwen2.5-7B: 28 / 4
    (8, 2, 128, False, 8),
    (8, 2, 256, True, 1),
    (9, 2, 64, False, 5),  # the upstream bug: 9-15 per KV head at batch < 16
    (12, 2, 128, False, 1),
    (12, 2, 128, False, 4),
    (12, 2, 64, True, 8),
    (12, 2, 256, False, 5),
    (12, 2, 128, True, 15),
    (16, 2, 128, False, 2),  # GLM-4-9B: 32 / 2
    (16, 2, 64, True, 5),
    (16, 2, 256, False, 3),
]


def _case_id(case):
    gq, h, d, span, b = case
    return f"gq{gq}-h{h}-d{d}-{'G=D' if span else 'default'}-b{b}"


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_decode_geometry_matches_reference_and_reads_its_kv_head(case):
    gq, h, d, span, b = case
    sc = _scenario(_LENS[:b], h, d, span, seed=gq * 7 + d + b)
    q, got = _run_decode(sc, gq * h, decode_mod.DecodeConfig(**_SMALL))
    _assert_each_query_head_reads_its_kv_head(got, _decode_candidates(sc, q), gq, _case_id(case))


# the published geometries of the upstream bug at the batches where it showed
REAL_BUG_GEOMETRIES = [
    (6, 8, 128, False, 16),  # MiniMax-M2: 48 query / 8 KV heads, batch >= 16
    (12, 8, 128, False, 8),  # GLM-4.7: 96 query / 8 KV heads, batch < 16
]


@pytest.mark.parametrize("case", REAL_BUG_GEOMETRIES, ids=_case_id)
def test_decode_published_bug_geometries_read_their_kv_head(case):
    gq, h, d, span, b = case
    sc = _scenario(_LENS[:b], h, d, span, seed=gq + b)
    q, got = _run_decode(sc, gq * h, decode_mod.DecodeConfig(**_SMALL))
    _assert_each_query_head_reads_its_kv_head(got, _decode_candidates(sc, q), gq, _case_id(case))


@pytest.mark.parametrize("gq,h,d,span,b", [(6, 2, 128, False, 1), (12, 2, 64, True, 3)])
def test_decode_batch_invariant_geometry(gq, h, d, span, b):
    """The batch-invariant decode (large-batch tiles and the query-head merge at any batch)."""
    cfg = decode_mod.batch_invariant_config(max(_LENS[:b]), 4, gq * h, d,
                                            base=decode_mod.DecodeConfig(max_splits=4, min_chunk=16))
    assert _branch(cfg, b, span)[1:] == ("large", "query_head", False)
    sc = _scenario(_LENS[:b], h, d, span, seed=gq + d)
    q, got = _run_decode(sc, gq * h, cfg)
    _assert_each_query_head_reads_its_kv_head(got, _decode_candidates(sc, q), gq, f"batch-invariant gq{gq}")


def test_decode_cases_cover_every_ratio_head_dim_and_batch_branch():
    """Every query-heads-per-KV-head ratio and head_dim of issue 30, and every (layout
    class, stage-1 tiles, merge) a batch can reach, is among DECODE_CASES (so a change of
    STAGE1_TILES / SPLIT_MERGE_MAX_BATCH that opens a branch shows here)."""
    cfg = decode_mod.DecodeConfig(**_SMALL)
    cases = DECODE_CASES + REAL_BUG_GEOMETRIES
    assert {1, 2, 4, 5, 6, 8, 12, 16} <= {c[0] for c in cases}
    assert {64, 128, 256} <= {c[2] for c in cases}
    for span in (True, False):
        assert {64, 128, 256} <= {c[2] for c in cases if c[3] == span}
    reachable = {_branch(cfg, b, span) for b in range(1, 65) for span in (True, False)}
    covered = {_branch(cfg, c[4], c[3]) for c in cases}
    assert covered == reachable, reachable - covered
    split_max = decode_mod.SPLIT_MERGE_MAX_BATCH
    for span in (True, False):  # and per class batch 1, 2..SPLIT_MERGE_MAX_BATCH, above it
        batches = {c[4] for c in cases if c[3] == span}
        assert 1 in batches and batches & set(range(2, split_max + 1)) and max(batches) > split_max
    # the upstream bug's batches, with several per ratio
    assert any(c[0] == 6 and c[4] >= 16 for c in cases)
    assert any(9 <= c[0] <= 15 and c[4] < 16 for c in cases)
    for gq in (6, 12):
        assert len({c[4] for c in cases if c[0] == gq}) >= 3


@pytest.mark.parametrize("kind,perm,first_wrong", [
    ("all heads rolled", [1, 2, 3, 0], "row 0 query head 0 reads KV head 1, not 0"),
    ("last head reads head 0", [0, 1, 2, 0], "row 0 query head 18 reads KV head 0, not 3"),
], ids=["rolled", "last_reads_0"])
def test_wrong_kv_head_is_caught(kind, perm, first_wrong):
    """The check fails on an output that read another KV head: the kernel run on a copy of
    the cache whose heads were moved (its query heads then read, for the original cache,
    head perm[hq // gq]) is flagged, naming the query heads, and misses the reference."""
    gq, h, d, b = 6, 4, 64, 16
    sc = _scenario(_LENS[:b], h, d, False, seed=5)
    moved = kh.head_subset(sc, perm)
    q = kc.random_q(sc, gq * h, 3)
    got = decode_mod.triton_decode(q, moved.layer, moved.index, moved.rotation, moved.req_to_token, moved.rows,
                                   torch.tensor(sc.lens, dtype=torch.int32), sc.sm_scale,
                                   config=decode_mod.DecodeConfig(**_SMALL))
    cands = _decode_candidates(sc, q)
    with pytest.raises(AssertionError, match=first_wrong):
        _assert_each_query_head_reads_its_kv_head(got, cands, gq, kind)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got.float(), kh.decode_reference(sc, q), rtol=3e-2, atol=3e-2)
    # what it did read: every query head the moved head's
    read = (got.float()[None] - cands).abs().amax(-1).argmin(0)
    assert torch.equal(read, torch.tensor(perm)[torch.arange(gq * h) // gq].expand(b, -1))


# ---------------------------------------------------------------- extend

# (query heads per KV head, KV heads, head_dim, groups span the head, prefix read)
EXTEND_CASES = [
    (1, 2, 64, False, "int2"),
    (2, 2, 256, True, "int2"),
    (4, 2, 128, False, "bf16"),
    (5, 2, 128, True, "int2"),
    (6, 2, 128, False, "int2"),
    (6, 2, 64, True, "bf16"),
    (6, 2, 256, False, "int2"),
    (8, 2, 64, False, "int2"),
    (12, 2, 128, False, "int2"),
    (12, 2, 256, True, "bf16"),
    (16, 2, 128, False, "int2"),
    (16, 2, 64, True, "int2"),
]


def _run_extend(sc, hq, new_lens, prefix_read):
    """kh.check_extend; returns the kernel's (q, k_rot, v_rot, qo_indptr, prefix_lens) and output."""
    seen = []

    def extend(q, k_rot, v_rot, layer, index, rotation, req_to_token, rows, pre, qo, *args, **kwargs):
        out = extend_mod.triton_extend(q, k_rot, v_rot, layer, index, rotation, req_to_token, rows, pre, qo,
                                       *args, **kwargs)
        seen.append(((q, k_rot, v_rot, qo, pre), out))
        return out

    kh.check_extend(sc, hq, new_lens, extend, prefix_read)
    return seen[0]


def _extend_candidates(sc, q, k_rot, v_rot, qo, pre):
    """[H, T, Hq, D] float32: the reference extend had every query head read KV head c
    (its cached prefix, its new keys/values and its rotations)."""
    h, hq = sc.layer.num_kv_heads, q.shape[1]
    out = []
    for c in range(h):
        one = _same_head_everywhere(sc, c)
        same = [c] * h
        q_rot = ref.rotate(q, ref.expand_gqa(one.rotation.k_rot, hq))
        o_rot = ref.reference_extend(q_rot, k_rot[:, same], v_rot[:, same], one.layer, one.index, one.req_to_token,
                                     one.rows, pre, qo, one.sm_scale)
        out.append(ref.rotate(o_rot, ref.expand_gqa(one.rotation.v_rot, hq).transpose(-1, -2)))
    return torch.stack(out)


@pytest.mark.parametrize("case", EXTEND_CASES, ids=lambda c: f"gq{c[0]}-d{c[2]}-{'G=D' if c[3] else 'default'}-{c[4]}")
def test_extend_geometry_matches_reference_and_reads_its_kv_head(case):
    """A new sequence, a one-token chunk and a chunk over a cached prefix (INT2 part, sinks, ring)."""
    gq, h, d, span, prefix_read = case
    sc = _scenario([0, 13, 40], h, d, span, seed=gq + d)
    (q, k_rot, v_rot, qo, pre), got = _run_extend(sc, gq * h, [7, 1, 9], prefix_read)
    _assert_each_query_head_reads_its_kv_head(got, _extend_candidates(sc, q, k_rot, v_rot, qo, pre), gq,
                                              f"extend gq{gq} d{d}")


def test_extend_sixteen_requests_gqa6():
    """The batch of the upstream decode bug through extend (programs over requests x heads)."""
    sc = _scenario(_LENS, 2, 128, False, seed=16)
    new = [1 + i % 3 for i in range(16)]
    (q, k_rot, v_rot, qo, pre), got = _run_extend(sc, 12, new, "int2")
    _assert_each_query_head_reads_its_kv_head(got, _extend_candidates(sc, q, k_rot, v_rot, qo, pre), 6,
                                              "extend gq6 b16")
