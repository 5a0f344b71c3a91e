"""Sweep the BF16 sink size S and recent window W with oscar-eval; fidelity vs memory.

    python -m benchmarks.fidelity_sweep --model DIR --method oscar=FILE [--method ...] \\
        --sinks 4,16,64 --recents 64,128,256 --out JSON -- [oscar-eval options]

bf16 runs once; every (S, W) runs each method through :func:`calibration.fidelity.cli.main`
with the options after ``--`` (chunk, windows, trials, lengths, device, threads...). The
JSON keeps every run's methods block and the memory each (S, W) costs:
ring = W BF16 tokens per running request, sink = S BF16 tokens per sequence (sink slot),
both also expressed in INT2 tokens of the same bytes (group sizes and scale dtype of the
first method).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import load_rotations

from calibration.fidelity import cli


def memory_costs(shape: ModelShape, group_size: int, scale_dtype: str, sink: int, recent: int,
                 value_group_size: int | None = None) -> dict:
    """Bytes of the BF16 side caches for the whole model (all layers, K and V); INT2 keys in
    groups of ``group_size``, values of ``value_group_size`` (default: the same)."""
    value_group_size = value_group_size or group_size
    bf16_token = shape.num_layers * shape.num_kv_heads * shape.head_dim * 2 * 2
    int2_token = shape.num_layers * shape.num_kv_heads * KVLayout(
        group_size, value_group_size, scale_dtype).bytes_per_token_per_head(shape.head_dim)
    return {"group_size": group_size, "value_group_size": value_group_size, "scale_dtype": scale_dtype,
            "bf16_bytes_per_token": bf16_token, "int2_bytes_per_token": int2_token,
            "ring_bytes_per_request": recent * bf16_token, "sink_bytes_per_sequence": sink * bf16_token,
            "ring_in_int2_tokens": round(recent * bf16_token / int2_token, 1),
            "sink_in_int2_tokens": round(sink * bf16_token / int2_token, 1)}


def format_table(result: dict) -> str:
    """One line per (S, W, method): metrics and their ratio to bf16, plus the BF16 memory."""
    bf = result["bf16"]
    keys = [k for k in bf if k.startswith("ppl_") and isinstance(bf[k], float)]
    lines = ["S    W    method          " + "  ".join(f"{k:>22}" for k in keys) + "   ring+sink (int2 tokens)"]
    for run in result["runs"]:
        mem = run["memory"]
        for name, m in run["methods"].items():
            cells = "  ".join(f"{m[k]:9.4f} ({m[k] / bf[k]:.4f}x)" for k in keys)
            lines.append(f"{run['sink']:<4} {run['recent']:<4} {name:<15} {cells}   "
                         f"{mem['ring_in_int2_tokens'] + mem['sink_in_int2_tokens']:.0f}")
    lines.append("bf16: " + ", ".join(f"{k} {bf[k]:.4f}" for k in keys))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--method", action="append", type=cli._method, required=True, metavar="NAME=FILE")
    ap.add_argument("--sinks", type=cli._int_list, default=[4, 16, 64])
    ap.add_argument("--recents", type=cli._int_list, default=[64, 128, 256])
    ap.add_argument("--out", required=True)
    ap.add_argument("eval_args", nargs=argparse.REMAINDER, help="-- then oscar-eval options")
    a = ap.parse_args(argv)
    extra = [x for x in a.eval_args if x != "--"]
    with open(os.path.join(a.model, "config.json")) as f:
        shape = ModelShape.from_hf_config(json.load(f))
    first = load_rotations(a.method[0][1]).meta
    methods = [x for n, p in a.method for x in ("--method", f"{n}={p}")]
    result = {"model": os.path.basename(os.path.normpath(a.model)), "eval_args": extra, "bf16": None, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        def run(args):
            out = os.path.join(tmp, "run.json")
            t0 = time.time()
            cli.main(["--model", a.model, *args, *extra, "--out", out])
            with open(out) as f:
                return json.load(f), round(time.time() - t0, 1)

        res, wall = run([])
        result["bf16"] = dict(res["methods"]["bf16"], wall_s=wall)
        result["settings"] = res["settings"]
        for s in a.sinks:
            for w in a.recents:
                res, wall = run(["--no-bf16", *methods, "--sink", str(s), "--recent", str(w)])
                result["runs"].append({"sink": s, "recent": w, "wall_s": wall,
                                       "memory": memory_costs(shape, first.group_size, first.scale_dtype, s, w,
                                                              first.value_group_size),
                                       "methods": res["methods"]})
                os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
                with open(a.out, "w") as f:
                    json.dump(result, f, indent=1)
    print(format_table(result))
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
