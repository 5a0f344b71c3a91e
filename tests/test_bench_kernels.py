"""benchmarks/bench_kernels.py's cold-L2 bookkeeping on CPU: the copies that push a case's
working set past 4 x L2 (sized by the bytes decode reads) and the function that runs every layer in turn."""
import pytest
import torch

bk = pytest.importorskip("benchmarks.bench_kernels")


def test_copies_exceed_four_l2_and_stop_at_one():
    l2 = 50 << 20
    assert bk.copies_for(38_525_952, l2) == 6  # batch 1, 64k: 6 x 38.5 MB > 200 MB
    assert bk.copies_for(308_207_616, l2) == 1  # batch 8, 64k: already 1.5 x 4 L2
    assert bk.copies_for(1, l2) == bk.MAX_COPIES
    assert all(n * bk.copies_for(n, l2) >= 4 * l2 for n in (2_890_752, 10_017_792, 23_126_016))


def test_in_turn_runs_every_layer_once_per_call():
    calls = []
    fn = bk.in_turn([lambda j=j: calls.append(j) for j in range(3)])
    fn()
    fn()
    assert calls == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("group, scale_dtype", [(128, torch.float16), (64, torch.float8_e4m3fn)])
def test_cold_copies_are_sized_by_what_decode_reads(group, scale_dtype):
    """A working set of int2_bytes_read bytes under 4 x L2: that many layers, each with its
    own cache and rotation, sharing the request table and sink index like a server's layers."""
    one, = bk.cold_copies(2, 300, 1, group, scale_dtype, device="cpu")  # a 1-byte L2: one copy
    nbytes = bk.int2_bytes_read(one.layer, one.lens, bk.HQ)
    scs = bk.cold_copies(2, 300, nbytes, group, scale_dtype, device="cpu")  # L2 = the working set
    assert len(scs) == 4 and len({s.layer.k_packed.data_ptr() for s in scs}) == 4
    assert len({s.rotation.k_rot.data_ptr() for s in scs}) == 4
    assert not torch.equal(scs[0].layer.k_packed, scs[1].layer.k_packed)  # one seed each
    assert not torch.equal(scs[0].rotation.v_rot, scs[1].rotation.v_rot)
    assert all(s.req_to_token is scs[0].req_to_token and s.index is scs[0].index for s in scs)
    for s in scs[1:]:
        for f in s.layer.__dataclass_fields__:
            a, b = getattr(s.layer, f), getattr(scs[0].layer, f)
            assert a.shape == b.shape and a.dtype == b.dtype, f


def test_cases_option_names_table_cases():
    assert bk.parse_cases("8x65536,1X4096") == [(8, 65536), (1, 4096)]
    for bad in ("8x1000", "3x65536", "8-65536"):
        with pytest.raises(Exception, match="case"):
            bk.parse_cases(bad)
