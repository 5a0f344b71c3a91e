"""End-to-end on a GPU: NGRAM and STANDALONE speculative decoding (issue 49) on tinylm-A with
--kv-cache-dtype oscar_int2, against the same server without speculation (same flags otherwise).
Written without a GPU at hand: not run yet (the STANDALONE case added after the NGRAM ones).

Run on the GPU machine (SGLang under /tmp/site, tinylm-A under .device/models):
    PYTHONPATH=/tmp/site python3 -m pytest -m gpu tests/test_server_speculative_gpu.py -v -s

Servers, one at a time: the reference (oscar_int2, decode CUDA graphs; started, queried, stopped),
then one NGRAM server per draft shape: "chain" (--speculative-ngram-max-bfs-breadth 1: each verify
a chain, the accepted drafts already in their final slots) and "tree" (SGLang's default breadth 10:
tree drafts, the accepted path moved by SGLang through OscarKVPool.move_kv_cache, which SGLang
0.5.17 refuses for paged backends other than flashinfer unless the oscar _handle_ngram hook lets it
through). Both draft --speculative-num-draft-tokens 8 per verify and run the verify without CUDA
graphs (the refusals turn the decode graph, SGLang's verify graph under speculation, off).
Then a STANDALONE server: tinylm-A drafting for itself (--speculative-draft-model-path the same
folder; --speculative-num-steps 3, --speculative-eagle-topk 1, --speculative-num-draft-tokens 4,
SGLang's own STANDALONE defaults, a chain): SGLang's EAGLE-family worker, the draft's KV in SGLang's
ordinary BF16 pool on --speculative-draft-attention-backend triton (the oscar default), the target's
acceptance committed through OscarKVPool.clear_unaccepted_c128_draft_states (no KV move for a chain).

Prompts: token ids of the checkout's own Python sources (code repeats, so NGRAM accepts), sent as
input_ids with greedy sampling and ignore_eos; S = 64 sinks (one page), W = 128, page 64, chunked
prefill 1024:
- ring: 150-token prompts + 96 tokens, whose drafts cross S + W = 192 and page boundaries;
- chunk size: prompts of 1,000 (drafts cross 1,024), 1,100 and 3,000 tokens (prefilled in chunks of
  1,024, INT2 history) + 64 tokens;
- shared prefixes: two prompts with a common 1,024-token prefix, the second a radix hit;
- 16 concurrent requests of 300-1,800 tokens.
Each speculative output must equal the reference's greedy tokens up to a near-tie (the first divergence,
if any, where the reference's own top candidates are within NEAR_TIE nats: a verify computes the
drafts in one batch, so matmul and split-K rounding differ from one-token decode); every request
must have been verified (spec_verify_ct > 0), and the code prompts must accept more than one
token per verify on average (a self-drafting STANDALONE server: more than 1.5, its draft differs from
the target only by the KV cache's precision). The accept lengths (SGLang's meta_info
spec_accept_length = completion tokens / verifies) are printed and written, per server, to
benchmarks/results/server_speculative_ngram.json ("chain", "tree", "standalone").
"""
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_cases import generate


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "server_speculative_ngram.json"
pytestmark = pytest.mark.gpu

SINKS, WINDOW, PAGE, CHUNK = 64, 128, 64, 1024
DRAFT_TOKENS = 8
COMMON = ["--sampling-backend", "pytorch", "--mem-fraction-static", "0.5", "--page-size", str(PAGE),
          "--chunked-prefill-size", str(CHUNK), "--max-running-requests", "16", "--enable-cache-report",
          "--log-level", "info"]
NGRAM = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(DRAFT_TOKENS)]
STANDALONE_STEPS, STANDALONE_DRAFTS = 3, 4
# server -> its speculative flags (STANDALONE's draft model path, the served model, added at start)
SPECULATION = {"chain": NGRAM + ["--speculative-ngram-max-bfs-breadth", "1"], "tree": NGRAM,
               "standalone": ["--speculative-algorithm", "STANDALONE",
                              "--speculative-num-steps", str(STANDALONE_STEPS), "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", str(STANDALONE_DRAFTS)]}
MIN_ACCEPT = {"chain": 1.0, "tree": 1.0, "standalone": 1.5}
# (offset into the token stream, prompt tokens, new tokens)
SINGLE = [(0, 150, 96), (5000, 150, 96), (9000, 1000, 64), (12000, 1100, 64), (16000, 3000, 64)]
SHARED_PREFIX = (20000, CHUNK)  # offset, tokens
SHARED_SUFFIXES = [(22000, 60), (23000, 90)]
SHARED_NEW = 64
CONCURRENT = [(25000 + 731 * i, 300 + 100 * i, 48) for i in range(16)]  # 300 .. 1,800 tokens
NEAR_TIE = 0.1
TOP = 5


def _harness():
    from benchmarks import server_harness

    return server_harness


@pytest.fixture(scope="module")
def ids(tinylm_dir):
    """Token ids of the checkout's Python sources, repeated to the length the prompts need."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tinylm_dir))
    text = "".join(p.read_text() for d in ("sglang_ext", "oscar_kernels", "calibration")
                   for p in sorted((ROOT / d).rglob("*.py")))
    out = tok(text, add_special_tokens=False)["input_ids"]
    need = max(o + n for o, n, _ in CONCURRENT) + 1
    while len(out) < need:
        out = out + out
    return out[:need]


def _requests(ids):
    """name -> (input_ids, new tokens) of every single prompt; the shared-prefix pair in order."""
    singles = {f"single{o}x{n}": (ids[o:o + n], new) for o, n, new in SINGLE}
    po, pn = SHARED_PREFIX
    shared = [(f"shared{o}", ids[po:po + pn] + ids[o:o + n]) for o, n in SHARED_SUFFIXES]
    concurrent = [(f"concurrent{o}x{n}", ids[o:o + n], new) for o, n, new in CONCURRENT]
    return singles, shared, concurrent


def _generate(server, input_ids, new, top=False):
    return generate(server, input_ids, new, TOP if top else 0)


def _with_tops(out):
    meta = out["meta_info"]
    tops = [{int(c[1]): float(c[0]) for c in pos} for pos in meta["output_top_logprobs"]]
    return out["output_ids"], tops


def _run_all(server, ids, top):
    """Every request on ``server``: singles one by one (cache flushed first), the shared-prefix
    pair in order, the concurrent ones at once. name -> generate output."""
    singles, shared, concurrent = _requests(ids)
    assert server.get("/flush_cache") is not None
    outs = {name: _generate(server, p, new, top) for name, (p, new) in singles.items()}
    assert server.get("/flush_cache") is not None
    for name, p in shared:
        outs[name] = _generate(server, p, SHARED_NEW, top)
    with ThreadPoolExecutor(len(concurrent)) as pool:
        done = pool.map(lambda c: _generate(server, c[1], c[2], top), concurrent)
        outs.update({c[0]: o for c, o in zip(concurrent, done)})
    return outs


@pytest.fixture(scope="module")
def reference(tinylm_dir, tinylm_rotations, ids, tmp_path_factory):
    """oscar_int2 without speculation: greedy tokens and their top candidates (then stopped)."""
    h = _harness()
    args = ["--model-path", str(tinylm_dir), "--kv-cache-dtype", "oscar_int2", "--oscar-rotations", tinylm_rotations,
            "--oscar-sink-tokens", str(SINKS), "--oscar-recent-window", str(WINDOW), *COMMON]
    with h.Server("oscar-reference", args, str(tmp_path_factory.mktemp("logs"))) as server:
        return {name: _with_tops(o) for name, o in _run_all(server, ids, top=True).items()}


@pytest.fixture(scope="module", params=sorted(SPECULATION))
def ngram(request, tinylm_dir, tinylm_rotations, ids, reference, tmp_path_factory):
    """One speculative server's outputs (then stopped): (shape, name -> generate output, log text)."""
    h = _harness()
    draft = ["--speculative-draft-model-path", str(tinylm_dir)] if request.param == "standalone" else []
    args = ["--model-path", str(tinylm_dir), "--kv-cache-dtype", "oscar_int2", "--oscar-rotations", tinylm_rotations,
            "--oscar-sink-tokens", str(SINKS), "--oscar-recent-window", str(WINDOW),
            *SPECULATION[request.param], *draft, *COMMON]
    with h.Server(f"oscar-spec-{request.param}", args, str(tmp_path_factory.mktemp("logs"))) as server:
        t0 = time.monotonic()
        outs = _run_all(server, ids, top=False)
        took = time.monotonic() - t0
        info = server.get("/server_info")
        log_text = server.log_text()
    _record(request.param, outs, took, info)
    return request.param, outs, log_text


def _record(shape, outs, took, info):
    lens = {name: o["meta_info"].get("spec_accept_length") for name, o in outs.items()}
    avg = info.get("avg_spec_accept_length") if isinstance(info, dict) else None
    if avg is None and isinstance(info, dict):  # per data-parallel rank
        avg = next((i.get("avg_spec_accept_length") for i in info.get("internal_states", [])
                    if isinstance(i, dict) and "avg_spec_accept_length" in i), None)
    print(f"\n{shape}: server avg accept length {avg}; per request "
          + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in lens.items()))
    try:
        prev = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        prev = {}
    drafts = STANDALONE_DRAFTS if shape == "standalone" else DRAFT_TOKENS
    algorithm = "STANDALONE (tinylm-A drafting for itself)" if shape == "standalone" else "NGRAM"
    prev[shape] = {"model": "tinylm-A", "algorithm": algorithm, "draft_tokens": drafts, "sink_tokens": SINKS,
                   "recent_window": WINDOW, "page_size": PAGE, "server_avg_accept_length": avg,
                   "accept_length": lens, "seconds_for_all_requests": round(took, 1)}
    _harness().save_json(str(RESULTS), prev)


def test_speculative_greedy_outputs_equal_oscar_without_speculation(ngram, reference):
    h = _harness()
    shape, outs, _ = ngram
    bad = {}
    for name, (want, tops) in reference.items():
        got = outs[name]["output_ids"]
        why = h.agree_up_to_a_near_tie(got, want, tops, NEAR_TIE)
        if why is not None:
            bad[name] = why
    assert not bad, f"{shape}: {bad}"


def test_every_request_was_verified_and_code_accepts_drafts(ngram):
    shape, outs, _ = ngram
    unverified = [n for n, o in outs.items() if not o["meta_info"].get("spec_verify_ct")]
    assert not unverified, f"{shape}: no verify reported for {unverified}"
    singles = [o["meta_info"]["spec_accept_length"] for n, o in outs.items() if n.startswith("single")]
    assert sum(singles) / len(singles) > MIN_ACCEPT[shape], f"{shape}: accept lengths {singles}"


def test_shared_prefix_was_a_radix_hit(ngram):
    shape, outs, _ = ngram
    second = outs[f"shared{SHARED_SUFFIXES[1][0]}"]["meta_info"]
    assert second.get("cached_tokens", 0) >= SHARED_PREFIX[1], (shape, second.get("cached_tokens"))


def test_verify_ran_without_cuda_graphs(ngram):
    """The decode graph (SGLang's TARGET_VERIFY graph under speculation) is off: no capture in the
    log; nor the STANDALONE draft worker's own graphs, which follow the same switch."""
    shape, _, log_text = ngram
    assert "Capture target decode CUDA graph end" not in log_text, shape
    assert "Capture draft decode CUDA graph" not in log_text, shape
