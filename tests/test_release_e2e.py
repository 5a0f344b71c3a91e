"""benchmarks/e2e.py orchestration on CPU, against a stand-in server and benchmark client.

The stand-ins speak the same interfaces the real ones do (/health, /server_info, the
JSONL that sglang.benchmark.serving appends), so these tests check the driver: commands,
capacity arithmetic, phase bookkeeping, partial results, and that no server outlives it.
"""
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import capacity, e2e

ROOT = Path(__file__).resolve().parents[1]

FAKE_SERVER = textwrap.dedent('''
    import http.server, json, os, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if os.environ.get("FAKE_SERVER_DIE"):
        print("fake server: refusing to start", flush=True)
        sys.exit(3)
    dtype = args[args.index("--kv-cache-dtype") + 1]
    info = {"max_total_num_tokens": 1_000_000 if dtype == "oscar_int2" else 250_000,
            "max_running_requests": int(args[args.index("--max-running-requests") + 1]),
            "kv_cache_dtype": dtype, "argv": args, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}
    with open(os.environ["FAKE_SERVER_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    print(f"max_total_num_tokens={info['max_total_num_tokens']}, chunked_prefill_size=8192", flush=True)
    print(f"visible GPUs: {info['gpu']}", flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(info).encode() if self.path == "/server_info" else b"{}"
            self.send_response(200 if self.path in ("/health", "/server_info") else 404)
            self.end_headers(); self.wfile.write(body)
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')

FAKE_BENCH = textwrap.dedent('''
    import json, sys
    a = sys.argv[1:]
    get = lambda k: a[a.index(k) + 1]
    n_in, n_out, n = int(get("--random-input-len")), int(get("--random-output-len")), int(get("--num-prompts"))
    if n_in == 64000 and n == 1:
        sys.exit("fake bench: simulated client failure")
    rec = {"completed": n, "output_throughput": 1000.0 * int(get("--max-concurrency")),
           "median_itl_ms": n_in / 4000.0, "median_tpot_ms": 10.0, "median_ttft_ms": n_in / 100.0, "p99_itl_ms": 99.0,
           "errors": [""] * n, "itls": [[0.01]] * n}
    open(get("--output-file"), "a").write(json.dumps(rec) + "\\n")
''')


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    pids = tmp_path / "pids.txt"
    monkeypatch.setenv("FAKE_SERVER_PIDS", str(pids))
    return tmp_path, pids


def _argv(tmp_path, port, *extra):
    py = sys.executable
    return ["--model", str(tmp_path), "--out", str(tmp_path / "out" / "e2e.json"),
            "--port", str(port), "--deadline-s", "120", "--server-timeout-s", "30",
            "--launcher", f"{py} {tmp_path / 'fake_server.py'}",
            "--bench-serving", f"{py} {tmp_path / 'fake_bench.py'}", "--tp-input-len", "64000", *extra]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_page_rounded_capacity():
    assert e2e.page_round(100_256, 64) == 100_288
    assert e2e.requests_that_fit(1_000_000, 100_000, 256, 64) == 9  # 9 * 100288 = 902592
    assert e2e.requests_that_fit(100_287, 100_000, 256, 64) == 0
    assert e2e.length_key(128000) == "128k" and e2e.length_key(1500) == "1500"


def test_server_commands_share_the_memory_budget(tmp_path):
    args = e2e.resolve_args(["--model", str(tmp_path), "--mem-fraction-static", "0.7"])
    cmds = {n: e2e.server_args(e2e.CONFIGS[n], args, "/r.safetensors") for n in e2e.CONFIG_ORDER}
    for cmd in cmds.values():
        assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"
        assert cmd[cmd.index("--load-format") + 1] == "dummy"
        assert cmd[cmd.index("--page-size") + 1] == "64"
    assert "--oscar-rotations" in cmds["oscar_int2"] and "oscar_int2" in cmds["oscar_int2"]
    assert e2e.make_server(e2e.CONFIGS["oscar_int2"], args, "/r").cmd[1:4] == ["-m", "sglang_ext.launcher", "serve"]
    assert "--oscar-rotations" not in cmds["fp8_e4m3"] and "fp8_e4m3" in cmds["fp8_e4m3"]
    with pytest.raises(ValueError, match="rotations"):
        e2e.server_args(e2e.CONFIGS["oscar_int2"], args, None)


def test_unknown_configuration_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="bf16_magic"):
        e2e.resolve_args(["--model", str(tmp_path), "--configs", "bf16_triton,bf16_magic"])


def test_throughput_concurrency_is_what_fits(tmp_path):
    args = e2e.resolve_args(["--model", str(tmp_path), "--tp-input-len", "64000", "--tp-num-prompts", "32"])
    assert e2e.throughput_concurrency(args, 250_000) == 3  # 250000 // 64256
    assert e2e.throughput_concurrency(args, 10_000_000) == 32  # capped by the prompt count
    assert e2e.throughput_concurrency(args, 1000) == 1


def test_merge_keeps_other_phases(tmp_path):
    path = tmp_path / "r.json"
    data = e2e.load_results(str(path))
    e2e.merge(data, "a", {"max_total_num_tokens": 5, "decode": {"decode_ms_32k": {"x": 1}}})
    e2e.save_results(str(path), data)
    data = e2e.load_results(str(path))
    e2e.merge(data, "a", {"decode": {"decode_ms_64k": {"x": 2}}, "throughput_tok_s": 7.0})
    assert data["configs"]["a"] == {"max_total_num_tokens": 5, "throughput_tok_s": 7.0,
                                    "decode": {"decode_ms_32k": {"x": 1}, "decode_ms_64k": {"x": 2}}}
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an e2e results file"):
        e2e.load_results(str(path))


def test_full_run_against_stand_ins(fakes):
    tmp_path, pids = fakes
    rc = e2e.main(_argv(tmp_path, _free_port(), "--configs", "bf16_triton,oscar_int2",
                        "--rotations", str(tmp_path / "unused.safetensors")))
    assert rc == 0
    data = json.loads((tmp_path / "out" / "e2e.json").read_text())
    bf16, oscar = data["configs"]["bf16_triton"], data["configs"]["oscar_int2"]
    assert bf16["max_total_num_tokens"] == 250_000 and oscar["max_total_num_tokens"] == 1_000_000
    assert bf16["concurrent_100k"] == 2 and oscar["concurrent_100k"] == 9
    # 32k and 128k measured; the 64k client failed and is recorded as such, not invented
    assert oscar["decode_ms_32k"] == 8.0 and oscar["decode_ms_128k"] == 32.0
    assert oscar["decode_ms_64k"] is None and "simulated client failure" in oscar["decode"]["decode_ms_64k"]["error"]
    # as many in flight as fit: 250000 // 64256 = 3 for bf16, 1000000 // 64256 = 15 for oscar
    assert bf16["throughput"]["settings"]["max_concurrency"] == 3 and bf16["throughput_tok_s"] == 3000.0
    assert bf16["steady_decode_tok_s"] == 300.0  # 3 in flight x 1000 / 10 ms per token
    assert oscar["throughput"]["settings"]["max_concurrency"] == 15
    assert not any(bf16["errors"].values()) and not any(oscar["errors"].values())
    assert "--oscar-rotations" in oscar["server_cmd"]
    assert Path(bf16["server_log"]).read_text().count("max_total_num_tokens=250000") == 1
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2 and not any(_alive(p) for p in started)


def test_configurations_run_in_parallel_one_per_gpu(fakes):
    tmp_path, pids = fakes
    rc = e2e.main(_argv(tmp_path, _free_port(), "--configs", "bf16_triton,bf16_flashinfer,fp8_e4m3",
                        "--gpus", "0,1", "--phases", "capacity,throughput"))
    assert rc == 0
    data = json.loads((tmp_path / "out" / "e2e.json").read_text())
    assert data["settings"]["gpus"] == ["0", "1"]
    cfgs = data["configs"]
    assert set(cfgs) == {"bf16_triton", "bf16_flashinfer", "fp8_e4m3"}
    assert all(c["max_total_num_tokens"] == 250_000 and c["throughput_tok_s"] == 3000.0 for c in cfgs.values())
    assert all(not any(c["errors"].values()) for c in cfgs.values())
    # the first two start at once, one per GPU; the third takes whichever GPU is free first
    assert cfgs["bf16_triton"]["gpu"] == "0" and cfgs["bf16_flashinfer"]["gpu"] == "1"
    assert cfgs["fp8_e4m3"]["gpu"] in ("0", "1")
    for c in cfgs.values():  # each server saw only its GPU
        assert f"visible GPUs: {c['gpu']}" in Path(c["server_log"]).read_text()
    ports = {c["server_cmd"].split("--port ")[1].split()[0] for c in cfgs.values()}
    assert len(ports) == 2
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 3 and not any(_alive(p) for p in started)


def test_phases_merge_across_runs(fakes):
    tmp_path, _ = fakes
    port = _free_port()
    assert e2e.main(_argv(tmp_path, port, "--configs", "bf16_triton", "--phases", "capacity")) == 0
    assert e2e.main(_argv(tmp_path, port, "--configs", "bf16_triton", "--phases", "throughput")) == 0
    entry = json.loads((tmp_path / "out" / "e2e.json").read_text())["configs"]["bf16_triton"]
    assert entry["max_total_num_tokens"] == 250_000 and entry["throughput_tok_s"] == 3000.0
    assert "decode_ms_32k" not in entry


def test_a_later_successful_run_clears_the_earlier_error(fakes, monkeypatch):
    tmp_path, _ = fakes
    port = _free_port()
    monkeypatch.setenv("FAKE_SERVER_DIE", "1")
    assert e2e.main(_argv(tmp_path, port, "--configs", "bf16_triton", "--phases", "capacity")) == 0
    path = tmp_path / "out" / "e2e.json"
    assert json.loads(path.read_text())["configs"]["bf16_triton"]["errors"]["server"]
    monkeypatch.delenv("FAKE_SERVER_DIE")
    assert e2e.main(_argv(tmp_path, port, "--configs", "bf16_triton", "--phases", "capacity")) == 0
    entry = json.loads(path.read_text())["configs"]["bf16_triton"]
    assert entry["errors"] == {"server": None, "capacity": None} and entry["max_total_num_tokens"] == 250_000


def test_server_that_dies_is_reported_with_its_log(fakes, monkeypatch):
    tmp_path, _ = fakes
    monkeypatch.setenv("FAKE_SERVER_DIE", "1")
    assert e2e.main(_argv(tmp_path, _free_port(), "--configs", "fp8_e4m3")) == 0
    entry = json.loads((tmp_path / "out" / "e2e.json").read_text())["configs"]["fp8_e4m3"]
    assert "exited with code 3" in entry["errors"]["server"] and "refusing to start" in entry["errors"]["server"]
    assert "max_total_num_tokens" not in entry


def test_bench_client_runs_without_hf_datasets_and_takes_our_options(tmp_path):
    import subprocess

    args = e2e.resolve_args(["--model", str(tmp_path)])
    ours = [a for a in e2e.bench_command(args, input_len=1, output_len=1, num_prompts=1, range_ratio=1.0,
                                         concurrency=1, warmup=0, output_file="x") if a.startswith("--")]
    client = ROOT / "benchmarks" / "bench_serving_client.py"
    code = ("import runpy, sys; sys.modules['datasets'] = None; "  # as on a machine without it
            f"sys.argv = ['c', '--help']; runpy.run_path({str(client)!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--dataset-name" in r.stdout
    assert [o for o in ours if o not in r.stdout] == []


def test_generated_rotations_take_key_and_value_group_sizes(fakes):
    """Without --rotations e2e writes capacity.py's data-free hadamard file for the shape,
    with the keys' and values' group sizes and the scale dtype asked for, and records them."""
    from oscar_kernels.contract.rotations_file import load_rotations

    tmp_path, _ = fakes
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert e2e.main(_argv(tmp_path, _free_port(), "--configs", "oscar_int2", "--phases", "capacity",
                          "--group-size", "32", "--value-group-size", "128", "--scale-dtype", "float8_e4m3fn")) == 0
    data = json.loads((tmp_path / "out" / "e2e.json").read_text())
    st = data["settings"]
    assert st["oscar_layout"] == {"group_size": 32, "value_group_size": 128, "scale_dtype": "float8_e4m3fn"}
    assert st["oscar_rotations"].endswith(f"{tmp_path.name}.hadamard.g32.v128.float8_e4m3fn.safetensors")
    m = load_rotations(st["oscar_rotations"]).meta
    assert (m.group_size, m.value_group_size, m.scale_dtype, m.recipe) == (32, 128, "float8_e4m3fn", "hadamard")
    assert data["configs"]["oscar_int2"]["server_cmd"].count(st["oscar_rotations"]) == 1
    # a file given with --rotations: e2e records that file's layout
    g128 = str(tmp_path / "g128.safetensors")
    capacity.write_shape_rotations(str(tmp_path), g128, 128, None, "float16")
    assert e2e.main(_argv(tmp_path, _free_port(), "--configs", "oscar_int2", "--phases", "capacity",
                          "--rotations", g128)) == 0
    st2 = json.loads((tmp_path / "out" / "e2e.json").read_text())["settings"]
    assert st2["oscar_layout"] == {"group_size": 128, "value_group_size": 128, "scale_dtype": "float16"}
    # no layout flags: oscar-calibrate's default layout
    assert e2e.main(_argv(tmp_path, _free_port(), "--configs", "oscar_int2", "--phases", "capacity")) == 0
    st3 = json.loads((tmp_path / "out" / "e2e.json").read_text())["settings"]
    assert st3["oscar_layout"] == {"group_size": 32, "value_group_size": 128, "scale_dtype": "float8_e4m3fn"}
    from types import SimpleNamespace  # capacity.py records the same, from --rotations too
    assert capacity.rotations_meta(SimpleNamespace(rotations=st["oscar_rotations"])) == st["oscar_layout"]
    os.remove(st["oscar_rotations"])
    assert capacity.rotations_meta(SimpleNamespace(rotations=None, group_size=32, value_group_size=None,
                                                   scale_dtype="float16")) == \
        {"group_size": 32, "value_group_size": 32, "scale_dtype": "float16"}
    from oscar_kernels.contract import layout  # capacity.py's dtype names and default are the contract's
    assert (capacity.SCALE_DTYPES, capacity.DEFAULT_SCALE_DTYPE) == (layout.SCALE_DTYPES, layout.DEFAULT_SCALE_DTYPE)
    assert capacity.shape_rotations_name("m", 128) == "m.hadamard.g128.safetensors"  # today's name
    assert capacity.shape_rotations_name("m", 128, 128, "float16") == "m.hadamard.g128.safetensors"
