"""HiCache end to end on a GPU (issue 31): tinylm-A served with --kv-cache-dtype oscar_int2
--enable-hierarchical-cache on a device pool smaller than the working set, against the same
requests on an oscar_int2 server whose device pool never evicts.

Run on the GPU machine (SGLang under /tmp/site, tinylm-A under .device/models):
    PYTHONPATH=/tmp/site python3 -m pytest -m gpu tests/test_server_hicache_gpu.py -v -s

Workload: four long shared prefixes (8k-14k tokens, multiples of the 64-token page, cut from
SGLang's own sources), each asked ROUNDS times with a new 32-token suffix, one request at a
time in the same order on both servers (greedy, 16 tokens, ignore_eos), prefilled in 1,024-
token chunks. The HiCache server holds 24,576 tokens on the device (under two prefixes) and
8x that on the host (--hicache-ratio 8: the whole working set), with SGLang's default
write-through policy: a prefix is backed up when its first request finishes, and by the time
it is asked again the three others have pushed it off the device, so it comes back from host
(its first page included: the sink rule of sglang_ext.host_pool is what keeps its BF16 sinks).
Both servers keep S = 64 sink tokens (one page), so reading a loaded first page as INT2
instead of its BF16 sinks would move the logits of every later request on that prefix.

What must hold: every request succeeds; greedy outputs equal the never-evicting server's
token for token (a hit from host reads the very cells and sinks a device hit reads); after the
first round every prefix is a full hit (device + host tokens = the prefix, only the suffix is
recomputed) and host hits happen, whole prefixes among them; SGLang's load-back counter
(/metrics, --enable-metrics) equals the host tokens the requests report
(meta_info.cached_tokens_details); after /flush_cache the device pool's used tokens are back
to their start value, and SGLang's idle leak check (strict: SGLANG_ENABLE_STRICT_MEM_CHECK_
DURING_IDLE=1 makes a leak stop the scheduler) never fired.
"""
import re
import time
from pathlib import Path

import pytest


pytestmark = pytest.mark.gpu

PAGE = 64
PREFIXES = (8192, 10240, 12288, 14336)  # tokens; tinylm-A's context is 16,384
SUFFIX, OUTPUT, ROUNDS = 32, 16, 3
DEVICE_TOKENS = 24576  # the HiCache server's --max-total-tokens: not two prefixes
# the same request rows and sink slots on both servers (SGLang sizes rows from the pool): no
# sink slot is handed out twice over the run, so the never-evicting server reads BF16 sinks
COMMON = ["--kv-cache-dtype", "oscar_int2", "--oscar-sink-tokens", "64", "--page-size", str(PAGE),
          "--max-running-requests", "8", "--oscar-sink-slots", "64",
          "--chunked-prefill-size", "1024", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.5",
          "--cuda-graph-max-bs-decode", "8", "--enable-metrics", "--log-level", "warning"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-ratio", "8",
           "--max-total-tokens", str(DEVICE_TOKENS)]
NEVER_EVICTS = ["--max-total-tokens", str(8 * DEVICE_TOKENS)]
STRICT_LEAK_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


def _harness():
    from benchmarks import server_harness

    return server_harness


@pytest.fixture(scope="module")
def workload(tinylm_dir):
    """[(prefix index, input ids)] in sending order: ROUNDS rounds over the prefixes, each
    request its own suffix (so a hit is exactly the prefix)."""
    import sglang
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tinylm_dir))
    srt = Path(sglang.__file__).parent / "srt" / "managers"
    ids: list[int] = []
    need = sum(PREFIXES) + ROUNDS * len(PREFIXES) * SUFFIX
    for path in sorted(srt.glob("*.py")):
        ids.extend(tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
        if len(ids) >= need:
            break
    assert len(ids) >= need, f"SGLang's managers/*.py hold {len(ids)} tokens, {need} needed"
    prefixes, at = [], 0
    for n in PREFIXES:
        prefixes.append(ids[at:at + n])
        at += n
    out = []
    for r in range(ROUNDS):
        for i, prefix in enumerate(prefixes):
            out.append((i, prefix + ids[at:at + SUFFIX]))
            at += SUFFIX
    return out


def _used_tokens(server) -> int:
    """The device pool's used tokens now (/v1/loads, computed on request)."""
    loads = server.get("/v1/loads?include=core")
    assert isinstance(loads, dict) and loads.get("loads"), loads
    return sum(int(load["num_used_tokens"]) for load in loads["loads"])


def _counter(server, name: str) -> float | None:
    text = server.get("/metrics")
    assert isinstance(text, str), "no /metrics (--enable-metrics)"
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found) if found else None


def _serve(name, args, workload, log_dir, env=None) -> dict:
    """Start a server, send the requests one at a time, flush; what the tests read."""
    h = _harness()
    server = h.Server(name, args, log_dir, env=env)
    try:
        server.start()
        start_used = _used_tokens(server)
        runs = []
        for i, ids in workload:
            r = server.post("/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": OUTPUT, "temperature": 0.0, "ignore_eos": True}})
            meta = r["meta_info"]
            details = meta.get("cached_tokens_details") or {}
            runs.append({"prefix": i, "prompt": len(ids), "output_ids": list(r["output_ids"]),
                         "finish": (meta.get("finish_reason") or {}).get("type"),
                         "completion": meta["completion_tokens"], "cached": meta["cached_tokens"],
                         "device": int(details.get("device", meta["cached_tokens"])),
                         "host": int(details.get("host", 0))})
        time.sleep(3)  # idle: SGLang's leak check runs
        alive_after_idle = server.alive()
        load_back = _counter(server, "sglang:load_back_tokens_total")
        evicted = _counter(server, "sglang:evicted_tokens_total")
        flushed = server.get("/flush_cache") is not None
        time.sleep(1)
        return {"runs": runs, "start_used": start_used, "end_used": _used_tokens(server), "flushed": flushed,
                "alive_after_idle": alive_after_idle, "load_back": load_back, "evicted": evicted,
                "leak_lines": [ln for ln in server.log_text().splitlines() if "memory leak detected" in ln]}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def never_evicts(tinylm_dir, tinylm_rotations, workload, tmp_path_factory):
    args = ["--model-path", str(tinylm_dir), "--oscar-rotations", tinylm_rotations, *COMMON, *NEVER_EVICTS]
    return _serve("oscar-never-evicts", args, workload, str(tmp_path_factory.mktemp("logs")))


@pytest.fixture(scope="module")
def hicache(tinylm_dir, tinylm_rotations, workload, never_evicts, tmp_path_factory):
    args = ["--model-path", str(tinylm_dir), "--oscar-rotations", tinylm_rotations, *COMMON, *HICACHE]
    return _serve("oscar-hicache", args, workload, str(tmp_path_factory.mktemp("logs")), env=STRICT_LEAK_CHECK)


def test_every_request_succeeds(hicache, never_evicts):
    for got in (never_evicts, hicache):
        for run in got["runs"]:
            assert run["finish"] == "length" and run["completion"] == OUTPUT == len(run["output_ids"]), run


def test_reference_never_evicts(never_evicts):
    """The comparison's premise: after the first round every request hits its whole prefix on
    the device."""
    for k, run in enumerate(never_evicts["runs"]):
        want = PREFIXES[run["prefix"]] if k >= len(PREFIXES) else 0
        assert (run["device"], run["host"]) == (want, 0), (k, run)


def test_greedy_outputs_equal_the_never_evicting_server(hicache, never_evicts):
    for k, (got, want) in enumerate(zip(hicache["runs"], never_evicts["runs"])):
        assert got["output_ids"] == want["output_ids"], (k, got["prefix"], got["device"], got["host"])


def test_prefixes_come_back_from_host(hicache):
    """Tokens loaded from host vs recomputed: after the first round only the suffix is
    computed; host hits happen, whole prefixes (first page and its sinks) among them;
    SGLang's own load-back counter agrees with what the requests report."""
    runs = hicache["runs"]
    first, later = runs[:len(PREFIXES)], runs[len(PREFIXES):]
    for run in first:
        assert run["cached"] == 0, run
    for run in later:
        assert run["device"] + run["host"] == run["cached"] == PREFIXES[run["prefix"]], run
        assert run["prompt"] - run["cached"] == SUFFIX, run
    host = sum(r["host"] for r in later)
    recomputed = sum(r["prompt"] - r["cached"] for r in runs)
    whole = [r for r in later if r["host"] == PREFIXES[r["prefix"]]]
    print(f"\nHiCache tinylm-A: {host} prompt tokens loaded from host, "
          f"{sum(r['device'] for r in later)} device hits, {recomputed} computed "
          f"({sum(PREFIXES)} of them the first round's prefixes); {len(whole)} of {len(later)} later "
          f"requests loaded their whole prefix; SGLang load-back {hicache['load_back']}, "
          f"evicted {hicache['evicted']} tokens")
    assert host > 0 and whole, [(r["prefix"], r["device"], r["host"]) for r in later]
    assert hicache["evicted"] and hicache["evicted"] > 0
    assert hicache["load_back"] == host


def test_no_leak(hicache, never_evicts):
    for got in (never_evicts, hicache):
        assert got["alive_after_idle"] and not got["leak_lines"], got["leak_lines"]
        assert got["flushed"] and got["end_used"] == got["start_used"], (got["start_used"], got["end_used"])
