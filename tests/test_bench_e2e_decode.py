"""benchmarks/e2e.py's steady-state decode workloads on CPU: the figures read from SGLang 0.5.17's
scheduler log lines and /metrics text, the request counts a pool gives, the JSON and its ratios,
and whole runs against a stand-in server that logs the way SGLang's scheduler does."""
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import e2e, steady_decode

# the scheduler's line formats of sglang 0.5.17 (scheduler_components/metrics_reporter.py), as
# configure_logger prints them: "[%Y-%m-%d %H:%M:%S{prefix}] message"
DECODE = ("[2026-12-02 17:20:{s:02d}{p}] Decode batch, #running-req: {r}, #token: {t}, token usage: {u:.2f}, "
          "cuda graph: {g}, gen throughput (token/s): {x:.2f}, #queue-req: {q}")
PREFILL = ("[2026-12-02 17:20:{s:02d}{p}] Prefill batch, #new-seq: {n}, #new-token: 8192, #cached-token: 0, "
           "token usage: {u:.2f}, #running-req: {r}, #queue-req: {q}, #pending-token: 0, cuda graph: False, "
           "input throughput (token/s): 23456.78")
RETRACT = ("[2026-12-02 17:20:30] KV cache pool is full. Retract requests. #retracted_reqs: 2, "
           "#new_tokens_gained: 68096, #new_token_ratio: 0.1000 -> 0.7000")


def _decode(r, x, s=0, p="", g=True, q=0, t=None):
    return DECODE.format(s=s, p=p, r=r, t=t if t is not None else r * 33000, u=0.9, g=g, x=x, q=q)


def _prefill(r, s=0, p="", q=5, n=1):
    return PREFILL.format(s=s, p=p, r=r, q=q, u=0.5, n=n)


def test_steady_figures_from_scheduler_log_lines():
    lines = [
        "[2026-12-02 17:19:59] INFO:     127.0.0.1:5000 - \"POST /generate HTTP/1.1\" 200 OK",
        _prefill(0), _prefill(1),
        _decode(2, 15.0),  # after a prefill: its seconds hold the prefill
        _decode(2, 30.0), _decode(2, 32.0),  # steady, but at 2 of 10: not full concurrency
        _prefill(2, n=8),
        _decode(10, 40.0),  # the prefill again
        _decode(10, 300.0), _decode(10, 310.0, p=" TP0"), _decode(10, 290.0, g=False),
        _decode(9, 280.0),  # a request left in this interval: not steady
        _decode(9, 295.0, s=1),  # steady at 9 >= 0.9 x 10
        RETRACT,
        _decode(9, 100.0),  # after a retraction
        "[2026-12-02 17:21:00.123 TP0] Decode batch, #running-req: 9, #token: 297000, token usage: 0.90, "
        "cuda graph: True, gen throughput (token/s): 305.00, #queue-req: 3",
    ]
    events = steady_decode.parse_scheduler_log("\n".join(lines))
    assert [e["kind"] for e in events].count("decode") == 11 and events[-1]["queue"] == 3
    assert sum(e["kind"] == "prefill" for e in events) == 3 and events[-3]["retracted"] == 2
    st = steady_decode.steady_state(events)
    # steady: 30, 32 (2 running), 300, 310, 290 (10), 295, 305 (9); full: the last five
    assert st["steady_intervals"] == 7 and st["full_intervals"] == 5
    assert st["decode_tok_s"] == 300.0 and st["in_flight"] == 10 and st["in_flight_max"] == 10
    assert st["decode_tok_s_p10"] == 290.0 and st["decode_tok_s_p90"] == 310.0
    assert st["ms_per_step"] == pytest.approx(1000 * 10 / 310.0, abs=0.01)  # the median of r / rate
    assert st["cuda_graph_fraction"] == 0.8 and st["retracted_requests"] == 2 and st["max_running_req"] == 10
    assert steady_decode.steady_state(events, full_fraction=0.1)["in_flight"] == 9  # all seven
    none = steady_decode.steady_state(steady_decode.parse_scheduler_log("\n".join(lines[:4])))
    assert none["decode_tok_s"] is None and none["in_flight"] is None and none["decode_lines"] == 1


def test_the_lines_are_the_ones_sglang_formats():
    """Our copies of the formats are the f-strings of the installed sglang's metrics_reporter.py
    (read as text: nothing of sglang is imported)."""
    import importlib.util

    root = Path(importlib.util.find_spec("sglang").origin).parent
    src = (root / "srt" / "managers" / "scheduler_components" / "metrics_reporter.py").read_text()
    for piece in ('f"Decode batch{iter_msg}, #running-req: {num_running_reqs}, {token_usage_msg}"',
                  'f"{self._graph_backend_label}: {can_run_cuda_graph}, "',
                  'f"gen throughput (token/s): {self.last_gen_throughput:.2f}, "',
                  'f"#queue-req: {len(self.scheduler.waiting_queue)}"',
                  'f"#new-seq: {prefill_stats.num_new_seqs}, "', 'f"#running-req: {prefill_stats.num_running_reqs.total}, "'):
        assert piece in src, piece
    pool = (root / "srt" / "managers" / "scheduler_components" / "pool_stats_observer.py").read_text()
    assert 'f"#token: {self.full_num_used}, token usage: {self.full_token_usage:.2f}"' in pool
    common = (root / "srt" / "utils" / "common.py").read_text()
    assert 'format = f"[%(asctime)s{maybe_ms}{prefix}] %(message)s"' in common and '"%Y-%m-%d %H:%M:%S"' in common
    sched = (root / "srt" / "managers" / "scheduler.py").read_text()
    assert '"KV cache pool is full. Retract requests. "' in sched and 'f"#retracted_reqs: {len(retracted_reqs)}' in sched
    mc = (root / "srt" / "observability" / "metrics_collector.py").read_text()
    assert 'name="sglang:realtime_tokens_total"' in mc and 'name="sglang:num_running_reqs"' in mc


METRICS = textwrap.dedent('''\
    # HELP sglang:realtime_tokens_total Total number of tokens processed (updated on each log interval). mode: prefill_compute, prefill_cache, decode.
    # TYPE sglang:realtime_tokens_total counter
    sglang:realtime_tokens_total{engine_type="unified",mode="prefill_compute",model_name="qwen3-8b-shape",pp_rank="0",tp_rank="0"} 4.8e+06
    sglang:realtime_tokens_total{engine_type="unified",mode="decode",model_name="qwen3-8b-shape",pp_rank="0",tp_rank="0"} 12345.0
    # HELP sglang:num_running_reqs The number of running requests.
    # TYPE sglang:num_running_reqs gauge
    sglang:num_running_reqs{engine_type="unified",model_name="qwen3-8b-shape",pp_rank="0",tp_rank="0"} 153.0
    sglang:num_queue_reqs{engine_type="unified",model_name="qwen3-8b-shape",pp_rank="0",tp_rank="0"} 0.0
    sglang:gen_throughput{engine_type="unified",model_name="qwen3-8b-shape",pp_rank="0",tp_rank="0"} 2600.5
''')


def test_metrics_text_and_the_window_rate():
    mv = steady_decode.metric_value
    assert mv(METRICS, "sglang:realtime_tokens_total", mode="decode") == 12345.0
    assert mv(METRICS, "sglang:realtime_tokens_total") == 4.8e6 + 12345.0  # every label set
    assert mv(METRICS, "sglang:num_running_reqs") == 153.0 and mv(METRICS, "sglang:nothing") is None
    s = steady_decode.metrics_sample(METRICS, 4.0)
    assert s == {"t": 4.0, "decode_tokens": 12345.0, "running": 153.0, "queue": 0.0}
    samples = [{"t": 2.0, "decode_tokens": 100.0}, {"t": 10.0, "decode_tokens": None},
               {"t": 12.0, "decode_tokens": 1300.0}]
    assert steady_decode.window_rate(samples, start_tokens=100.0) == \
        {"e2e_output_tok_s": 100.0, "window_s": 12.0, "decode_tokens": 1200}
    assert steady_decode.window_rate(samples)["e2e_output_tok_s"] == 120.0  # from the first sample
    assert steady_decode.window_rate([])["e2e_output_tok_s"] is None
    assert steady_decode.tokens_by(samples, 100.0, 7.0) == pytest.approx(600.0)  # half of 2 s -> 12 s
    assert steady_decode.tokens_by(samples, 100.0, 1.0) == 0.0  # from the start (t = 0, 100 tokens) to 2 s: none
    assert steady_decode.tokens_by(samples, 100.0, 13.0) is None


def _reference(tmp_path, pool=5_238_848, **settings) -> Path:
    st = {"mem_fraction_static": 0.85, "page_size": 64, "context_length": 131072, "max_running_requests": 64,
          **settings}
    path = tmp_path / "e2e_ref.json"
    path.write_text(json.dumps({"settings": st, "configs": {"oscar_int2": {"max_total_num_tokens": pool}}}))
    return path


def test_request_counts_come_from_the_oscar_pool(tmp_path):
    ref = _reference(tmp_path)
    args = e2e.resolve_args(["--model", str(tmp_path), "--phases", "steady_32k,steady_8k",
                             "--out", str(tmp_path / "dt.json"), "--dt-reference", str(ref)])
    assert args.configs == list(e2e.STEADY_CONFIGS) and args.max_running_requests is None
    data = e2e.load_results(args.out)
    p32 = e2e.steady_plan(data, args, "steady_32k")
    assert p32["num_prompts"] == p32["max_running_requests"] == p32["cuda_graph_max_bs"] == 153  # // 34048
    assert "5238848" in p32["source"] and not p32["num_prompts_fixed"]
    assert e2e.steady_plan(data, args, "steady_8k")["num_prompts"] == 433  # 5238848 // 12096
    # once oscar_int2 ran, every configuration takes its values
    data["configs"]["oscar_int2"] = {"steady_32k": {"pool_tokens": 5_100_000, "num_prompts": 149,
                                                    "max_running_requests": 153}}
    p = e2e.steady_plan(data, args, "steady_32k")
    assert (p["num_prompts"], p["max_running_requests"], p["num_prompts_fixed"]) == (149, 153, True)
    # the command line wins
    over = e2e.resolve_args(["--model", str(tmp_path), "--phases", "steady_32k", "--dt-reference", str(ref),
                             "--max-running-requests", "200", "--dt-num-prompts", "10", "--cuda-graph-max-bs", "256"])
    p = e2e.steady_plan(e2e.load_results(str(tmp_path / "none.json")), over, "steady_32k")
    assert (p["num_prompts"], p["max_running_requests"], p["cuda_graph_max_bs"]) == (10, 200, 256)
    assert p["source"] == "the command line's --dt-num-prompts and --max-running-requests"
    # a reference measured at another budget does not count
    other = e2e.resolve_args(["--model", str(tmp_path), "--phases", "steady_32k", "--out", str(tmp_path / "x.json"),
                              "--dt-reference", str(_reference(tmp_path, mem_fraction_static=0.9))])
    with pytest.raises(ValueError, match="run --configs oscar_int2 first"):
        e2e.steady_plan(e2e.load_results(other.out), other, "steady_32k")


def test_steady_phases_run_alone_and_have_their_own_file(tmp_path):
    with pytest.raises(SystemExit, match="run on servers of their own"):
        e2e.resolve_args(["--model", str(tmp_path), "--phases", "capacity,steady_32k"])
    args = e2e.resolve_args(["--model", str(tmp_path / "qwen3-8b-shape"), "--phases", "steady_8k"])
    assert args.out.endswith("benchmarks/results/e2e_decode_throughput_qwen3-8b-shape.json")
    assert args.dt_reference.endswith("benchmarks/results/e2e_qwen3-8b-shape.json")
    classic = e2e.resolve_args(["--model", str(tmp_path)])
    assert classic.max_running_requests == 64 and classic.configs == list(e2e.CONFIG_ORDER)


def test_ratios_to_bf16_flashinfer_and_the_merge(tmp_path):
    path = str(tmp_path / "dt.json")
    data = e2e.load_results(path)
    osc_samples = [{"t": 50.0, "decode_tokens": 1000.0}, {"t": 100.0, "decode_tokens": 5000.0}]
    e2e.record(path, data, "oscar_int2", {"steady_32k": {
        "decode_tok_s": 3000.0, "e2e_output_tok_s": 900.0, "in_flight": 150, "window_s": 100.0,
        "metrics_samples": osc_samples, "metrics_start_tokens": 0.0}}, finish=e2e.add_ratios)
    assert data["target"]["steady_32k"] == {"measured": None, "met": None}  # no reference yet
    assert data["configs"]["oscar_int2"]["steady_32k"]["e2e_common_window"] == {"window_s": 100.0,
                                                                              "output_tok_s": 50.0}
    bf_samples = [{"t": 20.0, "decode_tokens": 210.0}, {"t": 40.0, "decode_tokens": 410.0}]
    e2e.record(path, data, "bf16_flashinfer", {"steady_32k": {
        "decode_tok_s": 500.0, "e2e_output_tok_s": 450.0, "in_flight": 22, "window_s": 40.0,
        "metrics_samples": bf_samples, "metrics_start_tokens": 10.0}}, finish=e2e.add_ratios)
    e2e.record(path, data, "oscar_int2", {"steady_8k": {"decode_tok_s": 4000.0, "in_flight": 400}},
               finish=e2e.add_ratios)
    back = json.loads(Path(path).read_text())
    osc = back["configs"]["oscar_int2"]
    # over the 40 s both cover: oscar 800 tokens (between its samples at 0 and 50 s), bf16 400
    assert osc["steady_32k"]["e2e_common_window"] == {"window_s": 40.0, "output_tok_s": 20.0}
    assert osc["steady_32k"]["vs_bf16_flashinfer"] == {"decode_tok_s": 6.0, "e2e_output_tok_s": 2.0,
                                                       "in_flight": 6.818, "e2e_common_window": 2.0}
    assert osc["steady_8k"]["decode_tok_s"] == 4000.0 and osc["steady_32k"]["in_flight"] == 150  # both kept
    assert back["configs"]["bf16_flashinfer"]["steady_32k"]["vs_bf16_flashinfer"]["decode_tok_s"] == 1.0
    assert back["target"]["steady_32k"] == {"measured": 6.0, "met": True}
    assert back["target"]["steady_8k"] == {"measured": None, "met": None} and back["target"]["ratio"] == 5.0
    e2e.record(path, data, "bf16_flashinfer", {"steady_32k": {"decode_tok_s": 1000.0}}, finish=e2e.add_ratios)
    assert data["target"]["steady_32k"] == {"measured": 3.0, "met": False}


def test_common_window_ends_at_the_last_metrics_sample(tmp_path):
    """A last /metrics sample just before the window's end bounds the common window (past it
    there is no rate to read)."""
    path = str(tmp_path / "dt.json")
    data = e2e.load_results(path)
    e2e.record(path, data, "fp8_e4m3", {"steady_32k": {
        "decode_tok_s": 900.0, "window_s": 30.1, "metrics_start_tokens": 10.0,
        "metrics_samples": [{"t": 10.0, "decode_tokens": 110.0}, {"t": 30.0, "decode_tokens": 310.0}]}},
        finish=e2e.add_ratios)
    assert data["configs"]["fp8_e4m3"]["steady_32k"]["e2e_common_window"] == {"window_s": 30.0, "output_tok_s": 10.0}


# a stand-in server that logs like SGLang's scheduler once the stand-in client posts its load
FAKE_SERVER = textwrap.dedent('''
    import http.server, json, os, sys, threading, time
    args = sys.argv[1:]
    get = lambda k: args[args.index(k) + 1]
    port, dtype = int(get("--port")), get("--kv-cache-dtype")
    mrr = int(get("--max-running-requests"))
    pool = 1_000_000 if dtype == "oscar_int2" else 250_000
    info = {"max_total_num_tokens": pool, "max_running_requests": mrr, "kv_cache_dtype": dtype}
    with open(os.environ["FAKE_SERVER_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    with open(os.environ["FAKE_SERVER_ARGV"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    state = {"t0": None, "running": 0}
    D = ("[2026-12-02 17:20:00] Decode batch, #running-req: {r}, #token: {t}, token usage: 0.95, "
         "cuda graph: True, gen throughput (token/s): {x:.2f}, #queue-req: {q}")
    P = ("[2026-12-02 17:20:00] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: 0.50, "
         "#running-req: {r}, #queue-req: {q}, #pending-token: 0, cuda graph: False, input throughput (token/s): 23456.78")
    def load(n, per_req):
        r = min(n, pool // per_req, mrr)
        for i in range(3):
            print(P.format(r=i, q=n - i - 1), flush=True)
        state.update(t0=time.monotonic(), running=r)
        print(D.format(r=r, t=r * per_req, x=5.0, q=n - r), flush=True)
        for x in (20.0, 21.0, 19.0, 20.0, 70.0, 20.0):
            print(D.format(r=r, t=r * per_req, x=x * r, q=n - r), flush=True)
        print(P.format(r=r, q=n - r), flush=True)
        for _ in range(2):
            print(D.format(r=max(1, r // 2), t=r * per_req, x=10.0 * r, q=0), flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/metrics":
                dt = time.monotonic() - state["t0"] if state["t0"] else 0.0
                body = ("# TYPE sglang:realtime_tokens_total counter\\n"
                        f'sglang:realtime_tokens_total{{mode="decode",tp_rank="0"}} {500.0 + 100.0 * dt * state["running"]}\\n'
                        f'sglang:num_running_reqs{{tp_rank="0"}} {state["running"]}\\n').encode()
            else:
                body = json.dumps(info).encode()
            self.send_response(200 if self.path in ("/health", "/server_info", "/metrics") else 404)
            self.end_headers(); self.wfile.write(body)
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            threading.Thread(target=load, args=(req["n"], req["per_req"])).start()
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a): pass
    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')

FAKE_BENCH = textwrap.dedent('''
    import json, os, sys, time, urllib.request
    a = sys.argv[1:]
    get = lambda k: a[a.index(k) + 1]
    n, n_in, n_out = int(get("--num-prompts")), int(get("--random-input-len")), int(get("--random-output-len"))
    assert int(get("--max-concurrency")) == n and get("--request-rate") == "inf" and get("--warmup-requests") == "0"
    with open(os.environ["FAKE_BENCH_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    per_req = -(-(n_in + n_out) // 64) * 64
    body = json.dumps({"n": n, "per_req": per_req}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{get('--port')}/fake_load", data=body,
                                                  headers={"Content-Type": "application/json"}), timeout=10).read()
    time.sleep(600 if os.environ.get("FAKE_BENCH_HANG") else 2.5)
    rec = {"completed": n, "duration": 2.5, "output_throughput": 123.0, "median_itl_ms": 10.0, "errors": [""] * n}
    open(get("--output-file"), "a").write(json.dumps(rec) + "\\n")
''')


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    for k in ("FAKE_SERVER_PIDS", "FAKE_SERVER_ARGV", "FAKE_BENCH_PIDS"):
        monkeypatch.setenv(k, str(tmp_path / f"{k.lower()}.txt"))
    return tmp_path


def _argv(tmp_path, *extra):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    py = sys.executable
    return ["--model", str(tmp_path), "--out", str(tmp_path / "out" / "dt.json"), "--port", str(port),
            "--deadline-s", "200", "--server-timeout-s", "30", "--dt-poll-s", "0.5",
            "--dt-reference", str(_reference(tmp_path, pool=1_000_000)),
            "--rotations", str(tmp_path / "unused.safetensors"),
            "--launcher", f"{py} {tmp_path / 'fake_server.py'}", "--bench-serving", f"{py} {tmp_path / 'fake_bench.py'}",
            *extra]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def _pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


def test_steady_run_against_stand_ins(fakes):
    tmp_path = fakes
    assert e2e.main(_argv(tmp_path, "--phases", "steady_32k", "--configs", "oscar_int2,bf16_flashinfer")) == 0
    data = json.loads((tmp_path / "out" / "dt.json").read_text())
    osc, bf = data["configs"]["oscar_int2"]["steady_32k"], data["configs"]["bf16_flashinfer"]["steady_32k"]
    # 1_000_000 // 34048 = 29 requests for both, --max-running-requests 29; bf16's pool holds 7
    assert osc["num_prompts"] == bf["num_prompts"] == 29 and osc["max_running_requests"] == bf["max_running_requests"] == 29
    assert (osc["fit_in_pool"], bf["fit_in_pool"]) == (29, 7) and not osc["flag_limits_concurrency"]
    assert (osc["in_flight"], bf["in_flight"]) == (29, 7)
    assert (osc["decode_tok_s"], bf["decode_tok_s"]) == (580.0, 140.0)  # median of 20 x r per request
    assert osc["vs_bf16_flashinfer"]["decode_tok_s"] == pytest.approx(580 / 140, abs=1e-3)
    assert data["target"]["steady_32k"]["met"] is False  # 4.14x < 5x
    for r in (osc, bf):
        assert not r["bounded"] and r["completed"] == 29 and r["client"]["output_throughput"] == 123.0
        assert r["e2e_output_tok_s"] > 0 and r["steady"]["prefill_lines"] == 4 and r["steady"]["full_intervals"] == 6
        assert "Decode batch" in r["sources"]["decode_tok_s"] and "/metrics" in r["sources"]["e2e_output_tok_s"]
    assert data["configs"]["oscar_int2"]["errors"] == {"steady_32k": None}
    argvs = [json.loads(x) for x in (tmp_path / "fake_server_argv.txt").read_text().splitlines()]
    for argv in argvs:
        assert "--enable-metrics" in argv and argv[argv.index("--max-running-requests") + 1] == "29"
        assert argv[argv.index("--cuda-graph-max-bs-decode") + 1] == "29"
        assert argv[argv.index("--decode-log-interval") + 1] == "40"
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.85" and argv[argv.index("--page-size") + 1] == "64"
    assert data["settings"]["workloads"]["steady_32k"] == {"input_len": 32000, "output_len": 2048,
                                                           "label": "long context: 32k input, 2048 output"}
    assert not any(_alive(p) for p in _pids(tmp_path / "fake_server_pids.txt"))


def test_a_bounded_window_stops_the_client_and_says_so(fakes, monkeypatch):
    tmp_path = fakes
    monkeypatch.setenv("FAKE_BENCH_HANG", "1")
    t0 = time.monotonic()
    assert e2e.main(_argv(tmp_path, "--phases", "steady_8k", "--configs", "oscar_int2", "--dt-window-s", "3")) == 0
    assert time.monotonic() - t0 < 60
    r = json.loads((tmp_path / "out" / "dt.json").read_text())["configs"]["oscar_int2"]["steady_8k"]
    assert r["bounded"] and r["window_cap_s"] == 3.0 and 3.0 <= r["window_s"] < 10
    assert r["completed"] is None and r["client"] is None
    assert r["num_prompts"] == 82 and r["in_flight"] == 82  # 1_000_000 // 12096
    assert r["e2e_output_tok_s"] > 0 and r["window"]["decode_tokens"] > 0
    assert not any(_alive(p) for p in _pids(tmp_path / "fake_bench_pids.txt") + _pids(tmp_path / "fake_server_pids.txt"))


def test_results_md_renders_the_file_or_says_none_yet(fakes, tmp_path_factory):
    from benchmarks import report

    tmp_path = fakes
    res = tmp_path_factory.mktemp("results")
    assert report.render_e2e_decode_throughput(str(res)).startswith("_No results yet: run `python3 -m benchmarks.e2e "
                                                                    "--phases steady_32k --configs oscar_int2`")
    assert e2e.main(_argv(tmp_path, "--phases", "steady_32k", "--configs", "oscar_int2,bf16_flashinfer")) == 0
    (res / "e2e_decode_throughput_m.json").write_text((tmp_path / "out" / "dt.json").read_text())
    text = report.render_e2e_decode_throughput(str(res))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert rows["oscar_int2"][1:9] == ["1,000,000", "29", "29", "29", "29", "580.0", "4.14x", "50.00"]
    runs = json.loads((res / "e2e_decode_throughput_m.json").read_text())["configs"]
    span = runs["bf16_flashinfer"]["steady_32k"]["e2e_common_window"]["window_s"]  # ~3 s; more on a loaded CPU
    assert rows["oscar_int2"][11].endswith("x") and f"e2e output tok/s, first {report.fmt(span)} s" in text
    assert rows["bf16_flashinfer"][5:8] == ["7", "140.0", "1.00x"] and "(all 29 done)" in rows["oscar_int2"][12]
    assert "`steady_32k` 4.14x (missed)" in text and "steady_8k" not in text.split("Target")[0]
    # the classic e2e section leaves this file to its own section
    assert report.render_e2e(str(res)).startswith("_No results yet")


def test_steady_figures_recovered_from_a_lost_runs_server_log(tmp_path):
    """--from-server-log: the scheduler lines after the ready line give the entry; the warm-up's
    lines before it do not count; the /metrics rates stay unknown; a log without them is refused."""
    log_file = tmp_path / "oscar_int2.steady_32k.server.log"
    warmup = [_decode(4, 9999.0), _decode(4, 9999.0)]
    run = [_prefill(9), _decode(10, 15.0), _decode(10, 300.0), _decode(10, 320.0), _decode(10, 310.0)]
    start = "[2026-12-02 17:19:00] max_total_num_tokens=4996096, chunked_prefill_size=8192, max_running_requests=153"
    log_file.write_text("\n".join([start] + warmup + [f"[2026-12-02 17:20:00] {e2e.READY_LINE}!"] + run) + "\n")
    out = tmp_path / "dt.json"
    argv = ["--model", str(tmp_path / "qwen3-8b-shape"), "--phases", "steady_32k", "--configs", "oscar_int2",
            "--out", str(out), "--from-server-log", str(log_file)]
    assert e2e.main(argv) == 0
    entry = json.loads(out.read_text())["configs"]["oscar_int2"]["steady_32k"]
    assert entry["in_flight"] == 10 and entry["decode_tok_s"] == 310.0 and entry["steady"]["full_intervals"] == 3
    assert entry["e2e_output_tok_s"] is None and entry["recovered_from_server_log"] == log_file.name
    # 4996096 // 34048 = 146 requests of 32000 + 2048 tokens (page 64) fit; oscar_int2 sends them all
    assert (entry["pool_tokens"], entry["fit_in_pool"], entry["num_prompts"], entry["max_running_requests"]) == (
        4996096, 146, 146, 153)
    log_file.write_text("\n".join(warmup) + "\n")
    with pytest.raises(SystemExit, match="not a ready server's log"):
        e2e.main(argv)
    with pytest.raises(SystemExit, match="one steady-state phase and one configuration"):
        e2e.main(argv[:5] + ["oscar_int2,bf16_flashinfer"] + argv[6:])
