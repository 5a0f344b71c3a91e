"""benchmarks/stage1_ablation.py on CPU: the L2-resident request table, the helper swaps (and
that they are undone), and that a swapped build really compiles to another sm_90 loop."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_kernels import testing as kc

ROOT = Path(__file__).resolve().parents[1]
sa = pytest.importorskip("benchmarks.stage1_ablation")


def test_resident_table_maps_every_request_onto_request_one_first_slots():
    sc = kc.build_random([5000, 9000], H=2, D=128, G=32, GV=128, S=16, W=128, page=64, device="cpu",
                         scale_dtype=torch.float8_e4m3fn)
    r = sa.resident(sc)
    first = sc.req_to_token[1, :sa.RESIDENT_TOKENS]
    for row in (1, 2):
        assert torch.equal(r.req_to_token[row, :sa.RESIDENT_TOKENS], first)
        assert torch.equal(r.req_to_token[row, sa.RESIDENT_TOKENS:2 * sa.RESIDENT_TOKENS],
                           first[:9000 - sa.RESIDENT_TOKENS])
    assert torch.unique(r.req_to_token[1:]).numel() == sa.RESIDENT_TOKENS
    assert r.layer is sc.layer and r.req_to_token is not sc.req_to_token
    assert not torch.equal(sc.req_to_token[2, :16], first[:16])  # the scenario itself untouched


def test_ablated_swaps_helpers_and_restores_them():
    tha, td = sa.tha, sa.td
    before = (tha.group_scales, tha.unpack_pair, td._decode_stage1, os.environ.get("TRITON_CACHE_DIR"))
    with sa.ablated("neither"):
        assert tha.group_scales is sa.scales_from_slot and tha.unpack_pair is sa.codes_as_they_are
        assert td._decode_stage1 is not before[2] and td._decode_stage1.fn is before[2].fn
        tmp = os.environ["TRITON_CACHE_DIR"]
        assert tmp != before[3] and Path(tmp).is_dir()
    assert not Path(tmp).exists()
    assert (tha.group_scales, tha.unpack_pair, td._decode_stage1,
            os.environ.get("TRITON_CACHE_DIR")) == before
    with pytest.raises(SystemExit):
        sa.main(["--sass", "--builds", "default,nope"])


def test_swapped_build_loses_the_unpacking_and_leaves_the_shared_cache_to_the_shipped_kernel(tmp_path):
    """sm_90 builds (a subprocess: compiled, not interpreted) of no_unpack and default: the swap
    removes the unpacking LOP3s from the INT2 loop. Regression (session 17): the ablated build,
    compiled first against the same TRITON_CACHE_DIR, must not be what the shipped decode then
    loads (Triton's on-disk keys do not see swapped helpers); the shipped compile comes before
    the ablation's own default build, which would otherwise rewrite the shared entry."""
    code = ("import json; from benchmarks import stage1_ablation as sa; from oscar_kernels import aot_sm90; "
            "case = 'k32_v128_float8_scales'; "
            "no_unpack = sa.sass_counts(['no_unpack'], [case])[0]; "
            "r = [x for x in aot_sm90.run(case) if x['kernel'] == '_decode_stage1'][0]; "
            "default = sa.sass_counts(['default'], [case])[0]; "
            "print(json.dumps([[no_unpack, default], r['loops'][-1]['opcodes']]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    (no_unpack, default), shipped = json.loads(r.stdout.strip().splitlines()[-1])
    assert default["ok"] and no_unpack["ok"]
    assert no_unpack["int2_loop_instructions"] < default["int2_loop_instructions"]
    assert default["int2_loop_opcodes"]["LOP3"] - no_unpack["int2_loop_opcodes"].get("LOP3", 0) >= 200
    assert shipped["LOP3"] >= 200  # the unpacking is there (no_unpack's loop has ~40)
