"""benchmarks/decode_profile.py on a hand-made Chrome trace (ms per decode step by category, steps
bounded by the CUDA-graph replays), its plot and RESULTS.md section, and benchmarks/e2e.py's
--profile-steps against a stand-in server that answers /start_profile the way SGLang 0.5.17 does."""
import gzip
import json
import sys
import textwrap

import pytest

from benchmarks import decode_profile as dp
from benchmarks import e2e

US = 1.0  # Kineto's trace times are microseconds


def _kernel(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0}}


def _launch(name, ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 5.0,
            "args": {"correlation": corr}}


def _replay(t, corr, split_merge=False):
    """One decode graph replay starting at t: (kernels, end)."""
    ks = [("_rotate_q_kernel", 10), ("_store_kernel", 20), ("_decode_stage1", 300)]
    ks += [("_decode_merge_split", 24), ("_rotate_q_kernel", 6)] if split_merge else [("_decode_merge_row", 20)]
    ks += [("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 100), ("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>", 10),
           ("nvjet_tst_256x128_64x4_2x1_v_bz_TNT", 200)]  # the last GEMM: the LM head
    if split_merge:  # and a split-K reduce after it, also the LM head's
        ks.append(("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", 4))
    out = []
    for name, d in ks:
        out.append(_kernel(name, t, d, corr))
        t += d
    return out, t


def _out_of_graph(t, corr):
    """What the GPU runs between two replays: argmax sampling, an input copy, an elementwise kernel."""
    return [_kernel("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, "
                    "at::native::ArgMaxOps<c10::BFloat16>, unsigned int, long, 4> >", t, 30, corr),
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": t + 50, "dur": 5,
             "args": {"correlation": corr + 1}},
            _kernel("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int> >",
                    t + 100, 15, corr + 2)]


def synthetic_trace() -> dict:
    """Four graph replays (at 1000, 2000, 3100, 9000 us): three periods. Period 1: a row-merge step;
    period 2: a split-merge step (its un-rotation), with a 50 us kernel on a second stream during
    stage 1; period 3: a prefill GEMM outside the graphs (dropped)."""
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}}]
    k1, _ = _replay(1000, 10)
    k2, _ = _replay(2000, 20, split_merge=True)
    k3, _ = _replay(3100, 30)
    k4, _ = _replay(9000, 40)
    ev += k1 + _out_of_graph(1700, 11) + k2 + _out_of_graph(2700, 21) + k3 + k4
    ev.append(_kernel("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >",
                      2100, 50, 25, stream=13))
    ev.append(_kernel("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", 4000, 900, 35))  # a prefill GEMM, no graph
    ev += [_launch("cudaGraphLaunch", t, c) for t, c in ((990, 10), (1990, 20), (3090, 30), (8990, 40))]
    ev += [_launch("cudaLaunchKernel", 1690, 11), _launch("cuLaunchKernel", 3995, 35)]
    return {"schemaVersion": 1, "traceEvents": ev}


def test_kernel_names_go_to_their_categories():
    cases = {
        "_rotate_q_kernel": dp.ROT, "_decode_stage1": dp.STAGE1, "_decode_merge_row": dp.MERGE,
        "_decode_merge_split": dp.MERGE, "_store_kernel": dp.KV, "store_kvcache": dp.KV,
        "void flashinfer::BatchPrefillWithPagedKVCacheKernel<KernelTraits<...> >": dp.FLASHINFER,
        "void flashinfer::BatchDecodeWithPagedKVCacheKernel<PosEncodingMode(0), 2u>": dp.FLASHINFER,
        "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u>": dp.MERGE,
        "create_flashinfer_kv_indices_triton": dp.META,
        "_fwd_grouped_kernel_stage1": dp.STAGE1, "_fwd_kernel_stage2": dp.MERGE,
        "nvjet_tst_192x128_64x4_2x1_v_bz_coopB_TNT": dp.GEMM, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": dp.GEMM,
        "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>": dp.NORM,
        "void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true, 128u>": dp.NORM,
        "act_and_mul_kernel": dp.NORM, "fused_rope_store_kernel": dp.NORM,
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float> > >": dp.SAMPLING,
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": dp.COMM,
        "void at::native::vectorized_elementwise_kernel<4, FillFunctor<int> >": dp.OTHER,
    }
    got = {n: dp.classify(n) for n in cases}
    assert got == cases


def test_ms_per_step_of_a_synthetic_trace():
    r = dp.breakdown(synthetic_trace())
    assert (r["steps"], r["graph_replays"], r["periods_dropped"]) == (2, 4, 1)
    ms = r["ms_per_step"]
    # per kept step, in us: rotations 10 + 10 (step 2's second rotation is the split merge's un-rotation),
    # stage 1 300 + 300, merge 20 + (24 + 6), store 20 + 20, GEMMs 100 + 100, norm 10 + 10,
    # sampling/logits (LM head 200 (+ 4 split-K reduce in step 2) + argmax 30), else (memcpy 5 + fill 15) +
    # (5 + 15 + 50)
    want = {dp.ROT: 0.010, dp.STAGE1: 0.300, dp.MERGE: 0.025, dp.KV: 0.020, dp.GEMM: 0.100, dp.NORM: 0.010,
            dp.SAMPLING: 0.232, dp.OTHER: 0.045, dp.FLASHINFER: 0.0, dp.META: 0.0, dp.COMM: 0.0}
    assert {c: ms[c] for c in want} == pytest.approx(want, abs=1e-9)
    # wall (1000 + 1100) / 2; busy: (660 + 30 + 5 + 15) and (674 + 30 + 5 + 15), the 50 us under stage 1
    assert r["wall_ms_per_step"] == pytest.approx(1.050)
    assert r["gpu_busy_ms_per_step"] == pytest.approx(0.717)
    assert ms[dp.IDLE] == pytest.approx(1.050 - 0.717)
    assert r["kernel_ms_per_step"] == pytest.approx(0.742) and r["overlap_ms_per_step"] == pytest.approx(0.025)
    assert sum(ms.values()) - r["overlap_ms_per_step"] == pytest.approx(r["wall_ms_per_step"])
    assert r["kernels_per_step"][dp.ROT] == 1 and r["kernels_per_step"][dp.MERGE] == 1.5
    assert r["kernels_per_step"][dp.GEMM] == 1 and r["kernels_per_step"][dp.SAMPLING] == 2.5
    assert r["kernels_per_replay"] == 7.5  # (7 + 9 + 7 + 7) / 4
    assert r["top_kernels"][0]["name"] == "_decode_stage1" and r["top_kernels"][0]["ms_per_step"] == 0.3
    other = [(k["name"].split("at::native::")[-1][:14], k["ms_per_step"], k["per_step"]) for k in r["top_other"]]
    assert other == [("CUDAFunctor_ad", 0.025, 0.5), ("FillFunctor<in", 0.015, 1.0), ("Memcpy HtoD (P", 0.005, 1.0)]


def test_a_trace_file_gzipped_or_not_and_its_failures(tmp_path):
    trace = synthetic_trace()
    (tmp_path / "t.json").write_text(json.dumps(trace))
    with gzip.open(tmp_path / "t.trace.json.gz", "wt") as f:
        json.dump(trace, f)
    assert dp.breakdown(dp.load_trace(str(tmp_path / "t.json"))) == dp.breakdown(
        dp.load_trace(str(tmp_path / "t.trace.json.gz")))
    no_graph = {"traceEvents": [e for e in trace["traceEvents"] if e.get("name") != "cudaGraphLaunch"]}
    with pytest.raises(ValueError, match="0 CUDA-graph replays"):
        dp.breakdown(no_graph)
    # a prefill through a breakable graph: its segments are replays of a few kernels, not steps, and
    # the period they fall in is no decode step (here: no eager GEMM left to tell)
    seg = [e for e in trace["traceEvents"] if e.get("args", {}).get("correlation") != 35]
    seg += [_kernel("nvjet_seg", 5000, 40, 50), _kernel("nvjet_seg", 5040, 40, 50), _launch("cudaGraphLaunch", 4990, 50)]
    r = dp.breakdown({"traceEvents": seg})
    assert (r["steps"], r["graph_replays"], r["other_replays"], r["periods_dropped"]) == (2, 4, 1, 1)
    assert r["ms_per_step"] == dp.breakdown(trace)["ms_per_step"]
    # a prefill GEMM in every period: nothing left to count
    busy = {"traceEvents": trace["traceEvents"] + [_kernel("nvjet_x", 1500, 10, 99), _kernel("nvjet_x", 2500, 10, 98)]}
    busy["traceEvents"] = [e for e in busy["traceEvents"] if e.get("args", {}).get("correlation") not in (30, 40)]
    with pytest.raises(ValueError, match="decode work only"):
        dp.breakdown(busy)


def _results_with_profiles(tmp_path) -> dict:
    prof = dp.breakdown(synthetic_trace())
    data = {"model": "m", "environment": {"gpu": "NVIDIA H200"},
            "settings": {"workloads": {"steady_32k": {}, "steady_8k": {}}},
            "configs": {"oscar_int2": {"steady_32k": {"in_flight": 146, "steady": {"ms_per_step": 67.8},
                                                      "profile": {**prof, "in_flight": 146}}},
                        "bf16_flashinfer": {"steady_32k": {"in_flight": 22, "steady": {"ms_per_step": 30.6}}}}}
    return data


def test_plot_and_results_section(tmp_path):
    from benchmarks import report

    res = tmp_path / "results"
    res.mkdir()
    data = _results_with_profiles(tmp_path)
    bare = json.loads(json.dumps(data))
    del bare["configs"]["oscar_int2"]["steady_32k"]["profile"]
    (res / "e2e_decode_throughput_m.json").write_text(json.dumps(bare))
    assert report.render_decode_profile(str(res)).startswith("_No profile yet: run `python3 -m benchmarks.e2e")
    assert dp.plot(bare, str(tmp_path / "none.png")) is None and not (tmp_path / "none.png").exists()

    (res / "e2e_decode_throughput_m.json").write_text(json.dumps(data))
    png = dp.plot(data, str(res / "decode_profile_m.png"))
    assert png and (res / "decode_profile_m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.render_decode_profile(str(res))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert rows["ms per decode step"][1].startswith("oscar_int2") and len(rows["ms per decode step"]) == 2
    assert rows[dp.STAGE1][1].strip(" |") == "0.30" and rows[dp.SAMPLING][1].strip(" |") == "0.23"
    assert rows["step, wall (trace)"][1].strip(" |") == "1.05"
    assert rows["step (scheduler log)"][1].strip(" |") == "67.80" and rows["in flight"][1].strip(" |") == "146"
    assert "decode_profile_m.png" in text and "at::native::vectorized_elementwise_kernel" in text


# a stand-in server: the scheduler's lines once the load comes; /start_profile writes a trace and
# logs SGLang's "Profiling done" line after the steps (here: at once)
FAKE_SERVER = textwrap.dedent('''
    import gzip, http.server, json, os, sys, threading, time
    args = sys.argv[1:]
    get = lambda k: args[args.index(k) + 1]
    port, mrr = int(get("--port")), int(get("--max-running-requests"))
    info = {"max_total_num_tokens": 1_000_000, "max_running_requests": mrr}
    with open(os.environ["FAKE_SERVER_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    D = ("[2026-12-02 17:20:00] Decode batch, #running-req: {r}, #token: 990000, token usage: 0.95, "
         "cuda graph: True, gen throughput (token/s): {x:.2f}, #queue-req: 0")
    P = ("[2026-12-02 17:20:00] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: 0.50, "
         "#running-req: {r}, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 1.00")
    state = {"r": 0}
    def load(n):
        print(P.format(r=0), flush=True)
        state["r"] = n
        for x in (20.0, 20.0, 20.0):
            print(D.format(r=n, x=x * n), flush=True)
        while state.get("profile") is None:
            time.sleep(0.05)
        for x in (1.0, 1.0):  # the profiled intervals: slow
            print(D.format(r=n, x=x * n), flush=True)
        req = state["profile"]
        with gzip.open(os.path.join(req["output_dir"], req["profile_id"] + "-TP-0.trace.json.gz"), "wt") as f:
            f.write(os.environ["FAKE_TRACE"])
        print("[2026-12-02 17:20:05] Profiling done. Traces are saved to: " + req["output_dir"], flush=True)
        for x in (1.0, 22.0):  # the first interval after it still held profiled steps
            print(D.format(r=n, x=x * n), flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (f'sglang:realtime_tokens_total{{mode="decode"}} {100.0 * state["r"]}\\n' if self.path == "/metrics"
                    else json.dumps(info)).encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/start_profile":
                assert state["r"] and set(req) >= {"output_dir", "num_steps", "activities", "profile_id"}
                state["profile"] = req
                with open(os.environ["FAKE_PROFILE_REQ"], "w") as f:
                    json.dump(req, f)
                self.send_response(200); self.end_headers(); self.wfile.write(b"Start profiling.\\n")
                return
            threading.Thread(target=load, args=(req["n"],)).start()
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a): pass
    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')

FAKE_BENCH = textwrap.dedent('''
    import json, sys, time, urllib.request
    a = sys.argv[1:]
    get = lambda k: a[a.index(k) + 1]
    n = int(get("--num-prompts"))
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{get('--port')}/fake_load",
                           data=json.dumps({"n": n}).encode(), headers={"Content-Type": "application/json"})).read()
    time.sleep(4)
    open(get("--output-file"), "a").write(json.dumps({"completed": n, "output_throughput": 1.0}) + "\\n")
''')


def test_profile_steps_against_a_stand_in_server(tmp_path, monkeypatch):
    import socket

    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    monkeypatch.setenv("FAKE_SERVER_PIDS", str(tmp_path / "pids.txt"))
    monkeypatch.setenv("FAKE_PROFILE_REQ", str(tmp_path / "profile_req.json"))
    monkeypatch.setenv("FAKE_TRACE", json.dumps(synthetic_trace()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out" / "dt.json"
    py = sys.executable
    argv = ["--model", str(tmp_path), "--out", str(out), "--port", str(port), "--phases", "steady_8k",
            "--configs", "oscar_int2", "--deadline-s", "200", "--server-timeout-s", "30", "--dt-poll-s", "0.3",
            "--dt-num-prompts", "10", "--max-running-requests", "10", "--rotations", str(tmp_path / "unused"),
            "--launcher", f"{py} {tmp_path / 'fake_server.py'}", "--bench-serving", f"{py} {tmp_path / 'fake_bench.py'}",
            "--profile-steps", "7"]
    assert e2e.main(argv) == 0
    entry = json.loads(out.read_text())["configs"]["oscar_int2"]["steady_8k"]
    req = json.loads((tmp_path / "profile_req.json").read_text())
    logs = tmp_path / "out" / "e2e_logs"
    assert req == {"output_dir": str(logs), "num_steps": 7, "activities": ["CPU", "GPU"], "with_stack": False,
                   "record_shapes": False, "profile_id": "oscar_int2.steady_8k"}
    prof = entry["profile"]
    assert "error" not in prof and prof["trace"] == "oscar_int2.steady_8k-TP-0.trace.json.gz"
    assert (logs / prof["trace"]).is_file()
    assert prof["requested_steps"] == 7 and prof["in_flight"] == 10 and prof["steps"] == 2
    assert prof["ms_per_step"] == dp.breakdown(synthetic_trace())["ms_per_step"]
    # the slow intervals that held profiled steps are not steady; 20 x 10 twice before, 22 x 10 once after
    assert entry["steady"]["full_intervals"] == 3 and entry["decode_tok_s"] == 200.0
    assert e2e.main(argv[:-2]) == 0  # without the flag: no profile, every interval counts
    entry = json.loads(out.read_text())["configs"]["oscar_int2"]["steady_8k"]
    assert "profile" not in entry
