"""The Triton kernels compile for Hopper (sm_90a) ahead of time, without a GPU.

Runs benchmarks/aot_sm90.py in a subprocess (it needs compiled, not interpreted, kernels) and
checks every kernel launch of store / decode / extend compiled, and that the decode
kernels do not spill registers. The main layouts run by default; the others (group sizes,
head_dim 64, MHA, no BF16 side cache, float8 groups of 64) with OSCAR_AOT_ALL=1.
"""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)  # several tests read the same case's records
def _run(case: str) -> tuple[dict, ...]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.aot_sm90", "--case", case], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=1200)
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert recs, f"no kernels compiled:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return tuple(recs)


def _check(recs):
    bad = [f"{x['kernel']}: {x.get('error')}" for x in recs if not x["ok"]]
    assert not bad, "\n".join(bad)
    names = {x["kernel"] for x in recs}
    assert {"_store_kernel", "_rotate_q_kernel", "_decode_stage1", "_extend_kernel"} <= names
    assert names & {"_decode_merge_row", "_decode_merge_split"}, names


def test_default_kernels_compile_for_sm90_without_spills():
    """No register spills inside loops (decode stage 1 runs under a register cap: a few
    spilled values in its prologue / epilogue are allowed, none in its token loops)."""
    # batch 2: the small-batch stage 1 (block_n 128, uncapped) and the split merge; then what
    # runs above batch 4 (block_n 64 under the cap, the query_head merge)
    recs = _run("g128") + _run("g128_large_batch")
    _check(recs)
    assert {"_decode_merge_row", "_decode_merge_split"} <= {x["kernel"] for x in recs}
    for x in recs:
        if x["kernel"] in ("_decode_merge_row", "_decode_merge_split", "_rotate_q_kernel", "_extend_kernel"):
            assert x["spill_bytes"] == 0, f"{x['kernel']} spills {x['spill_bytes']} bytes"
        if x["kernel"] == "_decode_stage1":
            assert x["loop_spill_instructions"] == 0, f"stage 1 spills in a loop: {x}"
            assert x["spill_bytes"] <= 256, f"stage 1 spills {x['spill_bytes']} bytes"


def test_decode_launches_chain_with_programmatic_dependent_launch():
    """On sm_90 the decode's query rotation lets the next kernel start (launch_dependents),
    and stage 1, the merge and the un-rotation wait for their predecessor before reading
    its output (griddepcontrol.wait); the store and extend kernels use neither."""
    recs = _run("k32_v128_float8_scales")
    _check(recs)
    rotations = [x for x in recs if x["kernel"] == "_rotate_q_kernel"]
    # decode: the query rotation (releases stage 1), the un-rotation after the split merge
    # (waits); then extend's two rotations (neither)
    assert [x["griddepcontrol"] for x in rotations] == [["launch_dependents"], ["wait"], [], []]
    for x in recs:
        if x["kernel"] in ("_decode_stage1", "_decode_merge_split"):
            assert x["griddepcontrol"] == ["wait"], x
        if x["kernel"] in ("_store_kernel", "_extend_kernel"):
            assert x["griddepcontrol"] == [], x


def test_default_layout_pipelines_compile_for_sm90():
    """The default layout's stage 1 as it runs above batch 1 (3 pipeline stages, int64 slot
    offsets) and at batch 1 (2 stages, int32): both compile, the deep one's INT2 token loop (the
    largest) does not spill, and it holds more shared memory than the 2-stage build."""
    deep = [x for x in _run("k32_v128_float8_scales") if x["kernel"] == "_decode_stage1"]
    shallow = [x for x in _run("k32_v128_batch1") if x["kernel"] == "_decode_stage1"]
    assert deep and shallow and all(x["ok"] for x in deep + shallow), deep + shallow
    for x in deep:
        largest = max(x["loops"], key=lambda loop: loop["instructions"])
        assert largest["spill_instructions"] == 0, x
        assert x["shared_bytes"] > shallow[0]["shared_bytes"], (x["shared_bytes"], shallow[0]["shared_bytes"])


def test_bf16_prefix_extend_compiles_for_sm90_without_spills():
    """The BF16 prefix read with its default tiles: the materialising kernel and the BF16 extend."""
    recs = [x for x in _run("g128_bf16_prefix") if x["kernel"] in ("_materialize_kernel", "_extend_kernel")]
    assert {x["kernel"] for x in recs} == {"_materialize_kernel", "_extend_kernel"}
    for x in recs:
        assert x["ok"], x.get("error")
        assert x["spill_bytes"] == 0, f"{x['kernel']} spills {x['spill_bytes']} bytes"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("OSCAR_AOT_ALL") != "1", reason="set OSCAR_AOT_ALL=1 (minutes of compiling)")
@pytest.mark.parametrize("case", ["g32", "g64_d64", "g8_gq1", "g128_nobf16", "g64_float8_scales"])
def test_other_layouts_compile_for_sm90(case):
    _check(_run(case))
