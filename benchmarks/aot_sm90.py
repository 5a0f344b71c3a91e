"""Compile the oscar Triton kernels ahead of time for Hopper (sm_90a) without a GPU.

The host wrappers (triton_store / triton_decode / triton_extend) run on CPU tensors; each
kernel launch is intercepted and compiled with ``triton.compile`` for the sm_90 target,
then ``ptxas -v`` reports registers and spills. Catches GPU-only failures (inline PTX,
layouts, shared memory) on a machine without CUDA.

Usage: python -m benchmarks.aot_sm90 [--case NAME ...] [--kernel NAME] [--opcodes] [--dump DIR]
(prints one JSON line per kernel launch: registers, spills, and per loop of its SASS the
instruction count, spill instructions and, with --opcodes, the opcode histogram; --dump writes
each launch's TTGIR, PTX and SASS to DIR/CASE.N.KERNEL.{ttgir,ptx,sass}, N its launch index)
Must run without TRITON_INTERPRET (tests/test_kernels_compile.py runs it as a subprocess).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
       torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def _compile(kernel, args, kwargs):
    """triton.compile the JIT kernel for sm_90 with the launch's arguments."""
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "launch_pdl") if k in kwargs}
    if opts.get("maxnreg", 0) is None:
        del opts["maxnreg"]
    names = kernel.arg_names
    bound = dict(zip(names, args))
    bound.update(kwargs)
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = bound[name]
        if i in kernel.constexprs:
            sig[name] = "constexpr"
            consts[name] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TY[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool) or v is None:
            sig[name] = "constexpr"
            consts[name] = v
        elif isinstance(v, int):
            if v == 1:
                sig[name] = "constexpr"
                consts[name] = 1
            else:
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: unsupported argument {type(v)}")
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options=opts)


def _opcode(instruction: str) -> str:
    """'@!P0 LDGSTS.E.BYPASS.128 [R1], ...' -> 'LDGSTS'."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def _sass(cubin: bytes) -> str:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True).stdout


def _spills(body: list[str]) -> int:
    return sum(bool(re.search(r"\b(STL|LDL)\b", b)) for b in body)


def _loop_stats(sass: str) -> dict:
    """From SASS text (cuobjdump): instructions of the largest loop (the body between a
    backward branch and its target), spill instructions (STL/LDL) inside any loop, and per
    loop its instruction count, spills and opcode histogram (most frequent first)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = set()
    for addr, body in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", body)
        if m and int(m.group(1), 16) < addr:
            loops.add((int(m.group(1), 16), addr))
    per_loop = []
    for lo, hi in sorted(loops):
        body = [b for a, b in ins if lo <= a <= hi]
        per_loop.append({"start": hex(lo), "instructions": len(body), "spill_instructions": _spills(body),
                         "opcodes": dict(collections.Counter(_opcode(b) for b in body).most_common())})
    inside = [body for addr, body in ins if any(lo <= addr <= hi for lo, hi in loops)]
    return {"main_loop_instructions": max((x["instructions"] for x in per_loop), default=0),
            "loop_spill_instructions": _spills(inside), "loops": per_loop}


def _ptxas_stats(compiled, sass: str) -> dict:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) if spill else None,
            "griddepcontrol": sorted(set(re.findall(r"griddepcontrol\.(\w+)", compiled.asm["ptx"]))),
            "shared_bytes": compiled.metadata.shared, **_loop_stats(sass)}


DUMP_DIR: Path | None = None  # main's --dump


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](...)`` compiles instead of launching."""

    def __init__(self, kernel, case, results):
        self.kernel, self.case, self.results = kernel, case, results

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            rec = {"case": self.case, "kernel": self.kernel.__name__, "grid": [int(g) for g in grid]}
            try:
                compiled = _compile(self.kernel, args, dict(kwargs))
                sass = _sass(compiled.asm["cubin"])
                rec.update(_ptxas_stats(compiled, sass))
                rec["ok"] = True
                if DUMP_DIR is not None:
                    stem = f"{self.case}.{len(self.results)}.{self.kernel.__name__}"
                    for ext in ("ttgir", "ptx"):
                        (DUMP_DIR / f"{stem}.{ext}").write_text(compiled.asm[ext])
                    (DUMP_DIR / f"{stem}.sass").write_text(sass)
            except Exception as e:  # report, keep compiling the others
                rec["ok"] = False
                root = e
                while root.__cause__ is not None:  # Triton nests one CompilationError per call level
                    root = root.__cause__
                rec["error"] = f"{type(e).__name__}: {str(e)[-1500:]}" + (f" | innermost: {str(root)[-1500:]}"
                                                                           if root is not e else "")
            self.results.append(rec)
        return launch


def _patch(case, results):
    from oscar_kernels import triton_decode, triton_extend, triton_materialize, triton_store
    saved = []
    for mod, name in ((triton_store, "_store_kernel"), (triton_decode, "_rotate_q_kernel"),
                      (triton_decode, "_decode_stage1"), (triton_decode, "_decode_merge_row"),
                      (triton_decode, "_decode_merge_split"),
                      (triton_extend, "_extend_kernel"), (triton_materialize, "_materialize_kernel")):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, _Recorder(getattr(mod, name), case, results))
    # the kernels as an sm_90 device builds them: decode launches with programmatic
    # dependent launch (pdl_supported is false for the CPU tensors used here)
    saved.append((triton_decode, "pdl_supported", triton_decode.pdl_supported))
    triton_decode.pdl_supported = lambda device: True
    return saved


def _unpatch(saved):
    for mod, name, k in saved:
        setattr(mod, name, k)


@dataclass(frozen=True)
class Case:
    """What one case launches: store, decode of ``decode_batch`` requests (the batch picks
    stage 1's tiles and the merge: DecodeConfig.stage1_tiles / merge_grid_for), extend with
    ``prefix_read``."""

    scenario: dict
    hq: int = 32
    decode_batch: int = 2
    prefix_read: str = "int2"


_G128 = dict(D=128, G=128, S=16, W=64, page=64)
_K32_V128 = dict(D=128, G=32, GV=128, S=16, W=64, page=64, scale_dtype=torch.float8_e4m3fn)
CASES = {
    # G = D at batch 2: 128-token steps uncapped, the split merge
    "g128": Case(_G128),
    # ... above batch 4: 64-token steps under the register cap, the query-head merge
    "g128_large_batch": Case(_G128, decode_batch=5),
    "g128_bf16_prefix": Case(_G128, prefix_read="bf16"),
    "g128_nobf16": Case(dict(D=128, G=128, S=0, W=0, page=64)),
    "g32": Case(dict(D=128, G=32, S=16, W=64, page=64)),
    "g64_d64": Case(dict(D=64, G=64, S=4, W=16, page=16), hq=16),
    "g8_gq1": Case(dict(D=128, G=8, S=4, W=16, page=16), hq=8),
    "g64_float8_scales": Case(dict(D=128, G=64, S=16, W=64, page=64, scale_dtype=torch.float8_e4m3fn)),
    # the default layout above batch 1 (3 stages, int64 slot offsets) and at batch 1 (2, int32)
    "k32_v128_float8_scales": Case(_K32_V128),
    "k32_v128_batch1": Case(_K32_V128, decode_batch=1),
}
_LENS = (70, 5, 33, 12, 90)


def run(case: str) -> list[dict]:
    from oscar_kernels import testing as kc
    from oscar_kernels.triton_decode import triton_decode
    from oscar_kernels.triton_extend import triton_extend
    from oscar_kernels.triton_store import triton_store
    spec = CASES[case]
    sc = kc.build(list(_LENS[:max(2, spec.decode_batch)]), H=8, fill=False, seed=0, **spec.scenario)
    h, d = sc.layer.num_kv_heads, sc.layer.head_dim
    results: list[dict] = []
    saved = _patch(case, results)
    try:
        t = 3
        k = torch.zeros(t, h, d, dtype=torch.bfloat16)
        idx = torch.zeros(t, dtype=torch.int64)
        triton_store(sc.layer, sc.index, sc.rotation, sc.req_to_token, k, k.clone(), idx, idx, idx, idx + 1,
                     rotated_out=(k.clone(), k.clone()))
        b = spec.decode_batch
        q = torch.zeros(b, spec.hq, d, dtype=torch.bfloat16)
        lens = torch.tensor(sc.lens, dtype=torch.int32)
        triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows[:b], lens[:b], sc.sm_scale)
        qe = torch.zeros(t, spec.hq, d, dtype=torch.bfloat16)  # two requests: 2 and 1 new tokens
        triton_extend(qe, k, k.clone(), sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows[:2], lens[:2],
                      torch.tensor([0, 2, 3], dtype=torch.int32), 2, sc.sm_scale,
                      prefix_read=spec.prefix_read, prefix_lens_host=sc.lens[:2])
    finally:
        _unpatch(saved)
    return results


def main(argv=None):
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("aot_sm90: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    ap.add_argument("--kernel", help="print only this kernel's records (e.g. _decode_stage1)")
    ap.add_argument("--opcodes", action="store_true", help="keep each loop's opcode histogram in the records")
    ap.add_argument("--dump", type=Path, metavar="DIR", help="write each kernel's TTGIR, PTX and SASS here")
    args = ap.parse_args(argv)
    global DUMP_DIR
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        DUMP_DIR = args.dump
    failed = 0
    for case in args.case or list(CASES):
        for rec in run(case):
            failed += not rec["ok"]
            if args.kernel and rec["kernel"] != args.kernel:
                continue
            if not args.opcodes:
                for loop in rec.get("loops", []):
                    loop.pop("opcodes")
            print(json.dumps(rec), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
