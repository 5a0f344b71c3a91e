"""KV capacity: ``max_total_num_tokens`` of SGLang for BF16, FP8 (e4m3) and OSCAR INT2 KV
caches at the same memory budget, on a shape-only model (``--load-format dummy``).

One server per KV dtype, identical arguments except ``--kv-cache-dtype``
(``--mem-fraction-static 0.88 --page-size 64 --load-format dummy``); the figure is the one
the server reports in ``/server_info`` (else the scheduler's ``max_total_num_tokens=`` log
line). The oscar server needs a rotations file for the shape: a data-free ``hadamard``
file is written for it (capacity depends on the file's shape, group sizes and scale dtype
only, not on its values; calibration needs real weights).

    python -m benchmarks.capacity            # .device/shapes/qwen3-8b-shape on the GPU machine
    python -m benchmarks.capacity --dtypes oscar_int2 --group-size 32 --value-group-size 128 \
        --scale-dtype float8_e4m3fn          # keys G=32, values G=128, float8 scales

writes benchmarks/results/capacity_qwen3-8b-shape.json
({"bf16": n, "fp8_e4m3": n, "oscar_int2": n, "meta": {...}}) after every server, and the
server logs to benchmarks/results/capacity_logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import time

from benchmarks.server_harness import ROOT, Server, log, run_script, save_json
from oscar_kernels.contract.layout import DEFAULT_SCALE_DTYPE, SCALE_DTYPES  # torch-free: --help needs no torch

DTYPES = ("bf16", "fp8_e4m3", "oscar_int2")


def default_shape(name: str = "qwen3-8b-shape") -> str:
    for cand in (os.path.join(ROOT, ".device", "shapes", name),
                 os.path.join(os.path.dirname(ROOT), "shared", "shapes", name)):
        if os.path.isfile(os.path.join(cand, "config.json")):
            return cand
    return os.path.join(ROOT, ".device", "shapes", name)


def shape_rotations_name(model_name: str, group_size: int, value_group_size: int | None = None,
                         scale_dtype: str = "float16") -> str:
    """File name of the data-free hadamard file: ``<model>.hadamard.g<G>[.v<G_V>][.<dtype>].safetensors``
    (today's name when values share the keys' group size and scales are float16)."""
    vg = "" if value_group_size in (None, group_size) else f".v{value_group_size}"
    sd = "" if scale_dtype == "float16" else f".{scale_dtype}"
    return f"{model_name}.hadamard.g{group_size}{vg}{sd}.safetensors"


def write_shape_rotations(model_dir: str, out: str, group_size: int, value_group_size: int | None = None,
                          scale_dtype: str = "float16") -> str:
    """A data-free hadamard rotations file for the model's attention shape (keys in groups of
    ``group_size``, values of ``value_group_size``, default the same; ``scale_dtype`` scales)."""
    from calibration.fidelity.baseline_rotations import baseline_rotations
    from oscar_kernels.contract.model_shape import ModelShape
    from oscar_kernels.contract.rotations_file import save_rotations

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        shape = ModelShape.from_hf_config(json.load(f))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_rotations(out, baseline_rotations(shape, os.path.basename(os.path.normpath(model_dir)),
                                           "hadamard", group_size, value_group_size, scale_dtype))
    return out


def write_generated_rotations(args, model_name: str) -> str:
    """The data-free hadamard file of args.model at the layout of ``args`` (resolve_layout
    first), written under the temp folder with its shape_rotations_name."""
    import tempfile

    out = os.path.join(tempfile.gettempdir(), "oscar-capacity",
                       shape_rotations_name(model_name, args.group_size, args.value_group_size, args.scale_dtype))
    write_shape_rotations(args.model, out, args.group_size, args.value_group_size, args.scale_dtype)
    log(f"wrote the data-free hadamard rotations {out}")
    return out


def add_layout_args(ap: argparse.ArgumentParser) -> None:
    """--group-size / --value-group-size / --scale-dtype: the INT2 layout of the data-free file
    written when --rotations is not given (resolve_layout fills in what is left open)."""
    ap.add_argument("--group-size", type=int, default=None,
                    help="keys' group size of the generated file (default: oscar-calibrate's, head_dim / 4)")
    ap.add_argument("--value-group-size", type=int, default=None,
                    help="values' group size of the generated file (default: oscar-calibrate's, "
                         "min(128, head_dim), or --group-size when that is given)")
    ap.add_argument("--scale-dtype", default=DEFAULT_SCALE_DTYPE, choices=SCALE_DTYPES,
                    help="scale dtype of the generated file (keys and values; default oscar-calibrate's)")


def resolve_layout(args) -> None:
    """Fill in the generated file's group sizes from the model's head_dim (oscar-calibrate's
    defaults, oscar_kernels.contract.layout.KVLayout.resolve) where the arguments leave them open."""
    from oscar_kernels.contract.layout import KVLayout
    from oscar_kernels.contract.model_shape import ModelShape

    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        head_dim = ModelShape.from_hf_config(json.load(f)).head_dim
    layout = KVLayout.resolve(head_dim, args.group_size, args.value_group_size)
    args.group_size, args.value_group_size = layout.key_group_size, layout.value_group_size


def rotations_meta(args) -> dict:
    """What the results record of the oscar file's layout: the generated file's group sizes
    and scale dtype, or those read from --rotations."""
    if not args.rotations:
        return {"group_size": args.group_size,
                "value_group_size": args.value_group_size or args.group_size,
                "scale_dtype": args.scale_dtype}
    from oscar_kernels.contract.rotations_file import load_rotations

    m = load_rotations(args.rotations).meta
    return {"group_size": m.group_size, "value_group_size": m.value_group_size, "scale_dtype": m.scale_dtype}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_shape(), help="model folder (config + tokenizer)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.88)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"subset of {','.join(DTYPES)}")
    ap.add_argument("--rotations", default=None,
                    help="rotations file for oscar_int2 (default: write a hadamard one for the shape)")
    add_layout_args(ap)
    ap.add_argument("--server-args", default="", help="extra server arguments for every dtype")
    ap.add_argument("--baseline-backend", default="triton", help="attention backend of bf16/fp8 runs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "benchmarks", "results", "capacity_logs"))
    args = ap.parse_args(argv)
    t_all = time.time()
    name = os.path.basename(os.path.normpath(args.model))
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"capacity_{name}.json")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown dtype(s) {unknown}; choose from {DTYPES}")
    rotations = args.rotations
    if rotations is None:
        resolve_layout(args)
        if "oscar_int2" in dtypes:
            rotations = write_generated_rotations(args, name)
    common = ["--model-path", args.model, "--load-format", "dummy",
              "--mem-fraction-static", str(args.mem_fraction_static), "--page-size", str(args.page_size),
              *shlex.split(args.server_args)]
    result = {"meta": {"model": name, "mem_fraction_static": args.mem_fraction_static,
                       "page_size": args.page_size, "server_args": common, "rotations": rotations,
                       **rotations_meta(args),
                       "source": {}, "startup_s": {}}}
    try:
        import torch

        result["meta"]["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        pass
    for dtype in dtypes:
        extra = ["--kv-cache-dtype", dtype]
        if dtype == "oscar_int2":
            extra += ["--oscar-rotations", rotations]
        else:  # the stock default (FA3) is not in every sgl_kernel build; triton always is
            extra += ["--attention-backend", args.baseline_backend]
        server = Server(f"capacity-{dtype}", common + extra, args.log_dir)
        try:
            result["meta"]["startup_s"][dtype] = round(server.start(), 1)
            tokens, source = server.max_total_num_tokens()
        finally:
            server.stop()
        result[dtype] = tokens
        result["meta"]["source"][dtype] = source
        log(f"{dtype}: max_total_num_tokens = {tokens} ({source})")
        if "bf16" in result:
            result["meta"]["ratio_vs_bf16"] = {d: round(result[d] / result["bf16"], 3)
                                               for d in DTYPES if d in result}
        result["meta"]["wall_s"] = round(time.time() - t_all, 1)
        save_json(out, result)
    log(f"{json.dumps({d: result[d] for d in dtypes})} -> {out}")
    log(f"total wall time {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    run_script(main)
