"""End-to-end serving benchmark of one model shape (random weights, ``--load-format dummy``).

For each configuration (bf16_triton, bf16_flashinfer, fp8_e4m3, oscar_int2) it starts ONE
SGLang server under the same memory budget (same --mem-fraction-static, page size,
context length, max running requests) and runs the requested phases against it:

- ``capacity``:   ``max_total_num_tokens`` as the server reports it (``/server_info``), and
                  ``concurrent_100k`` = how many requests of 100k input + the output tokens
                  fit in that pool at once (page-rounded; derived, not sent).
- ``decode``:     batch-1 decode latency at 32k / 64k / 128k input tokens: one request at a
                  time through ``sglang.benchmark.serving`` (random token ids); the figure is
                  the request's median inter-token latency, i.e. one decode step.
- ``throughput``: ``sglang.benchmark.serving``'s random-ids dataset, all requests at once
                  with ``--max-concurrency`` = as many as fit in the pool: output tokens/s
                  and TTFT / ITL / TPOT / E2E percentiles.

- ``steady_32k`` / ``steady_8k``: steady-state decode at the same memory budget (not in the
                  default phases; their own JSON, default ``e2e_decode_throughput_<model>.json``;
                  configurations bf16_flashinfer, fp8_e4m3, oscar_int2 unless --configs says
                  otherwise). As many requests (32k in / 2048 out, or the reasoning-style 8k in /
                  4k out) as fit in oscar_int2's pool, all sent at once; ``--max-running-requests``
                  defaults to that count (taken from oscar_int2's entry of the JSON when there is one,
                  else from the oscar_int2 pool of ``e2e_<model>.json`` at the same budget: an upper
                  bound, since more ring rows leave a smaller pool), so the pool, not the flag, limits
                  concurrency; ``--cuda-graph-max-bs-decode`` is the same, so every batch the pool
                  admits replays a graph. One server per configuration and workload, with
                  ``--enable-metrics``. Per configuration: requests in flight and decode tokens/s at
                  steady state (benchmarks/steady_decode.py: median of the scheduler's "Decode batch"
                  intervals that held decode steps only, at full concurrency) and end-to-end output
                  tokens/s (decode-token counter of /metrics over the window, and over the first
                  seconds that every configuration's window covers), and the ratios to
                  bf16_flashinfer. The window ends when every request is done or at ``--dt-window-s``
                  / the deadline, whichever is first (``bounded: true`` in the JSON; the client is
                  stopped then), so one configuration and workload fit one 10-minute call.
                  With ``--profile-steps N`` (issue 48, "where the step goes"), once the scheduler's
                  last two log intervals were decode-only at full concurrency (the same #running-req
                  at three "Decode batch" lines in a row, >= --dt-full-fraction x the largest so far),
                  the server's own profiler records N forward steps: POST /start_profile
                  {num_steps: N, activities: [CPU, GPU], output_dir: --log-dir, with_stack/record_shapes
                  false} (SGLang 0.5.17's ProfileReq; without start_step or profile_by_stage the
                  scheduler starts torch.profiler at once and stops it N steps later, writing
                  ``<cfg>.<workload>-TP-0.trace.json.gz`` and logging "Profiling done"; /stop_profile
                  if the workload ends first). CUDA graphs stay on: torch.profiler's CUDA activity is
                  CUPTI's kernel trace, which records each kernel a graph replays as its own kernel
                  event carrying the correlation id of the replay's cudaGraphLaunch (SGLang itself
                  neither turns graphs off for /start_profile nor needs to). benchmarks/decode_profile.py
                  turns the trace into ms per decode step by category (its docstring: steps bounded by
                  the graph replays); the breakdown is the entry's ``profile``; the decode intervals
                  that held profiled steps are left out of the steady figures.

Every measurement is merged into the JSON (``--out``) as soon as it exists, so a killed
run keeps what it measured; server and client logs go to ``--log-dir``; the server's
whole process group is stopped on exit, on error and on SIGTERM; ``--deadline-s`` bounds
the wall time of one invocation (whatever does not fit is recorded as skipped).

GPU machine (wheelhouse installed, .device/shapes carried). On two GPUs all four
configurations fit one call (two at a time, one server per GPU, same settings):

    export PYTHONPATH=/tmp/site:$PWD
    python3 -m benchmarks.e2e --gpus 0,1 --out $OUT/e2e_qwen3-8b-shape.json --log-dir $OUT/e2e_logs

On one GPU, one or two configurations per call (``--configs bf16_triton`` ...); results
accumulate in the JSON given to --out when it is copied there first (copy the JSON back
to benchmarks/results/ after each call). If a configuration's call runs out of time, split it:
``--phases capacity,decode`` and ``--phases throughput``. Here, afterwards:
``python3 -m benchmarks.e2e --plot-only`` and ``python3 -m benchmarks.report --write README.md``.

Steady-state decode, one configuration and workload per 10-minute call, oscar_int2 first (it
fixes the request count and --max-running-requests that the others reuse from the JSON; on a
fresh machine its first start compiles for minutes, so steady_8k, the shorter prefill, goes first;
``steady.full_intervals`` in the JSON says how many decode intervals the figure rests on):

    mkdir -p $OUT/logs; cp benchmarks/results/e2e_decode_throughput_qwen3-8b-shape.json $OUT/ 2>/dev/null
    python3 -m benchmarks.e2e --phases steady_32k --configs oscar_int2 \\
        --out $OUT/e2e_decode_throughput_qwen3-8b-shape.json --log-dir $OUT/logs

Where a steady decode step goes (issue 48): the same calls with ``--profile-steps 20``, one
configuration and workload per call (four calls; each re-measures its steady entry and adds the
profile; the trace comes back in $OUT/logs):

    mkdir -p $OUT/logs; cp benchmarks/results/e2e_decode_throughput_qwen3-8b-shape.json $OUT/ 2>/dev/null
    python3 -m benchmarks.e2e --phases steady_8k --configs oscar_int2 --profile-steps 20 \\
        --out $OUT/e2e_decode_throughput_qwen3-8b-shape.json --log-dir $OUT/logs
    python3 -m benchmarks.e2e --phases steady_8k --configs bf16_flashinfer --profile-steps 20 \\
        --out $OUT/e2e_decode_throughput_qwen3-8b-shape.json --log-dir $OUT/logs
    python3 -m benchmarks.e2e --phases steady_32k --configs oscar_int2 --profile-steps 20 \\
        --out $OUT/e2e_decode_throughput_qwen3-8b-shape.json --log-dir $OUT/logs
    python3 -m benchmarks.e2e --phases steady_32k --configs bf16_flashinfer --profile-steps 20 \\
        --out $OUT/e2e_decode_throughput_qwen3-8b-shape.json --log-dir $OUT/logs

(copy the JSON back to benchmarks/results/ after each call). Here, afterwards:
``python3 -m benchmarks.decode_profile --plot`` and ``python3 -m benchmarks.report --write
benchmarks/RESULTS.md`` (section ``decode-profile``).

A run longer than one call (say ``--dt-window-s 1500 --deadline-s 1600``, every request to
completion) starts detached in a first call that then only waits, and a second call, made at once
(before the machine goes idle), waits for it to end and collects what it wrote (the JSON holds
every measurement made so far at any time):

    mkdir -p /tmp/dt; setsid python3 -m benchmarks.e2e ... --out /tmp/dt/r.json --log-dir /tmp/dt/logs \\
        >/tmp/dt/run.log 2>&1 </dev/null & echo $! >/tmp/dt/pid; sleep 580
    while kill -0 $(cat /tmp/dt/pid) 2>/dev/null && [ $SECONDS -lt 560 ]; do sleep 5; done; \\
        cp /tmp/dt/r.json /tmp/dt/run.log $OUT/; tar -C /tmp/dt -czf $OUT/logs.tgz logs
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from benchmarks.capacity import (add_layout_args, resolve_layout, rotations_meta,
                                 shape_rotations_name, write_shape_rotations)  # the data-free file capacity.py uses
from benchmarks.server_harness import ROOT, Server, ServerDied, log
from benchmarks.steady_decode import metrics_sample, parse_scheduler_log, steady_state, tokens_by, window_rate
from benchmarks.targets import E2E_STEADY_DECODE_RATIO

HERE = os.path.dirname(os.path.abspath(__file__))

RESULTS = os.path.join(ROOT, "benchmarks", "results")

CONFIG_ORDER = ("bf16_triton", "bf16_flashinfer", "fp8_e4m3", "oscar_int2")
PHASES = ("capacity", "decode", "throughput")


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    label: str


# the steady-state decode workloads (their own phases and JSON; see the docstring)
WORKLOADS = {
    "steady_32k": Workload(32000, 2048, "long context: 32k input, 2048 output"),
    "steady_8k": Workload(8000, 4096, "reasoning-style: 8k input, 4k output"),
}
READY_LINE = "The server is fired up and ready to roll"  # SGLang 0.5.17's http_server, after its warm-up
STEADY_CONFIGS = ("bf16_flashinfer", "fp8_e4m3", "oscar_int2")
STEADY_REFERENCE = "bf16_flashinfer"  # the ratios' denominator


@dataclass(frozen=True)
class ServeConfig:
    name: str
    args: tuple[str, ...]
    oscar: bool = False
    label: str = ""


CONFIGS = {
    "bf16_triton": ServeConfig("bf16_triton", ("--attention-backend", "triton", "--kv-cache-dtype", "auto"),
                               label="BF16 KV, triton attention"),
    "bf16_flashinfer": ServeConfig("bf16_flashinfer",
                                   ("--attention-backend", "flashinfer", "--kv-cache-dtype", "auto"),
                                   label="BF16 KV, flashinfer attention"),
    "fp8_e4m3": ServeConfig("fp8_e4m3", ("--attention-backend", "triton", "--kv-cache-dtype", "fp8_e4m3"),
                            label="FP8 e4m3 KV (SGLang), triton attention"),
    # the server's defaults: prefill reads cached prefixes through FlashInfer (--oscar-extend-prefix
    # auto) since session 5; run 3 of e2e_qwen3-8b-shape.json timed oscar_int2 with the int2 read
    "oscar_int2": ServeConfig("oscar_int2", ("--kv-cache-dtype", "oscar_int2"), oscar=True,
                              label="OSCAR INT2 KV (+BF16 sink/recent), server defaults"),
    # not in the default set: the other prefix reads of prefill, to time against oscar_int2
    "oscar_int2_int2_prefix": ServeConfig("oscar_int2_int2_prefix",
                                          ("--kv-cache-dtype", "oscar_int2", "--oscar-extend-prefix", "int2"),
                                          oscar=True, label="OSCAR INT2 KV, prefill unpacks the INT2 prefix"),
    "oscar_int2_bf16_prefix": ServeConfig("oscar_int2_bf16_prefix",
                                          ("--kv-cache-dtype", "oscar_int2", "--oscar-extend-prefix", "bf16"),
                                          oscar=True, label="OSCAR INT2 KV, prefill reads the prefix as BF16"),
    "oscar_int2_flashinfer_prefix": ServeConfig(
        "oscar_int2_flashinfer_prefix", ("--kv-cache-dtype", "oscar_int2", "--oscar-extend-prefix", "flashinfer"),
        oscar=True, label="OSCAR INT2 KV, prefill: BF16 prefix through FlashInfer"),
}


def length_key(tokens: int) -> str:
    """32000 -> '32k' (the JSON key suffix of a decode length)."""
    return f"{tokens // 1000}k" if tokens % 1000 == 0 else str(tokens)


def page_round(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def requests_that_fit(max_total_num_tokens: int, input_len: int, output_len: int, page_size: int) -> int:
    """How many requests of input_len + output_len tokens the KV pool holds at once."""
    return max_total_num_tokens // page_round(input_len + output_len, page_size)


# ------------------------------------------------------------------------- results file


def load_results(path: str) -> dict:
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("configs", {}), dict):
            raise ValueError(f"{path}: not an e2e results file (no 'configs' mapping)")
        data.setdefault("configs", {})
        return data
    return {"configs": {}}


_SAVE_LOCK = threading.Lock()  # parallel workers (--gpus) share one results dict and file


def save_results(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def merge(data: dict, config: str, values: dict) -> dict:
    """Update one configuration's entry in place (nested dicts merged one level deep)."""
    entry = data["configs"].setdefault(config, {})
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(entry.get(k), dict):
            entry[k].update(v)
        else:
            entry[k] = v
    return data


# ------------------------------------------------------------------------- time budget


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def cap(self, seconds: float) -> float:
        """``seconds``, shortened to what is left (never below 1 s)."""
        return max(1.0, min(seconds, self.left()))


class OutOfTime(RuntimeError):
    pass


# ------------------------------------------------------------------------- commands


def server_args(cfg: ServeConfig, args, rotations: str | None, more: tuple[str, ...] = ()) -> list[str]:
    """The server arguments of one configuration; all but the KV dtype / attention backend
    (and the oscar rotations file) are the same for every configuration; ``more`` goes
    before --extra-server-args (which can override it)."""
    cmd = [
        "--model-path", args.model, "--load-format", "dummy",
        "--context-length", str(args.context_length),
        "--mem-fraction-static", str(args.mem_fraction_static),
        "--max-running-requests", str(args.max_running_requests),
        "--page-size", str(args.page_size),
        "--chunked-prefill-size", str(args.chunked_prefill_size),
        "--sampling-backend", "pytorch",
        *cfg.args,
    ]
    if cfg.oscar:
        if not rotations:
            raise ValueError("oscar_int2 needs a rotations file (--rotations)")
        cmd += ["--oscar-rotations", rotations]
    return cmd + list(more) + shlex.split(args.extra_server_args)


def bench_command(args, *, input_len: int, output_len: int, num_prompts: int, range_ratio: float,
                  concurrency: int, warmup: int, output_file: str) -> list[str]:
    return shlex.split(args.bench_serving) + [
        "--backend", "sglang", "--host", "127.0.0.1", "--port", str(args.port),
        "--model", args.model, "--tokenizer", args.model,
        "--dataset-name", "random-ids", "--tokenize-prompt",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", str(range_ratio), "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--warmup-requests", str(warmup), "--flush-cache",
        "--ready-check-timeout-sec", "0", "--disable-tqdm",
        "--output-file", output_file, "--seed", str(args.seed),
    ]


BENCH_KEYS = (
    "completed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
    "input_throughput", "request_throughput", "max_concurrent_requests",
    "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
    "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "mean_e2e_latency_ms", "median_e2e_latency_ms", "p90_e2e_latency_ms", "p99_e2e_latency_ms",
)


def read_bench_result(path: str) -> dict:
    """The metrics of the last record that ``sglang.benchmark.serving`` appended to ``path``."""
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: the benchmark wrote no result")
    rec = json.loads(lines[-1])
    out = {k: rec[k] for k in BENCH_KEYS if k in rec}
    errors = [e for e in rec.get("errors", []) if e]
    if errors:
        out["errors"] = sorted(set(str(e).strip().splitlines()[-1][:200] for e in errors))[:5]
    return out


def run_bench(args, deadline: Deadline, log_path: str, timeout: float, **kw) -> dict:
    out_file = log_path.replace(".log", ".jsonl")
    if os.path.exists(out_file):
        os.remove(out_file)
    cmd = bench_command(args, output_file=out_file, **kw)
    limit = deadline.cap(timeout)
    with open(log_path, "w", encoding="utf-8") as lf:
        lf.write("$ " + shlex.join(cmd) + "\n")
        lf.flush()
        try:  # the client is one process; run() kills it when the time is up
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=limit).returncode
        except subprocess.TimeoutExpired:
            raise OutOfTime(f"benchmark client still running after {limit:.0f} s (log {log_path})") from None
    if rc != 0 or not os.path.isfile(out_file):
        lines = open(log_path, encoding="utf-8", errors="replace").read().splitlines()[1:]  # [0]: the command
        raise RuntimeError(f"benchmark client exited {rc}: " + " | ".join(lines[-6:]) + f" (log {log_path})")
    return read_bench_result(out_file)


# ------------------------------------------------------------------------- phases


def phase_capacity(server: Server, args) -> dict:
    info = server.get("/server_info")
    info = info if isinstance(info, dict) else {}
    mtt, source = server.max_total_num_tokens()
    per_req = args.concurrent_input_len + args.concurrent_output_len
    res = {
        "max_total_num_tokens": int(mtt),
        "concurrent_100k": requests_that_fit(int(mtt), args.concurrent_input_len,
                                             args.concurrent_output_len, args.page_size),
        "capacity": {
            "concurrent_request_tokens": per_req,
            "page_size": args.page_size,
            "rule": "max_total_num_tokens // page_round(input + output)",
            "source": source,
            "max_running_requests": info.get("max_running_requests"),
            "max_req_input_len": info.get("max_req_input_len"),
            "kv_cache_dtype": info.get("kv_cache_dtype"),
            "attention_backend": info.get("attention_backend"),
        },
    }
    for k in ("oscar_rotations", "oscar_sink_tokens", "oscar_recent_window", "oscar_sink_slots"):
        if info.get(k) is not None:
            res["capacity"][k] = info[k]
    return res


def phase_decode(server: Server, args, deadline: Deadline, log_dir: str, name: str,
                 max_total: int | None, on_result) -> None:
    for i, n in enumerate(args.decode_lens):
        key = f"decode_ms_{length_key(n)}"
        need = page_round(n + args.decode_output_len, args.page_size)
        if max_total is not None and need > max_total:
            on_result({key: None, "decode": {key: {"skipped": f"{need} tokens > pool of {max_total}"}}})
            continue
        if n + args.decode_output_len > args.context_length:
            on_result({key: None, "decode": {key: {"skipped": f"longer than --context-length {args.context_length}"}}})
            continue
        if deadline.left() < 30:
            on_result({key: None, "decode": {key: {"skipped": "deadline"}}})
            continue
        log(f"  decode: batch 1, {n} input tokens, {args.decode_output_len} output tokens")
        t0 = time.monotonic()
        try:
            r = run_bench(args, deadline, os.path.join(log_dir, f"{name}.decode_{length_key(n)}.log"),
                          timeout=args.decode_timeout_s, input_len=n, output_len=args.decode_output_len,
                          num_prompts=1, range_ratio=1.0, concurrency=1,
                          warmup=1 if i == 0 else 0)
        except (RuntimeError, OSError, ValueError) as e:
            on_result({key: None, "decode": {key: {"error": str(e)[:500]}}})
            log(f"  decode {n}: FAILED: {str(e)[:300]}")
            continue
        ok = r.get("completed") == 1 and r.get("median_itl_ms")
        on_result({key: r["median_itl_ms"] if ok else None,
                   "decode": {key: {**r, "input_len": n, "output_len": args.decode_output_len,
                                    "wall_s": round(time.monotonic() - t0, 1)}}})
        log(f"  decode {n}: median ITL {r.get('median_itl_ms')} ms, TTFT {r.get('median_ttft_ms')} ms")


def throughput_concurrency(args, max_total: int | None) -> int:
    mean_in = int(args.tp_input_len * (1 + args.tp_range_ratio) / 2)
    fit = (requests_that_fit(max_total, mean_in, args.tp_output_len, args.page_size)
           if max_total else args.tp_num_prompts)
    return max(1, min(fit, args.max_running_requests, args.tp_num_prompts))


def phase_throughput(server: Server, args, deadline: Deadline, log_dir: str, name: str,
                     max_total: int | None) -> dict:
    conc = throughput_concurrency(args, max_total)
    settings = {"input_len": args.tp_input_len, "range_ratio": args.tp_range_ratio,
                "output_len": args.tp_output_len, "num_prompts": args.tp_num_prompts,
                "max_concurrency": conc, "dataset": "random-ids", "request_rate": "inf"}
    log(f"  throughput: {args.tp_num_prompts} prompts, {conc} in flight, "
        f"input {int(args.tp_input_len * args.tp_range_ratio)}-{args.tp_input_len}, output {args.tp_output_len}")
    r = run_bench(args, deadline, os.path.join(log_dir, f"{name}.throughput.log"),
                  timeout=args.throughput_timeout_s, input_len=args.tp_input_len,
                  output_len=args.tp_output_len, num_prompts=args.tp_num_prompts,
                  range_ratio=args.tp_range_ratio, concurrency=conc, warmup=1)
    log(f"  throughput: {r.get('output_throughput')} output tok/s, completed {r.get('completed')}")
    tok_s = r.get("output_throughput") if r.get("completed") else None
    # derived: what the in-flight requests decode per second between their first and last
    # tokens (prefill of the others included); the output tok/s above also counts the prefill
    tpot = r.get("median_tpot_ms")
    steady = round(conc * 1000.0 / tpot, 1) if tok_s and tpot else None
    return {"throughput_tok_s": tok_s, "steady_decode_tok_s": steady, "throughput": {**r, "settings": settings}}


# ------------------------------------------------------------------------- steady-state decode


def reference_pool(args) -> tuple[int, int | None, str] | None:
    """(oscar_int2's pool in tokens, the --max-running-requests it was measured at, where it
    comes from) of the e2e results file (--dt-reference) when it was measured at the same
    budget; None if not."""
    try:
        ref = load_results(args.dt_reference)
    except (OSError, ValueError):
        return None
    st = ref.get("settings", {})
    pool = ref["configs"].get("oscar_int2", {}).get("max_total_num_tokens")
    same = all(st.get(k) == getattr(args, k) for k in ("mem_fraction_static", "page_size", "context_length"))
    if not isinstance(pool, int) or not same:
        return None
    return pool, st.get("max_running_requests"), f"{os.path.basename(args.dt_reference)}: oscar_int2"


def steady_plan(data: dict, args, workload: str) -> dict:
    """Requests to send and --max-running-requests of one workload, the same for every
    configuration: oscar_int2's recorded values once it ran, else as many as fit in the
    reference oscar_int2 pool (an upper bound for the flag: more ring rows, smaller pool);
    the command line's --dt-num-prompts / --max-running-requests win."""
    w = WORKLOADS[workload]
    osc = data["configs"].get("oscar_int2", {}).get(workload, {})
    if osc.get("num_prompts") and osc.get("max_running_requests"):
        n, r, source = osc["num_prompts"], osc["max_running_requests"], "oscar_int2's entry of this file"
    else:
        ref = reference_pool(args)
        n = r = requests_that_fit(ref[0], w.input_len, w.output_len, args.page_size) if ref else None
        source = (f"requests that fit in {ref[0]} tokens ({ref[2]}, --max-running-requests {ref[1]})"
                  if ref else None)
    given = [f for f, v in (("--dt-num-prompts", args.dt_num_prompts), ("--max-running-requests",
                                                                        args.max_running_requests)) if v]
    if given:
        source = f"the command line's {' and '.join(given)}" + (f"; otherwise {source}" if len(given) == 1 else "")
    n, r = args.dt_num_prompts or n, args.max_running_requests or r
    if not n or not r:
        raise ValueError(f"no oscar_int2 pool known for {workload} at this budget (neither in {args.out} nor in "
                         f"{args.dt_reference}): run --configs oscar_int2 first, or give --max-running-requests "
                         f"and --dt-num-prompts")
    return {"num_prompts": int(n), "max_running_requests": int(r),
            "cuda_graph_max_bs": int(args.cuda_graph_max_bs or r), "source": source,
            "num_prompts_fixed": bool(args.dt_num_prompts or osc.get("num_prompts"))}


def steady_server_args(args, plan: dict) -> tuple[str, ...]:
    """What the steady-state workloads add to every configuration's server."""
    return ("--enable-metrics", "--decode-log-interval", str(args.dt_log_interval),
            "--cuda-graph-max-bs-decode", str(plan["cuda_graph_max_bs"]))


def common_window(entries: list[dict]) -> float | None:
    """The longest window every measured configuration of a workload covers (seconds from its
    first request) and its /metrics samples reach (the last sample can precede the window's end),
    so that their end-to-end rates compare over the same time."""
    spans = [min(e["window_s"], e["metrics_samples"][-1]["t"]) for e in entries if e.get("window_s")
             and e.get("metrics_samples") and e.get("metrics_start_tokens") is not None]
    return min(spans) if spans else None


def add_ratios(data: dict) -> dict:
    """Each configuration's steady figures over bf16_flashinfer's (and the end-to-end rate over
    the window all of them cover), and the target's verdict."""
    target = {"what": f"steady-state decode tokens/s of oscar_int2 >= {E2E_STEADY_DECODE_RATIO:g}x {STEADY_REFERENCE}",
              "ratio": E2E_STEADY_DECODE_RATIO}
    for workload in WORKLOADS:
        ref = data["configs"].get(STEADY_REFERENCE, {}).get(workload, {})
        entries = [e[workload] for e in data["configs"].values() if isinstance(e.get(workload), dict)]
        span = common_window(entries)
        for here in entries:
            made = (tokens_by(here["metrics_samples"], here["metrics_start_tokens"], span)
                    if span and here.get("metrics_samples") and here.get("metrics_start_tokens") is not None else None)
            here["e2e_common_window"] = {"window_s": span,
                                         "output_tok_s": round(made / span, 1) if made is not None else None}
        for here in entries:
            common = (ref.get("e2e_common_window") or {}).get("output_tok_s")
            mine = here["e2e_common_window"]["output_tok_s"]
            here[f"vs_{STEADY_REFERENCE}"] = {
                **{k: round(here[k] / ref[k], 3) if here.get(k) and ref.get(k) else None
                   for k in ("decode_tok_s", "e2e_output_tok_s", "in_flight")},
                "e2e_common_window": round(mine / common, 3) if mine and common else None}
        osc = data["configs"].get("oscar_int2", {}).get(workload, {})
        r = (osc.get(f"vs_{STEADY_REFERENCE}") or {}).get("decode_tok_s")
        if osc or ref:
            target[workload] = {"measured": r, "met": None if r is None else r >= E2E_STEADY_DECODE_RATIO}
    data["target"] = target
    return data


def _stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, to a client started in its own session."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue


PROFILE_DONE = "Profiling done"  # SGLang 0.5.17's SchedulerProfilerManager._stop_profile, once the trace is written


def at_full_concurrency(events: list[dict], full_fraction: float) -> int | None:
    """#running-req when the scheduler's last two log intervals were steady (decode steps only,
    the same #running-req at the three lines that bound them) at full concurrency (>= full_fraction
    x the largest #running-req so far); else None."""
    decodes = [e for e in events if e["kind"] == "decode"]
    last = events[-3:]
    if len(last) < 3 or any(e["kind"] != "decode" or e["running"] != last[0]["running"] for e in last):
        return None
    running = last[-1]["running"]
    return running if running > 0 and running >= full_fraction * max(e["running"] for e in decodes) else None


class StepProfile:
    """``--profile-steps N``: once the workload decodes at full concurrency, SGLang's own profiler
    (POST /start_profile with num_steps = N: the scheduler starts torch.profiler at once and stops
    it N forward steps later, writing ``<output_dir>/<profile_id>-TP-0.trace.json.gz``) records N
    decode steps, CUDA graphs on, as served; benchmarks/decode_profile.py reads the trace. The
    decode log intervals that held profiled steps are left out of the steady figures."""

    ACTIVITIES = ["CPU", "GPU"]  # CPU: the cudaGraphLaunch runtime events that bound the steps

    def __init__(self, server: Server, args, cfg: ServeConfig, workload: str):
        self.server, self.steps = server, args.profile_steps
        self.full_fraction = args.dt_full_fraction
        self.out_dir = os.path.abspath(args.log_dir)
        self.profile_id = f"{cfg.name}.{workload}"
        self.start = self.done = None  # positions in the log text since the workload began
        self.info: dict = {"requested_steps": self.steps}
        for f in self._traces():  # a trace of an earlier run would pass for this one
            os.remove(f)

    def _traces(self) -> list[str]:
        import glob

        return sorted(glob.glob(os.path.join(self.out_dir, f"{self.profile_id}-TP-*.trace.json*")))

    def poll(self, text: str, t: float) -> None:
        """Start the profile when the log ``text`` (since the workload began) shows full concurrency;
        note when the scheduler says the trace is written."""
        if self.start is None and "error" not in self.info:
            running = at_full_concurrency(parse_scheduler_log(text), self.full_fraction)
            if running is None:
                return
            payload = {"output_dir": self.out_dir, "num_steps": self.steps, "activities": self.ACTIVITIES,
                       "with_stack": False, "record_shapes": False, "profile_id": self.profile_id}
            try:
                self.server.post("/start_profile", payload, timeout=120)
            except OSError as e:  # urllib's HTTPError / URLError
                self.info["error"] = f"/start_profile: {e}"[:300]
                log(f"  profile: {self.info['error']}")
                return
            self.start = len(text)
            self.info.update(in_flight=running, started_s=round(t, 1), request=payload)
            log(f"  profile: {self.steps} steps at {running} in flight ({t:.0f} s into the workload)")
        elif self.start is not None and self.done is None:
            i = text.find(PROFILE_DONE, self.start)
            if i >= 0:
                self.done = text.find("\n", i) + 1 or len(text)

    def finish(self, offset: int, deadline: Deadline) -> dict:
        """Wait for the trace (stopping the profiler if the workload ended first) and parse it."""
        if self.start is None:
            return {**self.info, "error": self.info.get("error", "the workload never decoded at full concurrency")}
        t0 = time.monotonic()
        for stop_after in (30.0, None):  # no steps left to count: /stop_profile writes what it has
            while self.done is None and time.monotonic() - t0 < (stop_after or 90.0) and deadline.left() > 20:
                self.poll(self.server.log_text()[offset:], 0.0)
                time.sleep(1)
            if self.done is not None or stop_after is None or not self.server.alive():
                break
            try:
                self.server.post("/stop_profile", {}, timeout=60)
                self.info["stopped_by"] = "/stop_profile (the workload ended before the steps were counted)"
            except (OSError, ValueError) as e:
                self.info["stop_error"] = str(e)[:200]
        traces = self._traces()
        if not traces:
            return {**self.info, "error": f"no trace {self.profile_id}-TP-*.trace.json* in {self.out_dir}"}
        from benchmarks.decode_profile import breakdown, load_trace

        try:
            parsed = breakdown(load_trace(traces[0]))
        except (OSError, ValueError, KeyError, EOFError) as e:
            return {**self.info, "trace": os.path.basename(traces[0]), "error": f"trace: {e}"[:300]}
        log(f"  profile: {parsed['steps']} steps, {parsed['wall_ms_per_step']} ms per step "
            f"({os.path.basename(traces[0])})")
        return {**self.info, "trace": os.path.basename(traces[0]), **parsed,
                "source": "torch profiler through SGLang's /start_profile (CUDA graphs on, as served); "
                          "benchmarks/decode_profile.py"}

    def events(self, text: str) -> list[dict]:
        """The scheduler's log events with the profiled intervals left out: the lines logged while
        it ran become one marker, which no steady interval spans (the first line after it closes an
        interval that held profiled steps)."""
        if self.start is None:
            return parse_scheduler_log(text)
        after = parse_scheduler_log(text[self.done:]) if self.done is not None else []
        return parse_scheduler_log(text[:self.start]) + [{"kind": "profile"}] + after


def phase_steady(server: Server, args, deadline: Deadline, cfg: ServeConfig, workload: str, plan: dict) -> dict:
    """Send the workload at once, watch /metrics until every request is done or the window
    closes, then read the steady-state figures from the scheduler's log."""
    w = WORKLOADS[workload]
    pool, pool_source = server.max_total_num_tokens()
    fit = requests_that_fit(pool, w.input_len, w.output_len, args.page_size)
    n = plan["num_prompts"] if plan["num_prompts_fixed"] or not cfg.oscar else fit
    res = {"workload": asdict(w),
           "pool_tokens": int(pool), "pool_source": pool_source, "fit_in_pool": fit, "num_prompts": n,
           "max_running_requests": plan["max_running_requests"], "cuda_graph_max_bs": plan["cuda_graph_max_bs"],
           "plan_source": plan["source"], "flag_limits_concurrency": min(n, fit) > plan["max_running_requests"]}
    cap = deadline.left() - args.dt_stop_reserve_s
    if cap < 30:
        raise OutOfTime(f"{workload}: {cap:.0f} s left for the window")
    cap = min(cap, args.dt_window_s) if args.dt_window_s else cap
    log(f"  {workload}: {n} requests of {w.input_len} + {w.output_len} tokens at once; pool {pool} tokens holds "
        f"{fit}; window at most {cap:.0f} s")
    log_dir = args.log_dir
    client_log = os.path.join(log_dir, f"{cfg.name}.{workload}.client.log")
    out_file = client_log.replace(".log", ".jsonl")
    if os.path.exists(out_file):
        os.remove(out_file)
    cmd = bench_command(args, input_len=w.input_len, output_len=w.output_len, num_prompts=n, range_ratio=1.0,
                        concurrency=n, warmup=0, output_file=out_file)
    offset = len(server.log_text())
    first = server.get("/metrics")
    # a counter that /metrics does not list yet has counted nothing
    start_tokens = (metrics_sample(first, 0.0)["decode_tokens"] or 0.0) if isinstance(first, str) else None
    samples = []
    prof = StepProfile(server, args, cfg, workload) if args.profile_steps else None
    t0 = time.monotonic()
    with open(client_log, "w", encoding="utf-8") as lf:
        lf.write("$ " + shlex.join(cmd) + "\n")
        lf.flush()
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None
                text = server.get("/metrics", timeout=10)
                if isinstance(text, str):
                    samples.append(metrics_sample(text, time.monotonic() - t0))
                if prof is not None:
                    prof.poll(server.log_text()[offset:], time.monotonic() - t0)
                if done or time.monotonic() - t0 >= cap or not server.alive():
                    break
                time.sleep(args.dt_poll_s)
        finally:
            bounded = proc.poll() is None
            if bounded:
                _stop_group(proc)
    wall = time.monotonic() - t0
    if not server.alive():
        raise ServerDied(f"{server.name}: server exited during {workload}; last log lines:\n{server.log_tail()}")
    client = None
    if not bounded:
        try:
            client = read_bench_result(out_file) if proc.returncode == 0 else None
        except (OSError, ValueError):
            client = None
        if client is None:
            lines = open(client_log, encoding="utf-8", errors="replace").read().splitlines()[1:]
            res["client_error"] = f"client exited {proc.returncode}: " + " | ".join(lines[-6:])[:500]
    if prof is not None:
        res["profile"] = prof.finish(offset, deadline)
    text = server.log_text()[offset:]
    steady = steady_state(prof.events(text) if prof is not None else parse_scheduler_log(text), args.dt_full_fraction)
    window = window_rate(samples, start_tokens)
    step = max(1, len(samples) // 200)
    res.update({
        "in_flight": steady.get("in_flight"), "decode_tok_s": steady.get("decode_tok_s"),
        "e2e_output_tok_s": window["e2e_output_tok_s"],
        "bounded": bounded, "window_s": round(wall, 1), "window_cap_s": round(cap, 1),
        "metrics_start_tokens": start_tokens,
        "completed": client.get("completed") if client else None,
        "steady": steady, "window": window, "client": client,
        "metrics_samples": samples[::step],
        "sources": {"decode_tok_s": "scheduler log: median gen throughput of the 'Decode batch' intervals with "
                                    "decode steps only, at full concurrency (benchmarks/steady_decode.py)",
                    "in_flight": "scheduler log: median #running-req of those intervals",
                    "e2e_output_tok_s": "/metrics sglang:realtime_tokens_total{mode=decode} over the window, "
                                        "from the first request sent (first tokens, made by prefill, not counted)"},
    })
    log(f"  {workload}: {steady.get('in_flight')} in flight, steady decode {steady.get('decode_tok_s')} tok/s, "
        f"e2e {window['e2e_output_tok_s']} tok/s over {wall:.0f} s{' (bounded)' if bounded else ''}")
    return res


def run_steady(cfg: ServeConfig, workload: str, args, deadline: Deadline, data: dict, rotations: str | None,
               gpu: str | None = None) -> None:
    """One steady-state workload of one configuration on its own server."""
    def record_here(values: dict) -> None:
        record(args.out, data, cfg.name, values, finish=add_ratios)

    record_here({"label": cfg.label})
    error = None
    server = None
    t0 = time.monotonic()
    try:
        with _SAVE_LOCK:  # the plan may reuse this entry's earlier values; then the entry starts afresh
            plan = steady_plan(data, args, workload)
            data["configs"].setdefault(cfg.name, {})[workload] = {}
        sargs = copy.copy(args)
        sargs.max_running_requests = plan["max_running_requests"]
        server = make_server(cfg, sargs, rotations, env=None if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu},
                             more=steady_server_args(args, plan), name=f"{cfg.name}.{workload}.server")
        record_here({workload: {"server_cmd": shlex.join(server.cmd), "server_log": server.log_path, "gpu": gpu,
                                "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}})
        ready_s = server.start(timeout=deadline.cap(args.server_timeout_s))
        record_here({workload: {"server_ready_s": round(ready_s, 1)}})
        record_here({workload: phase_steady(server, args, deadline, cfg, workload, plan)})
    except (ServerDied, OutOfTime, RuntimeError, OSError, ValueError) as e:
        error = str(e)[:2000]
        log(f"{cfg.name} {workload}: FAILED: {str(e)[:600]}")
    finally:
        if server is not None:
            server.stop()
        record_here({workload: {"wall_s": round(time.monotonic() - t0, 1)}, "errors": {workload: error}})


def recover_steady(args) -> int:
    """Record the steady figures of one configuration and workload from its server log, for a run
    whose process was lost before it wrote them: the scheduler's lines after the server was ready
    give the steady figures; the /metrics window lived in the lost process, so the end-to-end
    rates stay None."""
    if not args.steady or len(args.phases) != 1 or len(args.configs) != 1:
        raise SystemExit("e2e: --from-server-log takes one steady-state phase and one configuration")
    try:
        text = open(args.from_server_log, encoding="utf-8", errors="replace").read()
    except OSError as e:
        raise SystemExit(f"e2e: cannot read the server log {args.from_server_log}: {e.strerror}")
    ready = text.find(READY_LINE)
    if ready < 0:
        raise SystemExit(f"e2e: {args.from_server_log} has no '{READY_LINE}' line: not a ready server's log")
    steady = steady_state(parse_scheduler_log(text[ready:]), args.dt_full_fraction)
    if not steady.get("full_intervals"):
        raise SystemExit(f"e2e: {args.from_server_log} holds no steady decode interval at full concurrency")
    workload, name = args.phases[0], args.configs[0]
    w = WORKLOADS[workload]
    # the scheduler logs its pool and request limit once at start-up
    sizes = {k: int(m.group(1)) for k in ("max_total_num_tokens", "max_running_requests")
             if (m := re.search(rf"\b{k}=(\d+)", text))}
    pool = sizes.get("max_total_num_tokens")
    fit = requests_that_fit(pool, w.input_len, w.output_len, args.page_size) if pool else None
    data = load_results(args.out)
    record(args.out, data, name, {"label": CONFIGS[name].label, "errors": {workload: None}, workload: {
        "workload": asdict(w), "pool_tokens": pool, "pool_source": "server log", "fit_in_pool": fit,
        "max_running_requests": sizes.get("max_running_requests"),
        **({"num_prompts": fit} if CONFIGS[name].oscar else {}),  # oscar_int2 sends what fits (phase_steady)
        "in_flight": steady["in_flight"], "decode_tok_s": steady["decode_tok_s"],
        "e2e_output_tok_s": None, "steady": steady,
        "recovered_from_server_log": os.path.basename(args.from_server_log),
        "sources": {"decode_tok_s": "scheduler log (benchmarks/steady_decode.py), recovered with --from-server-log: "
                                    "the run's process was lost, so its /metrics window is not known"}}},
           finish=add_ratios)
    log(f"{name} {workload}: {steady['in_flight']} in flight, steady decode {steady['decode_tok_s']} tok/s "
        f"({steady['full_intervals']} intervals) from {args.from_server_log}")
    return 0


# ------------------------------------------------------------------------- driver


def make_server(cfg: ServeConfig, args, rotations: str | None, env: dict | None = None,
                more: tuple[str, ...] = (), name: str | None = None) -> Server:
    server = Server(name or f"{cfg.name}.server", server_args(cfg, args, rotations, more), args.log_dir,
                    port=args.port, env=env)
    if args.launcher:  # another launcher (tests use a stand-in); same arguments
        server.cmd = shlex.split(args.launcher) + server.cmd[server.cmd.index("serve") + 1:]
    return server


def record(path: str, data: dict, config: str, values: dict, finish=None) -> None:
    """Merge one configuration's values (then ``finish(data)``, if given) and write the file
    (safe from parallel workers)."""
    with _SAVE_LOCK:
        merge(data, config, values)
        if finish is not None:
            finish(data)
        save_results(path, data)


def run_config(cfg: ServeConfig, args, deadline: Deadline, data: dict, rotations: str | None,
               gpu: str | None = None) -> None:
    """All requested phases of one configuration on one server (pinned to ``gpu`` if given)."""
    def record_here(values: dict) -> None:
        record(args.out, data, cfg.name, values)

    server = make_server(cfg, args, rotations, env=None if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu})
    record_here({"label": cfg.label, "server_cmd": shlex.join(server.cmd), "server_log": server.log_path,
            "gpu": gpu, "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    # one entry per part run now; None = it went fine (clears an earlier run's error)
    errors = {"server": None, **{p: None for p in args.phases}}
    try:
        ready_s = server.start(timeout=deadline.cap(args.server_timeout_s))
        record_here({"server_ready_s": round(ready_s, 1)})
        cap = phase_capacity(server, args)
        max_total = cap["max_total_num_tokens"]
        if "capacity" in args.phases:
            record_here(cap)
            log(f"{cfg.name}: max_total_num_tokens={max_total}, concurrent_100k={cap['concurrent_100k']}")
        if "decode" in args.phases:
            phase_decode(server, args, deadline, args.log_dir, cfg.name, max_total, record_here)
        if "throughput" in args.phases:
            if deadline.left() < 60:
                errors["throughput"] = "skipped: deadline"
            else:
                try:
                    record_here(phase_throughput(server, args, deadline, args.log_dir, cfg.name, max_total))
                except (RuntimeError, OSError, ValueError) as e:
                    errors["throughput"] = str(e)[:500]
                    log(f"{cfg.name}: throughput FAILED: {str(e)[:300]}")
    except (ServerDied, OutOfTime, RuntimeError, OSError, ValueError) as e:
        errors["server"] = str(e)[:2000]
        log(f"{cfg.name}: FAILED: {str(e)[:600]}")
    finally:
        server.stop()
        record_here({"errors": errors})


def run_all(args, deadline: Deadline, data: dict, rotations: str | None) -> None:
    """The configurations in order, one at a time; with ``--gpus`` one worker per GPU takes
    the next configuration as soon as its previous one is done (own server port, the
    server sees only that GPU), so N identical GPUs measure N configurations at once."""
    # steady-state workloads: one server per (configuration, workload), workload by workload
    pending = ([(name, w) for w in args.phases for name in args.configs] if args.steady
               else [(name, None) for name in args.configs])
    lock = threading.Lock()

    def next_config() -> tuple[str, str | None] | None:
        with lock:
            return pending.pop(0) if pending else None

    def worker(wargs, gpu: str | None) -> None:
        while (item := next_config()) is not None:
            name, workload = item
            if deadline.left() < (120 if workload else 90):
                record(args.out, data, name, {"errors": {workload or "server": "skipped: deadline"}})
                log(f"{name}{' ' + workload if workload else ''}: skipped (deadline)")
                continue
            if workload:
                run_steady(CONFIGS[name], workload, wargs, deadline, data, rotations, gpu)
            else:
                run_config(CONFIGS[name], wargs, deadline, data, rotations, gpu)

    if not args.gpus:
        worker(args, None)
        return
    threads = []
    for i, gpu in enumerate(args.gpus):
        wargs = copy.copy(args)
        wargs.port = args.port + i  # the server's port and the benchmark client's
        threads.append(threading.Thread(target=worker, args=(wargs, gpu), name=f"gpu{gpu}"))
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def environment() -> dict:
    """Versions and the GPU, without touching CUDA in this process (a context here would
    take GPU memory from the servers being measured)."""
    from importlib.metadata import PackageNotFoundError, version

    env = {"python": sys.version.split()[0], "host": os.uname().nodename}
    for pkg in ("sglang", "torch", "triton", "flashinfer-python"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        name, mem, driver = [x.strip() for x in out.stdout.splitlines()[0].split(",")]
        env.update(gpu=name, gpu_memory_mib=int(mem), driver=driver)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        env["gpu"] = None
    return env


def default_model() -> str:
    for cand in (os.path.join(ROOT, ".device", "shapes", "qwen3-8b-shape"),
                 os.path.join(os.path.dirname(ROOT), "shared", "shapes", "qwen3-8b-shape")):
        if os.path.isfile(os.path.join(cand, "config.json")):
            return cand
    return os.path.join(ROOT, ".device", "shapes", "qwen3-8b-shape")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="End-to-end serving benchmark (capacity, decode, throughput; steady-state decode)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=default_model(), help="model directory (config + tokenizer)")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated, from {', '.join(CONFIGS)} (default {','.join(CONFIG_ORDER)}; "
                         f"steady-state phases: {','.join(STEADY_CONFIGS)})")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help=f"comma-separated, from {', '.join(PHASES)}; or the steady-state workloads "
                         f"{', '.join(WORKLOADS)} (on their own)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/e2e_<model>.json; "
                                                "steady-state phases: e2e_decode_throughput_<model>.json)")
    ap.add_argument("--log-dir", default=None, help="server/client logs (default <out dir>/e2e_logs)")
    ap.add_argument("--plot", default=None, help="plot path (default: the JSON path with .png)")
    ap.add_argument("--plot-only", action="store_true", help="only render the plot from --out")
    ap.add_argument("--rotations", default=None,
                    help="oscar rotations file (default: a data-free hadamard file written for --model)")
    add_layout_args(ap)  # of the generated hadamard file
    ap.add_argument("--deadline-s", type=float, default=560, help="wall-time budget of this invocation")
    ap.add_argument("--server-timeout-s", type=float, default=420)
    ap.add_argument("--decode-timeout-s", type=float, default=180)
    ap.add_argument("--throughput-timeout-s", type=float, default=420)
    ap.add_argument("--port", type=int, default=31000, help="server port (worker i of --gpus: port + i)")
    ap.add_argument("--gpus", default=None,
                    help="comma-separated GPU ids: configurations run in parallel, one server per GPU "
                         "(CUDA_VISIBLE_DEVICES); default: one at a time on what the servers see")
    ap.add_argument("--seed", type=int, default=1)
    # the common memory budget and scheduler settings (identical for every configuration)
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--context-length", type=int, default=131072)
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="default 64; steady-state phases: the requests that fit in oscar_int2's pool")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--extra-server-args", default="", help="appended to every server command")
    # workloads
    ap.add_argument("--concurrent-input-len", type=int, default=100000)
    ap.add_argument("--concurrent-output-len", type=int, default=256)
    ap.add_argument("--decode-lens", default="32000,64000,128000")
    ap.add_argument("--decode-output-len", type=int, default=128)
    ap.add_argument("--tp-input-len", type=int, default=32000)
    ap.add_argument("--tp-range-ratio", type=float, default=1.0,
                    help="inputs uniform in [ratio*len, len]; SGLang applies it to the outputs too")
    ap.add_argument("--tp-output-len", type=int, default=256)
    ap.add_argument("--tp-num-prompts", type=int, default=32)
    # the steady-state decode workloads (steady_32k, steady_8k)
    ap.add_argument("--dt-num-prompts", type=int, default=None,
                    help="requests to send (default: as many as fit in oscar_int2's pool)")
    ap.add_argument("--dt-window-s", type=float, default=0,
                    help="longest window from the first request (0: until every request is done or the deadline)")
    ap.add_argument("--dt-stop-reserve-s", type=float, default=45,
                    help="the window closes this long before --deadline-s (stopping the server, saving)")
    ap.add_argument("--dt-poll-s", type=float, default=2.0, help="seconds between /metrics samples")
    ap.add_argument("--dt-log-interval", type=int, default=40,
                    help="the servers' --decode-log-interval (decode steps per 'Decode batch' line)")
    ap.add_argument("--dt-full-fraction", type=float, default=0.9,
                    help="steady intervals count at full concurrency when #running-req >= this x the largest")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None,
                    help="steady-state phases: the servers' --cuda-graph-max-bs-decode (default: "
                         "--max-running-requests)")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="steady-state phases: once the workload decodes at full concurrency, record N decode "
                         "steps with SGLang's profiler (/start_profile) and store their per-kernel breakdown "
                         "(benchmarks/decode_profile.py) in the entry; the trace goes to --log-dir")
    ap.add_argument("--from-server-log", default=None, metavar="LOG",
                    help="steady-state phase: record one configuration's steady figures from a server log whose "
                         "run was lost (the device call ended before it wrote them), without starting a server")
    ap.add_argument("--dt-reference", default=None,
                    help="e2e results file whose oscar_int2 pool sizes the steady workloads before oscar_int2 "
                         "has run (default benchmarks/results/e2e_<model>.json)")
    # how the processes are started (every server: oscar-sglang serve, as benchmarks/capacity.py)
    ap.add_argument("--launcher", default=None,
                    help="server launcher command (default: python -m sglang_ext.launcher serve)")
    ap.add_argument("--bench-serving", default=f"{sys.executable} {os.path.join(HERE, 'bench_serving_client.py')}",
                    help="benchmark client (default: sglang.benchmark.serving via bench_serving_client.py)")
    return ap


def resolve_args(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    args.model = os.path.abspath(args.model)
    model_name = os.path.basename(os.path.normpath(args.model))
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    args.steady = any(p in WORKLOADS for p in args.phases)
    if args.steady and any(p in PHASES for p in args.phases):
        raise SystemExit(f"e2e: the steady-state phases ({', '.join(WORKLOADS)}) run on servers of their own; "
                         f"give them without {', '.join(PHASES)}")
    args.configs = [c.strip() for c in (args.configs or ",".join(STEADY_CONFIGS if args.steady else CONFIG_ORDER))
                    .split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS] + [p for p in args.phases if p not in PHASES + tuple(WORKLOADS)]
    if bad:
        raise SystemExit(f"e2e: unknown configuration/phase {', '.join(bad)} "
                         f"(configurations: {', '.join(CONFIGS)}; phases: {', '.join(PHASES + tuple(WORKLOADS))})")
    if not args.steady and args.max_running_requests is None:
        args.max_running_requests = 64
    name = f"e2e_decode_throughput_{model_name}.json" if args.steady else f"e2e_{model_name}.json"
    args.out = args.out or os.path.join(RESULTS, name)
    args.dt_reference = args.dt_reference or os.path.join(RESULTS, f"e2e_{model_name}.json")
    args.log_dir = args.log_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "e2e_logs")
    args.plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    args.decode_lens = [int(x) for x in str(args.decode_lens).split(",") if x.strip()]
    args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve_args(argv)
    if args.plot_only:
        from benchmarks.plot_e2e import plot_e2e

        log(f"plot: {plot_e2e(load_results(args.out), args.plot)}")
        return 0
    if args.from_server_log:
        return recover_steady(args)
    deadline = Deadline(args.deadline_s)
    data = load_results(args.out)
    data["model"] = os.path.basename(os.path.normpath(args.model))
    data["environment"] = environment()
    if args.steady:
        data["settings"] = {k: getattr(args, k) for k in (
            "mem_fraction_static", "context_length", "page_size", "chunked_prefill_size", "extra_server_args",
            "dt_log_interval", "dt_poll_s", "dt_full_fraction")}
        data["settings"]["workloads"] = {k: asdict(w)
                                         for k, w in WORKLOADS.items()}
        data["settings"]["reference"] = STEADY_REFERENCE
    else:
        data["settings"] = {k: getattr(args, k) for k in (
            "mem_fraction_static", "context_length", "max_running_requests", "page_size",
            "chunked_prefill_size", "extra_server_args", "concurrent_input_len", "concurrent_output_len",
            "decode_lens", "decode_output_len", "tp_input_len", "tp_range_ratio", "tp_output_len",
            "tp_num_prompts")}
    save_results(args.out, data)
    os.makedirs(args.log_dir, exist_ok=True)

    rotations = args.rotations
    if any(CONFIGS[c].oscar for c in args.configs) and not rotations:
        import tempfile  # not next to the logs: 38 MB for Qwen3-8B, and reproducible from the shape

        resolve_layout(args)
        rotations = os.path.join(tempfile.gettempdir(), "oscar-e2e",
                                 shape_rotations_name(data["model"], args.group_size, args.value_group_size,
                                                      args.scale_dtype))
        log(f"writing the data-free hadamard rotations {rotations}")
        write_shape_rotations(args.model, rotations, args.group_size, args.value_group_size, args.scale_dtype)
        data["settings"]["oscar_layout"] = rotations_meta(args)  # the generated file's (args.rotations None)
    elif rotations and os.path.isfile(rotations):  # a given file: its own layout
        data["settings"]["oscar_layout"] = rotations_meta(args)
    data["settings"]["oscar_rotations"] = rotations
    data["settings"]["gpus"] = args.gpus
    run_all(args, deadline, data, rotations)
    log(f"results: {args.out}")
    if args.steady:
        return 0
    try:
        from benchmarks.plot_e2e import plot_e2e

        log(f"plot: {plot_e2e(data, args.plot)}")
    except ImportError as e:  # no matplotlib on the GPU machine: plot here with --plot-only
        log(f"no plot ({e}); run: python3 -m benchmarks.e2e --plot-only --out {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
