"""Where stage 1's time goes: the default decode timed side by side with ablated builds of its
INT2 loop, each with a cold cache (as bench_kernels times it) and with an L2-resident one.

    python -m benchmarks.stage1_ablation --cases 8x65536,64x131072 --out OUT.json [--tag T]
    python -m benchmarks.stage1_ablation --sass      # CPU: sm_90 loop instructions per build

Builds (``ABLATIONS``): the kernels are compiled with a @triton.jit helper of
oscar_kernels.triton_hybrid_attn swapped for a cheaper one, so their numerics are wrong on
purpose: timing only, never a DecodeConfig (the production kernels are not touched):
  default         the shipped loop
  no_scale_loads  each (scale, min) pair computed from the slot index (two float ops) instead
                  of loaded, converted and moved into the score tiles' layout
  no_unpack       the packed code registers handed to the dots as they are (no LOP3 / shift
                  per 16-bit code pair)
  neither         both
Memory: besides the cold copies, each build is timed L2-resident (``--no-resident``: not):
every position of every request reads the slots of request 1's first RESIDENT_TOKENS
positions, one layer only (~2.4 MB of INT2 cache at 8 KV heads): the same
instruction stream with (nearly) no DRAM traffic, so cold / resident says how much of a
build's time memory adds.
Each build is a fresh JITFunction of the same kernel source compiled with the helper swapped,
into a Triton cache directory of its own that is deleted afterwards: the on-disk cache keys
do not see swapped helpers, so an ablated kernel written to the shared cache would be loaded
later by the production decode under the same key (seen in session 17: the CPU sm_90 report
of the shipped kernel read a cached no_unpack build).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from unittest import mock

import triton
import triton.language as tl

import oscar_kernels.triton_decode as td
import oscar_kernels.triton_hybrid_attn as tha
from benchmarks import bench_kernels as bk

RESIDENT_TOKENS = 4096


@triton.jit
def scales_from_slot(sc_ptr, slot, hoff, s_slot, g: tl.constexpr, mask, PAIR: tl.constexpr,
                     INTERP: tl.constexpr = False):
    """group_scales' signature, nothing loaded: scale 0.25 + slot 2^-20, min -0.5 - g slot 2^-22."""
    x = slot.to(tl.float32)
    return 0.25 + x * 9.5367431640625e-07, -0.5 - x * (g * 2.384185791015625e-07)


@triton.jit
def codes_as_they_are(x, i: tl.constexpr, MAGIC: tl.constexpr, INTERP: tl.constexpr, HALF: tl.constexpr):
    """unpack_pair's signature: the register of two int16 code pairs reinterpreted as two
    16-bit floats, twice (no instruction: ptxas drops the moves)."""
    if HALF:
        return tl.inline_asm_elementwise("mov.b32 $0, $2; mov.b32 $1, $2;", "=r,=r,r", [x],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $2; mov.b32 $1, $2;", "=r,=r,r", [x],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


ABLATIONS = {
    "default": {},
    "no_scale_loads": {"group_scales": scales_from_slot},
    "no_unpack": {"unpack_pair": codes_as_they_are},
    "neither": {"group_scales": scales_from_slot, "unpack_pair": codes_as_they_are},
}


@contextmanager
def ablated(name: str):
    """triton_hybrid_attn's helpers swapped per ABLATIONS[name] and triton_decode._decode_stage1
    replaced by a fresh JITFunction of the same source (its own compiled-kernel cache), compiled
    into a temporary TRITON_CACHE_DIR (never the shared one)."""
    with tempfile.TemporaryDirectory(prefix=f"oscar-ablation-{name}-") as tmp, ExitStack() as undo:
        undo.enter_context(mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": tmp}))
        for k, fn in ABLATIONS[name].items():
            undo.enter_context(mock.patch.object(tha, k, fn))
        fresh = triton.jit(do_not_specialize=["NS"])(td._decode_stage1.fn)
        undo.enter_context(mock.patch.object(td, "_decode_stage1", fresh))
        yield


def resident(sc):
    """The scenario with every request's positions mapped onto request 1's first
    RESIDENT_TOKENS slots (sinks and rings unchanged)."""
    r2t = sc.req_to_token.clone()
    cols = r2t.shape[1]
    src = r2t[1, :min(cols, RESIDENT_TOKENS)]
    reps = -(-cols // src.numel())
    r2t[1:, :] = src.repeat(reps)[:cols]
    return replace(sc, req_to_token=r2t)


def time_case(b: int, n: int, builds, use_resident: bool) -> list[dict]:
    from oscar_kernels import testing as kc
    import torch
    layout = bk.Layout()
    copies = bk.layout_copies(b, n, bk.l2_bytes(), layout)
    q = kc.random_q(copies[0], bk.HQ)
    sets = [("cold", copies)] + ([("resident", [resident(copies[0])])] if use_resident else [])
    out = []
    for name in builds:
        with ablated(name):
            for memory, scs in sets:
                rec = bk.sweep_record(f"{name} {memory}", {}, layout.key_group, scs, q, b, n)
                rec.update(build=name, memory=memory)
                out.append(rec)
    del copies, q, sets
    torch.cuda.empty_cache()
    return out


SASS_CASES = ("k32_v128_float8_scales", "k32_v128_shallow")  # tests/aot_sm90.py: deep / shallow pipeline


def sass_counts(builds, cases=SASS_CASES) -> list[dict]:
    """sm_90 stage-1 build of each ablation (tests/aot_sm90.py, no GPU): registers, spills,
    the INT2 loop's instructions and opcodes, for the deep (3 stages, int64) and shallow pipelines."""
    from oscar_kernels import aot_sm90
    out = []
    for name in builds:
        with ablated(name):  # one cache directory per build: its other kernels compile once
            recs = [(case, r) for case in cases for r in aot_sm90.run(case) if r["kernel"] == "_decode_stage1"]
        for case, r in recs:
            loops = r.get("loops", [])
            loop = loops[-1] if loops else {}  # the INT2 loop: the kernel's last (the BF16 side's comes first)
            out.append({"build": name, "case": case, "registers": r.get("registers"),
                        "spill_bytes": r.get("spill_bytes"), "loops": [x["instructions"] for x in loops],
                        "int2_loop_instructions": loop.get("instructions"),
                        "int2_loop_spills": loop.get("spill_instructions"),
                        "int2_loop_opcodes": loop.get("opcodes"), "ok": r["ok"], "error": r.get("error")})
            print(json.dumps({k: v for k, v in out[-1].items() if k != "int2_loop_opcodes"}), flush=True)
    return out


def plot(run: dict, path: Path) -> None:
    """Effective GB/s (int2_bytes_read / time) of every build per case, cold and resident
    side by side, with 0.7 x the run's copy bandwidth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [r for r in run["sweep"] if r.get("oscar_GBps")]
    cases = sorted({(r["batch"], r["context"]) for r in recs})
    bars = list(dict.fromkeys((r["build"], r["memory"]) for r in recs))
    width = 0.8 / max(1, len(bars))
    fig, ax = plt.subplots(figsize=(14, 6))
    for k, (build, memory) in enumerate(bars):
        got = {(r["batch"], r["context"]): r["oscar_GBps"] for r in recs if (r["build"], r["memory"]) == (build, memory)}
        xs = [i + (k - (len(bars) - 1) / 2) * width for i, c in enumerate(cases) if c in got]
        ax.bar(xs, [got[c] for c in cases if c in got], width, label=f"{build} ({memory})",
               hatch="//" if memory == "resident" else None, color=f"C{list(ABLATIONS).index(build)}",
               alpha=0.55 if memory == "resident" else 1.0)
    ax.set_xticks(range(len(cases)), [f"b{b}\n{n // 1024}k" for b, n in cases])
    if run.get("copy_GBps"):
        ax.axhline(0.7 * run["copy_GBps"], color="k", ls="--", lw=0.8, label="0.7 x copy")
    ax.set_ylabel("decode effective bandwidth (GB/s)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=4)
    fig.suptitle(f"{run.get('device', 'GPU')}: stage-1 INT2 loop ablations (timing only), cold vs L2-resident cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=bk.parse_cases, help="BxN,... (GPU timing)")
    ap.add_argument("--builds", default=",".join(ABLATIONS), help=f"comma-separated subset of {list(ABLATIONS)}")
    ap.add_argument("--no-resident", action="store_true", help="time the cold cache only")
    ap.add_argument("--sass", action="store_true", help="CPU: sm_90 loop statistics of each build instead")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    builds = [b for b in args.builds.split(",") if b]
    bad = [b for b in builds if b not in ABLATIONS]
    if bad:
        ap.error(f"unknown builds {bad}; choose from {list(ABLATIONS)}")
    if not args.sass and not args.cases:
        ap.error("give --cases (GPU timing) or --sass (offline statistics)")
    result = json.loads(args.out.read_text()) if args.out and args.out.exists() else {"runs": []}
    run = {"tag": args.tag, "builds": builds}
    result["runs"].append(run)
    if args.sass:
        run["sass"] = sass_counts(builds)
    else:
        import torch
        run["device"] = torch.cuda.get_device_name(0)
        run["copy_GBps"] = round(bk.copy_bandwidth(), 1)
        run["sweep"] = []
        for b, n in args.cases:
            run["sweep"] += time_case(b, n, builds, not args.no_resident)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        if run.get("sweep"):
            plot(run, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
