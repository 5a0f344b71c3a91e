"""benchmarks/bench_extend.py's OSCAR launches run (interpreted, CPU, one small chunk) and
both prefix reads agree, so a GPU run spends its minutes measuring, not crashing."""
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: the benchmark itself runs there", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"


def test_bench_extend_launches_agree_on_cpu():
    from test_kernels_interpret import triton_extend_mod  # interpreted kernel modules

    from benchmarks import bench_extend

    chunk = bench_extend.Chunk(200, 16, device="cpu")
    outs = []
    for read in ("int2", "bf16"):
        chunk.oscar(read)()
        outs.append(chunk.out.float().clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=3e-2, atol=3e-2)
    k, v = chunk.materialize()()
    assert k.shape == (200, bench_extend.H, bench_extend.D) and torch.isfinite(k.float()).all()
    assert bench_extend.attention_flops(0, 2) == 4.0 * 3 * bench_extend.HQ * bench_extend.D


def test_bench_extend_plots_what_a_run_timed(tmp_path):
    from benchmarks import bench_extend

    result = {"device": "cpu", "cases": [
        {"prefix": 0, "new": 8192, "oscar_int2_us": 8906.7, "oscar_flashinfer_us": 4038.7},
        {"prefix": 32768, "new": 8192, "oscar_int2_us": 54285.5, "oscar_flashinfer_us": 10080.0,
         "materialize_us": 199.1, "oscar_bf16_us": None}]}
    bench_extend.plot(result, tmp_path / "extend.png")
    assert (tmp_path / "extend.png").stat().st_size > 10_000
