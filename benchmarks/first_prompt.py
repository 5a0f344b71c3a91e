"""A fresh oscar_int2 server's first long prompt against its second, and a fixed set of
greedy outputs (to compare two checkouts token for token).

Starts ``oscar-sglang serve`` on MODEL with ROTATIONS (``--chunked-prefill-size 1024
--page-size 64``), optionally with empty Triton / FlashInfer caches (``--fresh-caches``: what
a new machine compiles), then sends two different prompts of ``--prompt-tokens`` tokens (16
greedy tokens each) and times them, then the greedy set (prompts cut from the standard
library's test sources at fixed token offsets, 32 tokens each). The server's own log lines
for the start-up compile and the warm-up go into the JSON.

    python -m benchmarks.first_prompt --model M --rotations R --fresh-caches --out results.json
    python -m benchmarks.first_prompt ... --code /path/to/other/checkout  # serve that code

``--code``: the checkout whose ``sglang_ext`` / ``oscar_kernels`` the server imports (put in
front of this one on its PYTHONPATH); the JSON records its ``git describe`` when it has one.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

from benchmarks import server_harness as h

GREEDY_SET = ((60000, 40), (61000, 1500), (63000, 4000), (70000, 8000), (10000, 8000), (80000, 3000))
LOG_LINES = ("oscar: compiled the attention kernels", "oscar: warm-up prompts")


def corpus_ids(model: str, tokens: int) -> list[int]:
    """The first ``tokens`` token ids of the standard library's test sources (sorted paths)."""
    from transformers import AutoTokenizer

    from calibration.text_sources import read_texts, stdlib_test_files

    tok = AutoTokenizer.from_pretrained(model)
    ids: list[int] = []
    for text in read_texts(sorted(stdlib_test_files())):
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= tokens:
            return ids[:tokens]
    raise SystemExit(f"first_prompt: the standard library's tests hold only {len(ids)} tokens")


def generate(server, ids: list[int], max_new_tokens: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = server.post("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}})
    return r, time.perf_counter() - t0


def git_describe(path: str) -> str:
    """``git describe`` of the checkout at ``path`` (its folder name when it is not one)."""
    if not os.path.exists(os.path.join(path, ".git")):
        return os.path.basename(os.path.abspath(path))
    done = subprocess.run(["git", "-C", path, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or os.path.basename(os.path.abspath(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=h.default_model("tinylm-A"))
    ap.add_argument("--rotations", required=True)
    ap.add_argument("--code", default=h.ROOT, help="checkout to serve (default: this one)")
    ap.add_argument("--fresh-caches", action="store_true", help="empty Triton and FlashInfer caches")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--mem-fraction-static", default="0.5")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.model, args.rotations = os.path.abspath(args.model), os.path.abspath(args.rotations)  # the server's cwd is --code

    need = max(max(s + n for s, n in GREEDY_SET), 2 * args.prompt_tokens)
    ids = corpus_ids(args.model, need)
    env = {"PYTHONPATH": os.pathsep.join([os.path.abspath(args.code), h.plugin_env()["PYTHONPATH"]])}
    if args.fresh_caches:
        caches = tempfile.mkdtemp(prefix="first-prompt-caches-")
        env.update(TRITON_CACHE_DIR=os.path.join(caches, "triton"),
                   FLASHINFER_WORKSPACE_BASE=os.path.join(caches, "flashinfer"))
    log_dir = tempfile.mkdtemp(prefix="first-prompt-logs-")
    server = h.Server("oscar", ["--model-path", args.model, "--kv-cache-dtype", "oscar_int2",
                                "--oscar-rotations", args.rotations, "--chunked-prefill-size", "1024",
                                "--page-size", "64", "--mem-fraction-static", args.mem_fraction_static,
                                "--sampling-backend", "pytorch", "--log-level", "info"], log_dir, env=env,
                      cwd=os.path.abspath(args.code))
    ready = server.start()
    try:
        n = args.prompt_tokens
        _, first = generate(server, ids[:n], 16)
        _, second = generate(server, ids[n:2 * n], 16)
        greedy = []
        for start, length in GREEDY_SET:
            r, took = generate(server, ids[start:start + length], 32)
            greedy.append({"start": start, "len": length, "output_ids": r.get("output_ids"),
                           "text": r["text"], "s": round(took, 3)})
    finally:
        log = server.log_text()
        server.stop()
    lines = {key: [re.sub(r"\s+", " ", ln[ln.index(key):]).strip() for ln in log.splitlines() if key in ln]
             for key in LOG_LINES}
    h.save_json(args.out, {
        "what": f"oscar_int2 server on {os.path.basename(args.model.rstrip('/'))}: the first and the second "
                f"{n}-token prompt (different text, 16 greedy tokens each), then {len(GREEDY_SET)} greedy "
                "prompts (32 tokens); --chunked-prefill-size 1024 --page-size 64"
                + ("; empty Triton and FlashInfer caches" if args.fresh_caches else ""),
        "label": args.label, "code": git_describe(args.code), "fresh_caches": args.fresh_caches,
        "server_ready_s": round(ready, 1), "first_prompt_s": round(first, 3), "second_prompt_s": round(second, 3),
        "log_lines": lines,
        "greedy_outputs": greedy})
    h.log(f"first {n}-token prompt {first:.3f} s, second {second:.3f} s -> {args.out}")


if __name__ == "__main__":
    h.run_script(main)
