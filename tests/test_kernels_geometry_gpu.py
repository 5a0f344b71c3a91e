"""The served models' attention geometries through the compiled decode and extend kernels on a
GPU, at lengths and batches the interpreter cannot reach (issue 30; the CPU twin of this file
is tests/test_kernels_geometry.py).

Every row of calibration/architectures.py that the kernels serve (its query / KV heads and
head_dim, the default layout KVLayout.resolve(D), S = 16, W = 128, page 64) and the two
published geometries where the upstream OSCAR decode read another KV head's cache (48 / 8 at
batch >= 16, 96 / 8 at batch < 16) and MHA and 2 query heads per KV head, against the PyTorch reference: decode with the tuned
default configuration at batch 1, 3, 16 and 64 (every batch branch of the tile heuristics),
extend over a cached prefix with the int2 and bf16 prefix reads. Each KV head has its own
random cache and rotation, so a query head that read another head's cache misses the
reference by far more than the tolerance (tests/test_kernels_geometry.py measures the gap).

    python -m pytest -m gpu tests/test_kernels_geometry_gpu.py

About 9 s a test on an H200 (mostly compiles): on the device's 10-minute calls run it in two,
``-k "decode or matrix"`` (49 tests) and ``-k extend`` (24).
"""
import os

import pytest
import torch

from calibration import architectures as archs
from oscar_kernels import testing as kc
import kernel_helpers as kh
from oscar_kernels.contract.layout import KVLayout
from sglang_ext.refusals import kernel_head_dim_problem

pytestmark = pytest.mark.gpu

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("GPU tests need compiled kernels (unset TRITON_INTERPRET)", allow_module_level=True)

GEOMETRIES = [(a.name, a.geometry["num_q_heads"], a.geometry["num_kv_heads"], a.head_dim)
              for a in archs.ARCHITECTURES if kernel_head_dim_problem(a.head_dim) is None]
GEOMETRIES += [("minimax-m2-shape", 48, 8, 128), ("glm-4.7-shape", 96, 8, 128),  # the upstream bug's
               ("mha-shape", 32, 32, 128), ("gqa-2-shape", 16, 8, 64)]
# (batch, cached lengths): the batch branches of the decode heuristics, with long contexts
BATCHES = {1: [8192], 3: [4099, 130, 2000], 16: [700 + 97 * i for i in range(16)],
           64: [150 + 13 * i for i in range(64)]}


def _scenario(lens, h, d, seed):
    lay = KVLayout.resolve(d)
    return kc.build(lens, H=h, D=d, G=lay.key_group_size, GV=lay.value_group_size,
                    scale_dtype=lay.torch_scale_dtype, S=16, W=128, page=64, sink_slots=len(lens) + 1,
                    seed=seed, device="cuda")


def _id(g):
    return f"{g[0]}-{g[1]}q{g[2]}kv-d{g[3]}"


def test_the_matrix_holds_every_served_ratio_and_head_dim():
    assert {g[1] // g[2] for g in GEOMETRIES} >= {1, 2, 4, 5, 6, 7, 8, 12, 16}
    assert {g[3] for g in GEOMETRIES} >= {64, 128, 256}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_id)
def test_decode_served_geometry_gpu(geometry, batch):
    from oscar_kernels.triton_decode import triton_decode

    _, hq, h, d = geometry
    sc = _scenario(BATCHES[batch], h, d, seed=hq + d + batch)
    kh.check_decode(sc, hq, triton_decode)


@pytest.mark.parametrize("prefix_read", ["int2", "bf16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_id)
def test_extend_served_geometry_gpu(geometry, prefix_read):
    from oscar_kernels.triton_extend import triton_extend

    _, hq, h, d = geometry
    sc = _scenario([0, 700, 1500, 77], h, d, seed=hq * 3 + d)
    kh.check_extend(sc, hq, [512, 1, 300, 37], triton_extend, prefix_read)
