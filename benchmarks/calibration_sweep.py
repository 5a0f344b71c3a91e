"""Sweep rotation recipes / variants / clip methods with the per-layer proxy.

Collects the calibration statistics once, builds every configuration from them, saves the
rotations files, and measures them all on the same held-out windows with
:mod:`calibration.proxy`. Writes ``benchmarks/results/calibration_proxy*.json``.

    nice python -m benchmarks.calibration_sweep --model ../shared/models/tinylm-A \
        --tokens 65536 --eval-data stdlib-tests --out-dir /tmp/sweep
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from calibration import text_sources
from calibration.calibrate import (CalibrationConfig, build_rotations, collect_stats, load_model,
                                   o_proj_weights)
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from calibration.proxy import format_table, run_proxy
from oscar_kernels.contract.rotations_file import save_rotations

# (name, recipe, variant, clip, objective, group size)
CONFIGS = [
    ("naive", "naive", "U-H", "none", "mse", 128),
    ("naive+clip", "naive", "U-H", "channel", "attn", 128),
    ("hadamard", "hadamard", "U-H", "none", "mse", 128),
    ("hadamard+clip", "hadamard", "U-H", "channel", "attn", 128),
    ("U", "oscar", "U", "none", "mse", 128),
    ("U-P", "oscar", "U-P", "none", "mse", 128),
    ("U-H", "oscar", "U-H", "none", "mse", 128),
    ("U-H-P", "oscar", "U-H-P", "none", "mse", 128),
    ("P-H-Ut", "oscar", "P-H-Ut", "none", "mse", 128),
    ("U-H+clip-layer-mse", "oscar", "U-H", "layer", "mse", 128),
    ("U-H+clip-head-mse", "oscar", "U-H", "head", "mse", 128),
    ("U-H+clip-channel-mse", "oscar", "U-H", "channel", "mse", 128),
    ("U-H+clip-layer-attn", "oscar", "U-H", "layer", "attn", 128),
    ("U-H+clip-head-attn", "oscar", "U-H", "head", "attn", 128),
    ("U-H+clip-channel-attn", "oscar", "U-H", "channel", "attn", 128),
    ("g32/hadamard", "hadamard", "U-H", "none", "mse", 32),
    ("g32/U-H-P", "oscar", "U-H-P", "none", "mse", 32),
    ("g32/U-Hblock-P", "oscar", "U-Hblock-P", "none", "mse", 32),
    ("g32/U-P-Hblock", "oscar", "U-P-Hblock", "none", "mse", 32),
    ("g32/U-P-Hblock+clip-channel-attn", "oscar", "U-P-Hblock", "channel", "attn", 32),
    ("g32/U-H-P+clip-channel-attn", "oscar", "U-H-P", "channel", "attn", 32),
]


def eval_windows(tok, which: str, tokens: int, seq_len: int, seed: int):
    if which == "stdlib-tests":
        files = text_sources.stdlib_test_files()
    else:
        files = text_sources.expand_paths(which.split(","))
    texts = text_sources.read_texts(text_sources.shuffled(files, seed))
    return list(text_sources.token_stream(tok, texts, seq_len, tokens))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--eval-data", action="append", default=None,
                   help="'stdlib-tests' or comma-separated paths; repeatable")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--sink", type=int, default=0)
    p.add_argument("--recent", type=int, default=0)
    p.add_argument("--only", default=None, help="comma-separated config names")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--json", default="benchmarks/results/calibration_proxy.json")
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    configs = [c for c in CONFIGS if a.only is None or c[0] in a.only.split(",")]
    base = CalibrationConfig(tokens=a.tokens, seq_len=a.seq_len, clip="channel").resolved()
    model, tok = load_model(a.model, base.device, base.dtype)
    shape = ModelShape.from_hf_config(model.config)
    t0 = time.time()
    stats = collect_stats(model, tok, base)
    t_stats = time.time() - t0
    metric = o_proj_weights(model, shape.num_kv_heads, shape.head_dim)
    rots, build_s = {}, {}
    for name, recipe, variant, clip, objective, g in configs:
        cfg = CalibrationConfig(recipe=recipe, variant=variant, clip=clip, clip_objective=objective,
                                group_size=g, tokens=a.tokens, seq_len=a.seq_len).resolved()
        t = time.time()
        rots[name] = build_rotations(cfg, shape, os.path.basename(a.model.rstrip("/")), stats, metric)
        build_s[name] = round(time.time() - t, 2)
        save_rotations(os.path.join(a.out_dir, name.replace("/", "_") + ".safetensors"), rots[name])
    report = {"model": os.path.abspath(a.model), "calib_tokens": stats.tokens[0], "stats_seconds": round(t_stats, 1),
              "sink": a.sink, "recent": a.recent, "build_seconds": build_s,
              "bytes_per_token_per_head": {n: KVLayout(c[5], c[5], "float16").bytes_per_token_per_head(shape.head_dim)
                                           for n, c in zip(rots, configs)},
              "evals": {}}
    for which in a.eval_data or ["stdlib-tests"]:
        windows = eval_windows(tok, which, a.eval_tokens, a.seq_len, seed=1)
        res = run_proxy(model, windows, rots, sink=a.sink, recent=a.recent, device=base.device)
        print(f"== proxy on {which} ({sum(w.numel() for w in windows)} tokens, sink {a.sink}, recent {a.recent})")
        print(format_table(res), flush=True)
        report["evals"][which] = {"tokens": sum(w.numel() for w in windows), "results": res}
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
