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
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from benchmarks.capacity import (add_layout_args, resolve_layout, rotations_meta,
                                 shape_rotations_name, write_shape_rotations)  # the data-free file capacity.py uses
from benchmarks.server_harness import ROOT, Server, ServerDied, log

HERE = os.path.dirname(os.path.abspath(__file__))

RESULTS = os.path.join(ROOT, "benchmarks", "results")

CONFIG_ORDER = ("bf16_triton", "bf16_flashinfer", "fp8_e4m3", "oscar_int2")
PHASES = ("capacity", "decode", "throughput")


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


def server_args(cfg: ServeConfig, args, rotations: str | None) -> list[str]:
    """The server arguments of one configuration; all but the KV dtype / attention backend
    (and the oscar rotations file) are the same for every configuration."""
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
    return cmd + shlex.split(args.extra_server_args)


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


# ------------------------------------------------------------------------- driver


def make_server(cfg: ServeConfig, args, rotations: str | None, env: dict | None = None) -> Server:
    server = Server(f"{cfg.name}.server", server_args(cfg, args, rotations), args.log_dir, port=args.port, env=env)
    if args.launcher:  # another launcher (tests use a stand-in); same arguments
        server.cmd = shlex.split(args.launcher) + server.cmd[server.cmd.index("serve") + 1:]
    return server


def record(path: str, data: dict, config: str, values: dict) -> None:
    """Merge one configuration's values and write the file (safe from parallel workers)."""
    with _SAVE_LOCK:
        merge(data, config, values)
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
    pending = list(args.configs)
    lock = threading.Lock()

    def next_config() -> str | None:
        with lock:
            return pending.pop(0) if pending else None

    def worker(wargs, gpu: str | None) -> None:
        while (name := next_config()) is not None:
            if deadline.left() < 90:
                record(args.out, data, name, {"errors": {"server": "skipped: deadline"}})
                log(f"{name}: skipped (deadline)")
                continue
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
    ap = argparse.ArgumentParser(description="End-to-end serving benchmark (capacity, decode, throughput)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=default_model(), help="model directory (config + tokenizer)")
    ap.add_argument("--configs", default=",".join(CONFIG_ORDER),
                    help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {', '.join(PHASES)}")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/e2e_<model>.json)")
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
    ap.add_argument("--max-running-requests", type=int, default=64)
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
    args.out = args.out or os.path.join(RESULTS, f"e2e_{model_name}.json")
    args.log_dir = args.log_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "e2e_logs")
    args.plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [c for c in args.configs if c not in CONFIGS] + [p for p in args.phases if p not in PHASES]
    if bad:
        raise SystemExit(f"e2e: unknown configuration/phase {', '.join(bad)} "
                         f"(configurations: {', '.join(CONFIGS)}; phases: {', '.join(PHASES)})")
    args.decode_lens = [int(x) for x in str(args.decode_lens).split(",") if x.strip()]
    args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve_args(argv)
    if args.plot_only:
        from benchmarks.plot_e2e import plot_e2e

        log(f"plot: {plot_e2e(load_results(args.out), args.plot)}")
        return 0
    deadline = Deadline(args.deadline_s)
    data = load_results(args.out)
    data["model"] = os.path.basename(os.path.normpath(args.model))
    data["environment"] = environment()
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
    try:
        from benchmarks.plot_e2e import plot_e2e

        log(f"plot: {plot_e2e(data, args.plot)}")
    except ImportError as e:  # no matplotlib on the GPU machine: plot here with --plot-only
        log(f"no plot ({e}); run: python3 -m benchmarks.e2e --plot-only --out {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
