"""Soak test of a server: many concurrent long requests, shared prefixes, client aborts.

Per configuration (``--configs``, default ``oscar_int2,bf16,fp8_e4m3``; bf16 is the control
that shows how far batching alone moves greedy outputs, fp8_e4m3 the same for SGLang's own
lossy cache), one server on tinylm-A with a KV pool
smaller than the offered load (``--max-total-tokens``), so admission queues, the radix
cache evicts and decode may retract:

1. concurrent phase: ``--requests`` (>= 200) requests sent at once to ``/generate``, prompts
   of 1k-16k tokens of held-out code; half of them are one of ``--prefix-groups`` long
   shared prefixes plus a private suffix; ``--abort-frac`` (10%) are streamed and the
   client closes the connection after a few chunks (mid-stream); the others decode
   ``--max-new-tokens`` greedy tokens (ignore_eos);
2. the server must still answer ``/health_generate``; then it idles ``--idle-s`` seconds so
   SGLang's idle-time pool check runs (with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE,
   on by default, a leak raises in the scheduler and kills the server; otherwise it logs
   "memory leak detected", "KV double free" or "KV page use-after-free");
3. ``/flush_cache``, then the non-aborted requests again one at a time (sequential
   reference); their greedy outputs are compared token by token with the concurrent ones;
4. idle check again; the log is scanned for the leak messages and for tracebacks.

    python -m benchmarks.soak [--rotations FILE]

writes benchmarks/results/soak_tinylm-A.json (summary per configuration, "pass" = server up,
no leak / traceback, no failed request) and the logs to benchmarks/results/soak_logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.server_harness import (ROOT, Server, ServerDied, default_model, first_divergence, log,
                                       previous_entries, run_script, save_json)

CONFIGS = ("oscar_int2", "bf16", "fp8_e4m3")
# server arguments per configuration beyond the common ones; the controls use SGLang's triton
# backend: bf16 shows how far batching alone moves greedy outputs, fp8_e4m3 how far it moves
# them for a lossy cache whose chunked prefill also reads fresh BF16 inside a chunk
CONTROL_ARGS = {"bf16": ["--kv-cache-dtype", "bf16", "--attention-backend", "triton"],
                "fp8_e4m3": ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "triton"]}
LEAK_PATTERNS = ("memory leak detected", "KV double free", "KV page use-after-free")
ERROR_PATTERNS = ("Traceback (most recent call last)",)


def build_requests(stream: np.ndarray, n: int, context: int, max_new: int, groups: int,
                   abort_frac: float, seed: int) -> list[dict]:
    """Prompts from the held-out token stream: even indices share one of ``groups`` long
    prefixes; ``abort_frac`` of all requests (random) are aborted mid-stream."""
    rng = np.random.default_rng(seed)
    hi = context - max_new - 1

    def piece(k: int) -> list[int]:
        s = int(rng.integers(0, len(stream) - k))
        return stream[s:s + k].tolist()

    prefixes = [piece(int(rng.integers(4096, min(12288, hi - 512)))) for _ in range(groups)]
    aborted = set(rng.choice(n, size=max(1, round(abort_frac * n)), replace=False).tolist())
    reqs = []
    for i in range(n):
        if i % 2 == 0:
            g = (i // 2) % groups
            suffix = int(rng.integers(256, max(257, min(4096, hi - len(prefixes[g])))))
            ids, group = prefixes[g] + piece(suffix), g
        else:
            ids, group = piece(int(rng.integers(1024, hi))), None
        reqs.append({"idx": i, "input_ids": ids, "group": group, "abort": i in aborted,
                     "abort_after_chunks": int(rng.integers(1, 9))})
    return reqs


def _payload(req: dict, max_new: int, stream: bool) -> dict:
    return {"input_ids": req["input_ids"], "stream": stream,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}


def run_one(server: Server, req: dict, max_new: int, abort_max_new: int) -> dict:
    t0 = time.time()
    try:
        if req["abort"]:
            body = json.dumps(_payload(req, abort_max_new, True)).encode()
            http = urllib.request.Request(server.url + "/generate", data=body,
                                          headers={"Content-Type": "application/json"})
            chunks = 0
            with urllib.request.urlopen(http, timeout=900) as resp:
                for line in resp:
                    if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                        chunks += 1
                        if chunks >= req["abort_after_chunks"]:
                            break  # leaving the block closes the connection mid-stream
            return {"idx": req["idx"], "aborted_after": chunks, "s": time.time() - t0}
        out = server.post("/generate", _payload(req, max_new, False), timeout=900)
        return {"idx": req["idx"], "output_ids": out["output_ids"], "s": time.time() - t0}
    except Exception as e:  # recorded, the soak goes on
        return {"idx": req["idx"], "error": f"{type(e).__name__}: {e}"[:300], "s": time.time() - t0}


def flush_cache(server: Server, timeout: float = 120.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            urllib.request.urlopen(urllib.request.Request(server.url + "/flush_cache", data=b"", method="POST"),
                                   timeout=30).read()
            return True
        except Exception:
            time.sleep(2)
    return False


def scan_log(text: str) -> dict:
    """Leak messages, tracebacks, and the requests SGLang retracted when the pool ran out in
    decode (a retracted request is prefilled again: with oscar_int2 its outputs may move)."""
    lines = text.splitlines()
    leaks = [ln.strip()[:300] for ln in lines if any(p in ln for p in LEAK_PATTERNS)]
    errors = [i for i, ln in enumerate(lines) if any(p in ln for p in ERROR_PATTERNS)]
    return {"leak_messages": leaks[:20],
            "tracebacks": ["\n".join(lines[i:i + 12])[-1500:] for i in errors[:3]],
            "traceback_count": len(errors),
            "retracted_requests": sum(int(n) for n in re.findall(r"#retracted_reqs: (\d+)", text))}


def soak(name: str, server_args: list[str], reqs: list[dict], args) -> dict:
    summary = {"config": name, "server_args": server_args}
    server = Server(f"soak-{name}", server_args, args.log_dir)
    try:
        summary["startup_s"] = round(server.start(), 1)
        done = [0]
        lock = threading.Lock()

        def task(r):
            res = run_one(server, r, args.max_new_tokens, args.abort_max_new_tokens)
            with lock:
                done[0] += 1
                if done[0] % 25 == 0 or done[0] == len(reqs):
                    log(f"{name}: concurrent phase {done[0]}/{len(reqs)} finished")
            return res

        log(f"{name}: concurrent phase, {len(reqs)} requests at once "
            f"({sum(r['abort'] for r in reqs)} aborted mid-stream)")
        t0 = time.time()
        with ThreadPoolExecutor(len(reqs)) as ex:
            concurrent = list(ex.map(task, reqs))
        summary["concurrent_wall_s"] = round(time.time() - t0, 1)
        summary["health_generate_after_concurrent"] = server.get("/health_generate", timeout=120) is not None
        log(f"{name}: concurrent phase took {summary['concurrent_wall_s']} s; idling {args.idle_s} s")
        time.sleep(args.idle_s)
        summary["alive_after_concurrent"] = server.alive()

        keep = [r for r in reqs if not r["abort"]]
        summary["flushed"] = flush_cache(server) if server.alive() else False
        log(f"{name}: sequential reference, {len(keep)} requests one at a time")
        t0 = time.time()
        sequential = {}
        for k, r in enumerate(keep):
            sequential[r["idx"]] = run_one(server, r, args.max_new_tokens, args.abort_max_new_tokens)
            if (k + 1) % 45 == 0:
                log(f"{name}: sequential {k + 1}/{len(keep)}")
        summary["sequential_wall_s"] = round(time.time() - t0, 1)
        time.sleep(args.idle_s)
        summary["health_generate_at_end"] = server.get("/health_generate", timeout=120) is not None
        summary["alive_at_end"] = server.alive()
    finally:
        server.stop()

    errors = [c for c in concurrent if "error" in c] + [s for s in sequential.values() if "error" in s]
    compared = [(c, sequential[c["idx"]]) for c in concurrent
                if "output_ids" in c and "output_ids" in sequential.get(c["idx"], {})]
    mismatches = []
    for c, s in compared:
        k = first_divergence(c["output_ids"], s["output_ids"])
        if k >= 0:
            r = reqs[c["idx"]]
            mismatches.append({"idx": c["idx"], "first_divergent_token": k, "prompt_len": len(r["input_ids"]),
                               "shared_prefix_group": r["group"]})
    summary.update({
        "requests": len(reqs), "aborted": sum(r["abort"] for r in reqs),
        "aborted_mid_stream": sum(1 for c in concurrent if "aborted_after" in c),
        "shared_prefix_requests": sum(r["group"] is not None for r in reqs),
        "prompt_tokens_total": sum(len(r["input_ids"]) for r in reqs),
        "prompt_len_min_max": [min(len(r["input_ids"]) for r in reqs), max(len(r["input_ids"]) for r in reqs)],
        "completed_concurrent": sum(1 for c in concurrent if "output_ids" in c),
        "errors": [e["error"] for e in errors][:10], "error_count": len(errors),
        "compared": len(compared), "exact_equal": len(compared) - len(mismatches),
        "all_equal": bool(compared) and not mismatches and len(compared) == len(keep),
        "mismatches": mismatches[:20],
        **scan_log(server.log_text()), "server_log": server.log_path,
    })
    summary["note"] = ("pass = robustness (server up, no leak message, no traceback, no failed request); "
                       "greedy equality is reported apart: batching and the chunk split of a prompt "
                       "(chunks share the prefill budget) may move greedy outputs, see the bf16 control")
    summary["pass"] = bool(summary.get("alive_at_end") and summary.get("health_generate_at_end")
                           and summary.get("health_generate_after_concurrent")
                           and not summary["leak_messages"] and not summary["traceback_count"]
                           and not errors)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model("tinylm-A"))
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--rotations", default=None,
                    help="rotations file for oscar_int2 (default: a data-free hadamard file)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--context", type=int, default=16384, help="longest prompt + output")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--abort-max-new-tokens", type=int, default=512)
    ap.add_argument("--prefix-groups", type=int, default=4)
    ap.add_argument("--abort-frac", type=float, default=0.10)
    ap.add_argument("--max-total-tokens", type=int, default=262144,
                    help="KV pool size: below the offered load, so queueing/eviction happen")
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--idle-s", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="",
                    help="extra server arguments, one string (write --server-args=--flag ... when it starts with --)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "soak_tinylm-A.json"))
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "benchmarks", "results", "soak_logs"))
    args = ap.parse_args(argv)
    if args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    t_all = time.time()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if any(c not in CONFIGS for c in configs):
        raise SystemExit(f"--configs: choose from {CONFIGS}")

    from transformers import AutoTokenizer

    from calibration.fidelity import tasks

    tok = AutoTokenizer.from_pretrained(args.model)
    stream = tasks.load_heldout_stream(tok).tokens
    reqs = build_requests(stream, args.requests, args.context, max(args.max_new_tokens, args.abort_max_new_tokens),
                          args.prefix_groups, args.abort_frac, args.seed)
    log(f"{len(reqs)} requests, {sum(len(r['input_ids']) for r in reqs)} prompt tokens")
    rotations = args.rotations
    if "oscar_int2" in configs and rotations is None:
        import tempfile

        from benchmarks.capacity import write_shape_rotations

        rotations = write_shape_rotations(args.model, os.path.join(tempfile.gettempdir(), "oscar-soak",
                                                                   "hadamard.safetensors"), 32)
        log(f"wrote the data-free hadamard rotations {rotations}")
    common = ["--model-path", args.model, "--chunked-prefill-size", str(args.chunked_prefill_size),
              "--max-total-tokens", str(args.max_total_tokens), *shlex.split(args.server_args)]
    result = {"model": os.path.basename(os.path.normpath(args.model)), "rotations": rotations,
              "settings": {k: getattr(args, k) for k in ("requests", "context", "max_new_tokens",
                                                        "abort_max_new_tokens", "prefix_groups", "abort_frac",
                                                        "max_total_tokens", "chunked_prefill_size", "seed")},
              "configs": {}}
    result["configs"] = previous_entries(args.out, result, "configs", configs)
    for name in configs:
        extra = CONTROL_ARGS.get(name) or ["--kv-cache-dtype", "oscar_int2", "--oscar-rotations", rotations]
        try:
            s = soak(name, common + extra, reqs, args)
        except ServerDied as e:
            s = {"config": name, "pass": False, "server_died": str(e)[-3000:], "leak_messages": [],
                 "traceback_count": None, "error_count": None, "exact_equal": 0, "compared": 0}
        result["configs"][name] = s
        result["wall_s"] = round(time.time() - t_all, 1)
        save_json(args.out, result)
        log(f"{name}: pass={s['pass']} alive={s.get('alive_at_end')} leaks={len(s['leak_messages'])} "
            f"tracebacks={s['traceback_count']} errors={s['error_count']} retracted={s.get('retracted_requests')} "
            f"greedy equal {s['exact_equal']}/{s['compared']} -> {args.out}")
    log(f"total wall time {time.time() - t_all:.0f} s")
    return 0 if all(s["pass"] for s in result["configs"].values()) else 1


if __name__ == "__main__":
    run_script(main)
