"""Decode launch variants side by side on one GPU (cold L2, CUDA-graph replay), at the
default INT2 layout of bench_kernels (keys head_dim/4, values 128, float8 (scale, min)).

    python -m benchmarks.bench_stage1_variants --cases 8x65536,64x131072 \
        --variant default={} --variant slot_ahead=off='{"slot_ahead": false}' --out OUT.json

Each ``--variant NAME=JSON`` is a dict of DecodeConfig fields; every variant is timed on
the same layer copies of a case, one case after the other (bench_kernels.sweep_record).
``--storage head_major,slot_major`` times every variant on each storage order of the INT2
buffers (allocate_layer's head-major, and slot-major copies of the same data).
Results accumulate into OUT (an existing file is extended, its "runs" note kept)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import bench_kernels as bk
from oscar_kernels import testing as kc


def parse_variant(text: str) -> tuple[str, dict]:
    cut = text.find("={")  # names may hold "=" themselves (max_registers=168)
    name, config = (text[:cut], text[cut + 1:]) if cut > 0 else ("", "")
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME={{...}} (a JSON object)")
    try:
        kwargs = json.loads(config)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--variant {name}: {e}") from None
    return name, kwargs


STORAGES = ("head_major", "slot_major")


def parse_storage(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    bad = [t for t in names if t not in STORAGES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--storage {text!r}: expected a comma-separated subset of {STORAGES}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, type=bk.parse_cases, help="BxN,... (e.g. 8x65536,1x65536)")
    ap.add_argument("--variant", action="append", required=True, type=parse_variant, help="NAME=JSON, repeated")
    ap.add_argument("--storage", default="head_major", type=parse_storage,
                    help="INT2 storage orders to time, comma-separated: head_major (allocate_layer's), slot_major")
    ap.add_argument("--tag", default="", help="label of this run in OUT (e.g. the commit)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    result = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    run = {"tag": args.tag, "device": torch.cuda.get_device_name(0), "sweep": []}
    result["runs"].append(run)
    layout = bk.Layout()
    for b, n in args.cases:
        copies = bk.layout_copies(b, n, bk.l2_bytes(), layout)
        q = kc.random_q(copies[0], bk.HQ)
        for storage in args.storage:
            scs = copies if storage == "head_major" else [replace(s, layer=kc.slot_major(s.layer)) for s in copies]
            for name, kwargs in args.variant:
                label = name if args.storage == ["head_major"] else f"{storage} {name}"
                rec = bk.sweep_record(label, kwargs, layout.key_group, scs, q, b, n)
                rec["storage"] = storage
                run["sweep"].append(rec)
                args.out.write_text(json.dumps(result, indent=1))
            del scs
        del copies, q
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
