"""benchmarks/bench_kernels.py's cold-L2 bookkeeping on CPU: the copies that push a case's
working set past 4 x L2, the round-robin timed function, and the byte count it sizes them by."""
import sys
from pathlib import Path

import pytest
import torch

import kernel_cases as kc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bk = pytest.importorskip("bench_kernels")


def test_copies_exceed_four_l2_and_stop_at_one():
    l2 = 50 << 20
    assert bk.copies_for(38_525_952, l2) == 6  # batch 1, 64k: 6 x 38.5 MB > 200 MB
    assert bk.copies_for(308_207_616, l2) == 1  # batch 8, 64k: already 1.5 x 4 L2
    assert bk.copies_for(1, l2) == bk.MAX_COPIES
    assert all(n * bk.copies_for(n, l2) >= 4 * l2 for n in (2_890_752, 10_017_792, 23_126_016))


def test_round_robin_runs_every_copy_once_per_call():
    calls = []
    make = bk.round_robin([lambda j=j: (lambda: calls.append(j)) for j in range(3)])
    fn = make()
    fn()
    fn()
    assert calls == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("group, scale_dtype", [(128, torch.float16), (64, torch.float8_e4m3fn)])
def test_oscar_bytes_of_matches_what_decode_reads(group, scale_dtype):
    """The copies are sized before any cache is built: the same count as int2_bytes_read."""
    sc = kc.build([300, 300], H=bk.H, D=bk.D, G=group, S=bk.S, W=bk.W, page=bk.PAGE, fill=False,
                  scale_dtype=scale_dtype)
    scale_bytes = torch.empty(0, dtype=scale_dtype).element_size()
    assert bk.oscar_bytes_of(2, 300, group, scale_bytes) == bk.int2_bytes_read(sc.layer, sc.lens, bk.HQ)
