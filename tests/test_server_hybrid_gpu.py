"""End-to-end on a GPU: the hybrid rows of calibration/architectures.py, served by SGLang 0.5.17
with --kv-cache-dtype oscar_int2 against a BF16 server (SGLang's Triton backend) on the same folder.
Written without a GPU at hand: not run yet.

- qwen3-next-80b-a3b (8 layers, Gated DeltaNet linear attention with full attention at 3 and 7,
  16 query / 2 KV heads of dim 256): OscarKVPool inside SGLang's HybridLinearKVPool,
  OscarAttnBackend inside its HybridLinearAttnBackend; SGLang's GDN backend, MambaPool and mamba
  radix cache.
- gpt-oss-20b (4 layers, sliding window 128 at 0 and 2, full attention at 1 and 3, learned sinks
  on every layer, 64 query / 8 KV heads of dim 64, MoE): OscarKVPool for the full layers inside
  SGLang's SWAKVPool, whose BF16 SWA pool holds the sliding layers; OscarSWAAttnBackend (full layers
  through OscarAttnBackend with the sinks, sliding layers through SGLang's Triton backend).

Run on the GPU machine, after the SGLang wheelhouse is installed (../shared/device/README.md):

    PYTHONPATH=/tmp/site python3 -m pytest -m gpu tests/test_server_hybrid_gpu.py -v

Checks per row (as benchmarks/architectures_serving.py does, plus the radix hit):
- decode CUDA graphs captured;
- greedy tokens of prompts that fit in S + W equal BF16's up to a near-tie;
- a 6,000-token prompt in chunks of 1,024 (INT2 history for the full-attention layers; the GDN
  state or the sliding window carried across chunks by SGLang) + 32 tokens;
- 16 concurrent requests of 300-3,000 tokens complete;
- a radix hit on a one-page prefix (S = 64: the shared page's BF16 sinks; the GDN state from the
  mamba radix cache's snapshot, or the SWA pool's cells of the prefix) gives the cold prefill's tokens.
"""
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_cases import gpu_model_dir, stdlib_token_ids, calibrate_on_gpu, generate

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu

ROWS = ("qwen3-next-80b-a3b", "gpt-oss-20b")
SINKS, WINDOW = 64, 128
COMMON = ["--sampling-backend", "pytorch", "--page-size", "64", "--chunked-prefill-size", "1024",
          "--mem-fraction-static", "0.3", "--max-running-requests", "32", "--log-level", "info"]
GRAPH_LINE = re.compile(r"Capture target decode CUDA graph end[^\n]*")
WINDOW_PROMPTS = ((0, 40), (500, 64), (1100, 90))  # (offset, tokens): prompt + 24 <= S + W
GREEDY_TOKENS = 24
LONG_PROMPT = 6000
CONCURRENT = [(3000 + 997 * i, 300 + 180 * i) for i in range(16)]  # 300 .. 3000 tokens
NEAR_TIE = 0.1


def _harness():
    from benchmarks import server_harness

    return server_harness


@pytest.fixture(scope="module", params=ROWS)
def row(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(row, tmp_path_factory):
    return gpu_model_dir(row, tmp_path_factory)


@pytest.fixture(scope="module")
def ids(model_dir):
    return stdlib_token_ids(model_dir, max(o + n for o, n in CONCURRENT) + LONG_PROMPT)


@pytest.fixture(scope="module")
def rotations(row, model_dir, tmp_path_factory):
    return calibrate_on_gpu(model_dir, tmp_path_factory.mktemp("rot") / f"{row}.oscar.safetensors")


def _generate(server, ids, max_new_tokens, top=False):
    return generate(server, ids, max_new_tokens, 5 if top else 0)


def _greedy(server, ids):
    meta = _generate(server, ids, GREEDY_TOKENS, top=True)["meta_info"]
    tokens = [int(t[1]) for t in meta["output_token_logprobs"]]
    tops = [{int(c[1]): float(c[0]) for c in pos} for pos in meta["output_top_logprobs"]]
    return tokens, tops, meta


@pytest.fixture(scope="module")
def bf16(row, model_dir, ids, tmp_path_factory):
    """Greedy outputs of the BF16 reference (SGLang's Triton backend), then stopped."""
    h = _harness()
    with h.Server(f"{row}-bf16", ["--model-path", model_dir, "--attention-backend", "triton",
                                      "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph", *COMMON],
                  str(tmp_path_factory.mktemp("logs"))) as server:
        return [_greedy(server, ids[o:o + n])[:2] for o, n in WINDOW_PROMPTS]


@pytest.fixture(scope="module")
def oscar(row, model_dir, rotations, bf16, tmp_path_factory):
    h = _harness()
    server = h.Server(f"{row}-oscar", ["--model-path", model_dir, "--kv-cache-dtype", "oscar_int2",
                                           "--oscar-rotations", rotations, "--oscar-sink-tokens", str(SINKS),
                                           "--oscar-recent-window", str(WINDOW), "--cuda-graph-max-bs-decode", "16",
                                           *COMMON], str(tmp_path_factory.mktemp("logs")))
    server.start()
    yield server
    server.stop()


def test_decode_cuda_graphs_were_captured(oscar):
    assert GRAPH_LINE.search(oscar.log_text()), "no decode CUDA graph capture in the oscar server's log"


def test_greedy_tokens_match_bf16_within_the_windows(oscar, bf16, ids):
    h = _harness()
    assert oscar.get("/flush_cache") is not None
    for (o, n), (want, want_top) in zip(WINDOW_PROMPTS, bf16):
        got = _greedy(oscar, ids[o:o + n])[0]
        assert h.agree_up_to_a_near_tie(got, want, want_top, NEAR_TIE) is None, (n, got, want)


def test_long_prompt_in_chunks_of_1024(oscar, ids):
    out = _generate(oscar, ids[:LONG_PROMPT], 32)
    assert len(out["output_ids"]) == 32
    assert out["meta_info"]["prompt_tokens"] == LONG_PROMPT


def test_16_concurrent_requests_complete(oscar, ids):
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        outs = list(pool.map(lambda on: _generate(oscar, ids[on[0]:on[0] + on[1]], 32), CONCURRENT))
    assert [len(o["output_ids"]) for o in outs] == [32] * len(CONCURRENT)


def test_radix_hit_on_one_page_gives_the_cold_prefills_tokens(oscar, ids):
    """The second prompt cold, then after a first prompt that shares its first page: the hit
    reads that page's BF16 sinks (S = 64) and INT2 cells for the full layers, and the other layers
    their state from SGLang (the mamba snapshot at 64 tokens or the SWA pool's cells); its greedy
    tokens equal the cold run's up to a near-tie."""
    h = _harness()
    prefix = ids[7000:7064]
    first, second = prefix + ids[8000:8030], prefix + ids[9000:9030]
    assert oscar.get("/flush_cache") is not None
    cold, cold_top, cold_meta = _greedy(oscar, second)
    assert cold_meta.get("cached_tokens", 0) == 0
    assert oscar.get("/flush_cache") is not None
    _generate(oscar, first, 8)
    hit, _, hit_meta = _greedy(oscar, second)
    assert hit_meta.get("cached_tokens") == 64, hit_meta.get("cached_tokens")
    assert h.agree_up_to_a_near_tie(hit, cold, cold_top, NEAR_TIE) is None, (hit, cold)
