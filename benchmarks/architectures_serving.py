"""Serve every row of calibration/architectures.py on the GPU: oscar_int2 against BF16 (issue 30).

Per row (rows run side by side, each its own servers):
1. a model folder with the row's real attention geometry, 2 layers and seeded HF-initialised
   weights (``architectures.build_model_dir``: random but not tiny, so attention patterns and
   logits are spread like a real model's, unlike ``--load-format dummy``'s +-1e-3 weights);
2. its rotations: ``oscar-calibrate`` on that folder (the standard library's source);
3. a BF16 server (triton attention, no CUDA graphs) and an oscar_int2 server (defaults: S = 16,
   W = 128, decode CUDA graphs), both ``--chunked-prefill-size 1024 --page-size 64``, and checks:
   - ``graphs``: the oscar server captured its decode CUDA graphs (SGLang's log line);
   - ``windows``: four prompts of 40-110 tokens + 24 greedy tokens (inside S + W, where OSCAR
     attends BF16 copies of the rotated keys): OSCAR's tokens equal BF16's, or leave them once
     at a BF16 near-tie (top two within NEAR_TIE nats) taking BF16's runner-up;
   - ``long``: a 6,000-token prompt (six prefill chunks reading an INT2 history) + 32 tokens;
   - ``concurrent``: 16 requests at once (300-3,000 tokens, 32 tokens each) all complete.
   A row whose geometry the kernels cannot serve must be refused at start-up in one line (the
   oscar server exits; its last log line is kept): verdict ``refused``. The exit status is 0
   when every row passed, or was refused where sglang_ext.refusals says it must be.

    python -m benchmarks.architectures_serving [--only NAME,...] [--parallel 8] \
        [--out benchmarks/results/architectures_serving.json]

Servers use ``--max-total-tokens`` (not the memory fraction) for their pools, so that several
can start on one GPU at the same time.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from transformers import AutoTokenizer  # here, not in the row threads: its lazy import races

from benchmarks import server_harness as h
from calibration import architectures as archs

NEAR_TIE = 0.1  # nats between BF16's first and second choice
WINDOW_PROMPTS = ((0, 40), (500, 64), (1100, 90), (2000, 110))  # (offset, tokens) in the text
GREEDY_TOKENS = 24
LONG_PROMPT = 6000
CONCURRENT = [(3000 + 997 * i, 300 + 180 * i) for i in range(16)]  # 300 .. 3000 tokens
COMMON = ["--chunked-prefill-size", "1024", "--page-size", "64", "--mem-fraction-static", "0.9",
          "--max-total-tokens", "65536", "--max-running-requests", "32", "--sampling-backend", "pytorch",
          "--log-level", "info"]
GRAPH_LINE = re.compile(r"Capture target decode CUDA graph end[^\n]*")


def build(name: str, root: str) -> str:
    """The row's model folder (in a worker process: transformers builds it on the CPU)."""
    return archs.build_model_dir(name, os.path.join(root, name))


def text_ids(model_dir: str, tokens: int) -> list[int]:
    from calibration.text_sources import read_texts, shuffled, stdlib_test_files

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for text in read_texts(shuffled(stdlib_test_files(), 0)):
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= tokens:
            return ids[:tokens]
    return ids


def generate(server, ids: list[int], max_new_tokens: int, top: bool = False) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                  "ignore_eos": True}}
    if top:
        body.update(return_logprob=True, top_logprobs_num=5)
    return server.post("/generate", body)


def greedy(server, ids: list[int]) -> tuple[list[int], list[dict]]:
    """(token ids, per position {token id: logprob} of the top five)."""
    meta = generate(server, ids, GREEDY_TOKENS, top=True)["meta_info"]
    tokens = [int(t[1]) for t in meta["output_token_logprobs"]]
    tops = [{int(c[1]): float(c[0]) for c in pos} for pos in meta["output_top_logprobs"]]
    return tokens, tops


def serve_row(name: str, model_dir: str, work: str) -> dict:
    arch = archs.get(name)
    row = {"name": name, "family": arch.family, "source": arch.source, "architecture": arch.architecture,
           "geometry": arch.geometry, "features": list(arch.features)}
    t0 = time.monotonic()
    rot = os.path.join(work, f"{name}.oscar.safetensors")
    done = subprocess.run([sys.executable, "-m", "calibration.cli", "--model", model_dir, "--out", rot,
                           "--device", "cuda", "--tokens", "16384", "--seq-len", "1024", "--quiet"],
                          capture_output=True, text=True, cwd=h.ROOT)
    row["calibrate"] = {"rc": done.returncode, "s": round(time.monotonic() - t0, 1),
                        "error": done.stderr.strip().splitlines()[-1] if done.returncode else None}
    if done.returncode:
        row["verdict"] = f"fail: oscar-calibrate: {row['calibrate']['error']}"
        return row
    h.log(f"{name}: calibrated in {row['calibrate']['s']} s")
    ids = text_ids(model_dir, max(o + n for o, n in CONCURRENT) + LONG_PROMPT)
    logs = os.path.join(work, "logs")
    oscar = h.Server(f"{name}-oscar", ["--model-path", model_dir, "--kv-cache-dtype", "oscar_int2",
                                       "--oscar-rotations", rot, "--cuda-graph-max-bs-decode", "16", *COMMON], logs)
    bf16 = h.Server(f"{name}-bf16", ["--model-path", model_dir, "--attention-backend", "triton",
                                     "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph", *COMMON], logs)
    with ThreadPoolExecutor(1) as starter:  # the reference starts beside the oscar server
        bf16_ready = starter.submit(bf16.start)
        try:
            try:
                row["oscar_ready_s"] = round(oscar.start(), 1)
            except h.ServerDied:
                lines = [ln for ln in oscar.log_text().splitlines() if ln.strip()]
                refusal = next((ln for ln in reversed(lines) if ln.startswith("oscar-sglang: ")), None)
                row["oscar_start"] = refusal or "\n".join(lines[-5:])
                row["verdict"] = f"refused: {refusal}" if refusal else "fail: the oscar server died (see oscar_start)"
                return row
            graph = GRAPH_LINE.search(oscar.log_text())
            row["graphs"] = graph.group(0) if graph else None
            windows = [greedy(oscar, ids[o:o + n]) for o, n in WINDOW_PROMPTS]
            t = time.monotonic()
            long_out = generate(oscar, ids[:LONG_PROMPT], 32)
            row["long"] = {"prompt_tokens": LONG_PROMPT, "output_tokens": len(long_out["output_ids"]),
                           "s": round(time.monotonic() - t, 2)}
            with ThreadPoolExecutor(len(CONCURRENT)) as pool:
                outs = list(pool.map(lambda on: generate(oscar, ids[on[0]:on[0] + on[1]], 32), CONCURRENT))
            row["concurrent"] = {"requests": len(CONCURRENT),
                                 "completed": sum(len(o["output_ids"]) == 32 for o in outs)}
            oscar.stop()
            row["bf16_ready_s"] = round(bf16_ready.result(), 1)
            reference = [greedy(bf16, ids[o:o + n]) for o, n in WINDOW_PROMPTS]
        finally:
            oscar.stop()
            bf16.stop()
    row["windows"] = []
    for (o, n), (got, _), (want, want_top) in zip(WINDOW_PROMPTS, windows, reference):
        verdict = h.agree_up_to_a_near_tie(got, want, want_top, NEAR_TIE)
        row["windows"].append({"prompt_tokens": n, "first_divergence": h.first_divergence(got, want),
                               "agree": verdict is None, "why": verdict})
    problems = [p for p, bad in (
        ("no decode CUDA graph capture in the log", not row["graphs"]),
        ("greedy tokens differ from BF16 inside the windows", not all(w["agree"] for w in row["windows"])),
        ("long prompt incomplete", row["long"]["output_tokens"] != 32),
        ("concurrent requests incomplete", row["concurrent"]["completed"] != len(CONCURRENT))) if bad]
    row["verdict"] = "pass" if not problems else "fail: " + "; ".join(problems)
    row["s"] = round(time.monotonic() - t0, 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--parallel", type=int, default=9, help="rows served at the same time")
    ap.add_argument("--out", default=os.path.join(h.ROOT, "benchmarks", "results", "architectures_serving.json"))
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or [a.name for a in archs.ARCHITECTURES]
    for n in names:
        archs.get(n)  # an unknown name: one line before anything starts
    import torch

    work = tempfile.mkdtemp(prefix="architectures-serving-")
    with ProcessPoolExecutor(min(args.parallel, len(names))) as pool:
        dirs = dict(zip(names, pool.map(build, names, [work] * len(names))))
    h.log(f"built {len(dirs)} model folders in {work}")
    head = {"what": "each calibration/architectures.py row (real attention geometry, 2 layers, seeded random "
                    "weights) served by SGLang 0.5.17 with --kv-cache-dtype oscar_int2 (defaults: S 16, W 128, "
                    "decode CUDA graphs) against BF16 (triton attention); --chunked-prefill-size 1024 --page-size 64",
            "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "host": platform.node(),
            "checks": {"windows": f"{len(WINDOW_PROMPTS)} prompts of 40-110 tokens + {GREEDY_TOKENS} greedy "
                                  f"tokens: equal to BF16 up to one near-tie ({NEAR_TIE} nats)",
                       "long": f"{LONG_PROMPT}-token prompt + 32 tokens",
                       "concurrent": f"{len(CONCURRENT)} requests of 300-3000 tokens at once, 32 tokens each",
                       "graphs": "decode CUDA graphs captured"}}
    rows, lock = [], threading.Lock()

    def one(name: str) -> None:
        try:
            row = serve_row(name, dirs[name], work)
        except Exception as e:  # a row that breaks is a result, not the end of the matrix
            row = {"name": name, "verdict": f"fail: {type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        h.log(f"{name}: {row['verdict']}")
        with lock:  # saved after every row: a run cut short keeps what finished
            rows.append(row)
            h.save_json(args.out, {**head, "rows": sorted(rows, key=lambda r: names.index(r["name"]))})

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(one, names))
    from sglang_ext.refusals import kernel_head_dim_problem

    def as_expected(r: dict) -> bool:  # refused only where the start-up rule says it must be
        refusable = kernel_head_dim_problem(archs.get(r["name"]).head_dim) is not None
        return r["verdict"].startswith("refused") if refusable else r["verdict"] == "pass"

    return 0 if all(as_expected(r) for r in rows) else 1


if __name__ == "__main__":
    h.run_script(main)
