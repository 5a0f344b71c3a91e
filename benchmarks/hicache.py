"""HiCache host tier, oscar_int2 against BF16, on a shape-only model (``--load-format dummy``):
prefix tokens the host holds at the same host memory, and time to first token of a long
prefix hit loaded from host against the same prefix recomputed (and hit on the device).

One server per KV cache, identical arguments except the KV cache's own:
``--enable-hierarchical-cache --hicache-size H`` (GB of host memory, the same for both)
``--max-total-tokens D`` (a device pool of ~1.3 prefixes) ``--page-size 64
--chunked-prefill-size 8192 --load-format dummy``; bf16 keeps SGLang's HiCache defaults (io
backend kernel, layout page_first; --attention-backend triton as in capacity.py), oscar_int2
runs --hicache-io-backend direct, the one io backend its cells go through (layout
layer_first by default: a load copies whole host runs per layer, page_first_direct copies
per page), with capacity.py's data-free hadamard rotations for the shape.

Host tier: the tokens SGLang's host pool holds, from its start-up line ("Allocating kv
hierarchical KV host pool: N tokens, X GB host memory"), and the bytes per token.

Time to first token (a request with max_new_tokens 1, greedy; prompts are random token ids,
each rep its own prefix of --prefix-tokens and 32-token suffixes), per rep after /flush_cache:
the prefix computed from nothing (recompute), then two other prompts of the same length
(also recomputes) that push it off the device (write-through has backed it up), then the
prefix with a new suffix (host: its pages load back from host), then once more (device).
Every timed request's ``meta_info.cached_tokens_details`` (device / host tokens) is recorded,
so a host figure whose prefix did not come wholly from host shows as such.

    python -m benchmarks.hicache                    # .device/shapes/qwen3-8b-shape, both configs
    python -m benchmarks.hicache --configs oscar_int2 --reps 3

writes benchmarks/results/hicache_<model>.json after every config (a run of one config keeps
the other's entry when the settings match), server logs to benchmarks/results/hicache_logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import time

from benchmarks.capacity import (add_layout_args, default_shape, resolve_layout, rotations_meta,
                                 write_generated_rotations)
from benchmarks.server_harness import ROOT, Server, log, previous_entries, run_script, save_json

CONFIGS = ("bf16", "oscar_int2")
SUFFIX = 32
HOST_POOL_LINE = re.compile(r"Allocating (\S+) hierarchical KV host pool: (\d+) tokens, ([0-9.]+) GB host memory")


def config_args(config: str, args, rotations: str | None) -> list[str]:
    if config == "bf16":
        return ["--kv-cache-dtype", "bf16", "--attention-backend", args.baseline_backend,
                "--hicache-io-backend", args.bf16_io_backend, "--hicache-mem-layout", args.bf16_mem_layout]
    return ["--kv-cache-dtype", "oscar_int2", "--oscar-rotations", rotations, "--hicache-io-backend", "direct",
            "--hicache-mem-layout", args.oscar_mem_layout]


def host_pool(server: Server) -> dict:
    """SGLang's start-up line for the host pool: tokens it holds and its bytes."""
    found = HOST_POOL_LINE.findall(server.log_text())
    if not found:
        raise RuntimeError(f"{server.name}: no 'hierarchical KV host pool' line in the server log")
    _, tokens, gb = found[-1]
    return {"tokens": int(tokens), "gb": float(gb), "bytes_per_token": round(float(gb) * 1e9 / int(tokens), 1)}


def first_token(server: Server, ids: list[int]) -> dict:
    """Seconds to the one generated token of ``ids`` and where its cached prefix came from."""
    t0 = time.perf_counter()
    r = server.post("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}}, timeout=1800)
    took = time.perf_counter() - t0
    meta = r["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {"s": round(took, 4), "cached": meta["cached_tokens"], "device": details.get("device", meta["cached_tokens"]),
            "host": details.get("host", 0)}


def measure(server: Server, args, vocab: int) -> dict:
    """The reps of recompute / host hit / device hit (module doc)."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    out = {"recompute": [], "host": [], "device": []}
    for rep in range(args.reps):
        if server.get("/flush_cache") is None:
            raise RuntimeError(f"{server.name}: /flush_cache refused (server not idle)")
        prefix = prompt(args.prefix_tokens)
        out["recompute"].append(first_token(server, prefix + prompt(SUFFIX)))
        time.sleep(args.settle)  # its write-through backup lands before the next prompt needs room
        for _ in range(2):  # other prompts of the same length: the prefix leaves the device
            out["recompute"].append(first_token(server, prompt(args.prefix_tokens + SUFFIX)))
            time.sleep(args.settle)
        out["host"].append(first_token(server, prefix + prompt(SUFFIX)))
        out["device"].append(first_token(server, prefix + prompt(SUFFIX)))
        log(f"{server.name} rep {rep}: recompute {out['recompute'][-3]['s']:.2f} s, host hit "
            f"{out['host'][-1]['s']:.2f} s ({out['host'][-1]['host']} tokens from host), device hit "
            f"{out['device'][-1]['s']:.2f} s")
    summary = {f"{k}_median_s": round(statistics.median(r["s"] for r in v), 4) for k, v in out.items()}
    return {"ttft": out, **summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_shape(), help="model folder (config + tokenizer)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--hicache-size", type=int, default=48,
                    help="GB of host memory for the host tier, both configs (bf16 must hold 3 prompts)")
    ap.add_argument("--prefix-tokens", type=int, default=100_000)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="device pool tokens (default 1.3 x the prompt, page-rounded: one prompt fits, two do not)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--rotations", default=None,
                    help="rotations file for oscar_int2 (default: write a hadamard one for the shape)")
    add_layout_args(ap)
    ap.add_argument("--baseline-backend", default="triton", help="attention backend of the bf16 run")
    ap.add_argument("--bf16-io-backend", default="kernel", help="bf16 --hicache-io-backend (SGLang's default)")
    ap.add_argument("--bf16-mem-layout", default="page_first", help="bf16 --hicache-mem-layout (SGLang's default)")
    ap.add_argument("--oscar-mem-layout", default="layer_first", choices=("layer_first", "page_first_direct"),
                    help="oscar_int2 --hicache-mem-layout (layer_first: a load copies whole host runs)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds after each recompute, for its write-through backup (~15 GB for 100k BF16 "
                         "tokens; the node stays locked on the device until it is on host)")
    ap.add_argument("--server-args", default="", help="extra server arguments for every config")
    ap.add_argument("--out", default=None)
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "benchmarks", "results", "hicache_logs"))
    args = ap.parse_args(argv)
    t_all = time.time()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {CONFIGS}")
    name = os.path.basename(os.path.normpath(args.model))
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"hicache_{name}.json")
    prompt_tokens = args.prefix_tokens + SUFFIX
    page = args.page_size
    device_tokens = args.max_total_tokens or -(-int(1.3 * prompt_tokens) // page) * page
    if device_tokens < prompt_tokens + page or device_tokens >= 2 * args.prefix_tokens:
        raise SystemExit(f"--max-total-tokens {device_tokens} must hold one {prompt_tokens}-token prompt "
                         f"and not two prefixes")
    rotations = args.rotations
    if rotations is None:
        resolve_layout(args)
        if "oscar_int2" in configs:
            rotations = write_generated_rotations(args, name)
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        vocab = int(json.load(f)["vocab_size"])
    common = ["--model-path", args.model, "--load-format", "dummy", "--page-size", str(page),
              "--chunked-prefill-size", str(args.chunked_prefill_size), "--max-total-tokens", str(device_tokens),
              "--enable-hierarchical-cache", "--hicache-size", str(args.hicache_size),
              *shlex.split(args.server_args)]
    settings = {"server_args": common, "prefix_tokens": args.prefix_tokens, "suffix_tokens": SUFFIX,
                "reps": args.reps, "seed": args.seed, "bf16_io_backend": args.bf16_io_backend,
                "bf16_mem_layout": args.bf16_mem_layout, "oscar_mem_layout": args.oscar_mem_layout,
                **rotations_meta(args)}
    result = {"model": name, "settings": settings}
    result["configs"] = previous_entries(out, result, "configs", configs)
    try:
        import torch

        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        pass
    for config in configs:
        server = Server(f"hicache-{config}", common + config_args(config, args, rotations), args.log_dir)
        try:
            entry = {"startup_s": round(server.start(), 1), "host_pool": host_pool(server),
                     "max_total_num_tokens": server.max_total_num_tokens()[0]}
            entry.update(measure(server, args, vocab))
        finally:
            server.stop()
        result["configs"][config] = entry
        log(f"{config}: host tier {entry['host_pool']['tokens']} tokens "
            f"({entry['host_pool']['bytes_per_token']} B/token), TTFT recompute {entry['recompute_median_s']} s, "
            f"host hit {entry['host_median_s']} s, device hit {entry['device_median_s']} s")
        done = result["configs"]
        if all(c in done for c in CONFIGS):
            o, b = done["oscar_int2"], done["bf16"]
            result["ratio_oscar_vs_bf16"] = {
                "host_tokens": round(o["host_pool"]["tokens"] / b["host_pool"]["tokens"], 3),
                **{f"{k}_ttft": round(o[f"{k}_median_s"] / b[f"{k}_median_s"], 3)
                   for k in ("recompute", "host", "device") if b[f"{k}_median_s"] > 0}}
        result["wall_s"] = round(time.time() - t_all, 1)
        save_json(out, result)
    log(f"-> {out}; total wall time {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    run_script(main)
