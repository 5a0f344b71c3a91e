"""End-to-end on a GPU: a real SGLang 0.5.17 server with --kv-cache-dtype oscar_int2
(plugin entry point, OscarKVPool, OscarAttnBackend, CUDA-graph decode, chunked prefill
1024, radix cache) against a BF16 server on the same model, through the openai client.

Run on the GPU machine (SGLang under /tmp/site, tinylm-A under .device/models):
    PYTHONPATH=/tmp/site python3 -m pytest -m gpu tests/test_server_gpu.py -v

Servers: one BF16 reference (started, queried, stopped), one OSCAR server for the module.
The OSCAR server keeps S = 64 sink tokens (one page): a radix hit on a one-page prefix then
reads the shared page's BF16 sinks, so its greedy output must equal the uncached run's
(with S < page size the hit reads shared positions >= S as INT2 by design, which moves
logits slightly). Rotations: made on the fly by oscar-calibrate (recipe oscar) on the
checkout's own Python sources.

Inside the windows OSCAR attends over BF16 copies of the *rotated* keys and values, so its
logits differ from BF16's by rounding (~1e-3); greedy outputs are equal except where
BF16's own top candidates are within NEAR_TIE nats (seen: after "PASSKEY_K" tinylm-A
rates "R" -3.119 and "J" -3.182; after "PASSKEY_" "R" and "K" both -3.2312 and OSCAR took
"8", BF16's third). The comparisons therefore accept one divergence at such a near-tie,
provided OSCAR picked one of BF16's top TOP_LOGPROBS there within NEAR_TIE of its best;
anything else fails.
"""
import json
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu

SINKS, WINDOW = 64, 128  # the OSCAR server's S and W: prompts + outputs <= S + W stay BF16
COMMON = ["--sampling-backend", "pytorch", "--mem-fraction-static", "0.5", "--page-size", "64",
          "--chunked-prefill-size", "1024", "--cuda-graph-max-bs-decode", "8", "--enable-cache-report",
          "--log-level", "warning"]
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(",
]
CHAT = [{"role": "user", "content": "Write a Python function that reverses a string."}]
MAX_TOKENS = 24
NEAR_TIE = 0.1  # nats between BF16's best and OSCAR's choice
TOP_LOGPROBS = 5  # the OpenAI API's most


def _harness():
    from benchmarks import server_harness

    return server_harness


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600)


def _complete(client, prompt, stream=False, max_tokens=MAX_TOKENS, ignore_eos=False):
    """(text, usage) of a greedy /v1/completions request."""
    kw = dict(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0,
              extra_body={"ignore_eos": True} if ignore_eos else None)
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.usage
    text, usage = "", None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            text += chunk.choices[0].text or ""
        usage = chunk.usage or usage
    return text, usage


def _greedy_tokens(client, prompt):
    """(tokens, top candidates per position) of a greedy /v1/completions request."""
    return _greedy_with_usage(client, prompt)[:2]


def _greedy_with_usage(client, prompt):
    """(tokens, top candidates per position, usage) of a greedy /v1/completions request."""
    r = client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=TOP_LOGPROBS)
    lp = r.choices[0].logprobs
    return list(lp.tokens), [dict(t) for t in lp.top_logprobs], r.usage


def _cached_tokens(usage) -> int:
    """Prompt tokens served from the radix cache (SGLang omits the details when none)."""
    details = usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def _chat_tokens(client):
    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=TOP_LOGPROBS)
    content = r.choices[0].logprobs.content
    return [c.token for c in content], [{t.token: t.logprob for t in c.top_logprobs} for c in content]


def _chat(client, stream=False):
    kw = dict(model="default", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage
    text, usage = "", None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    return text, usage


@pytest.fixture(scope="module")
def bf16(tinylm_dir, tmp_path_factory):
    """Greedy outputs and capacity of the BF16 reference server (then stopped)."""
    h = _harness()
    log_dir = str(tmp_path_factory.mktemp("logs"))
    # no CUDA graphs for the reference: on a fresh machine their capture compiled SGLang's
    # Triton kernels for 169 s; capacity is sized before capture, greedy outputs do not change
    with h.Server("bf16", ["--model-path", str(tinylm_dir), "--attention-backend", "triton",
                           "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph", *COMMON], log_dir) as server:
        client = _client(server)
        return {"completions": [_greedy_tokens(client, p) for p in PROMPTS],
                "chat": _chat_tokens(client),
                "max_total_num_tokens": server.max_total_num_tokens()[0]}


@pytest.fixture(scope="module")
def oscar(tinylm_dir, tinylm_rotations, bf16, tmp_path_factory):
    h = _harness()
    log_dir = str(tmp_path_factory.mktemp("logs"))
    server = h.Server("oscar", ["--model-path", str(tinylm_dir), "--kv-cache-dtype", "oscar_int2",
                                "--oscar-rotations", tinylm_rotations, "--oscar-sink-tokens", str(SINKS),
                                "--oscar-recent-window", str(WINDOW), *COMMON], log_dir)
    server.start()
    yield server
    server.stop()


def test_capacity_is_at_least_6_5x_bf16(oscar, bf16):
    tokens = oscar.max_total_num_tokens()[0]
    assert tokens >= 6.5 * bf16["max_total_num_tokens"], (tokens, bf16["max_total_num_tokens"])


def test_completions_match_bf16_within_the_windows(oscar, bf16):
    client = _client(oscar)
    for prompt, (want, want_top) in zip(PROMPTS, bf16["completions"]):
        got, _ = _greedy_tokens(client, prompt)
        assert _harness().agree_up_to_a_near_tie(got, want, want_top, NEAR_TIE) is None, (prompt, got, want)
        for stream in (False, True):  # both response forms carry the same greedy text
            text, usage = _complete(client, prompt, stream=stream)
            assert usage.prompt_tokens + usage.completion_tokens <= SINKS + WINDOW
            assert text == "".join(got)


def test_chat_matches_bf16_within_the_windows(oscar, bf16):
    client = _client(oscar)
    got, _ = _chat_tokens(client)
    want, want_top = bf16["chat"]
    assert _harness().agree_up_to_a_near_tie(got, want, want_top, NEAR_TIE) is None, (got, want)
    for stream in (False, True):
        text, usage = _chat(client, stream=stream)
        assert usage.prompt_tokens + usage.completion_tokens <= SINKS + WINDOW
        assert text == "".join(got)


def test_radix_hit_matches_uncached_run(oscar, tinylm_dir):
    """A hit on a one-page prefix reads the shared page's BF16 sinks: its greedy tokens equal
    the uncached run's up to a near-tie of the uncached run (the hit attends the prefix and
    the new tokens in two FlashInfer passes merged, the uncached run in one: rounding)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tinylm_dir))
    prefix = tok(Path(json.__file__).read_text())["input_ids"][:64]  # one page: the shared sinks
    first = prefix + tok("first_helper = make_helper(1)\n")["input_ids"]
    second = prefix + tok("class SecondHelper:\n")["input_ids"]
    assert first[64] != second[64]  # the requests share exactly the one-page prefix
    client = _client(oscar)
    assert oscar.get("/flush_cache") is not None
    cold, cold_top, cold_usage = _greedy_with_usage(client, second)
    assert _cached_tokens(cold_usage) == 0
    assert oscar.get("/flush_cache") is not None
    _complete(client, first)
    hit, _, hit_usage = _greedy_with_usage(client, second)
    assert _cached_tokens(hit_usage) == 64
    assert _harness().agree_up_to_a_near_tie(hit, cold, cold_top, NEAR_TIE) is None, (hit, cold)


def test_long_prompt_chunked_prefill_and_int2_history(oscar, tinylm_dir):
    """~2500 prompt tokens: three prefill chunks, INT2 history, then a radix hit on it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tinylm_dir))
    ids = tok((ROOT / "sglang_ext" / "pool.py").read_text() * 3)["input_ids"][:2500]
    client = _client(oscar)
    assert oscar.get("/flush_cache") is not None
    for expect_hit in (False, True):
        text, usage = _complete(client, ids, max_tokens=48, ignore_eos=True)
        assert usage.prompt_tokens == 2500 and usage.completion_tokens == 48 and text.strip()
        assert (_cached_tokens(usage) > 2000) == expect_hit


def test_concurrent_requests_share_graph_decode_batches(oscar, tinylm_dir):
    """Eight requests at once (short and long, cache hits and misses): decode runs in
    padded CUDA-graph batches over several request rows; every request completes."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tinylm_dir))
    long_ids = tok((ROOT / "sglang_ext" / "backend.py").read_text())["input_ids"][:1500]
    prompts = PROMPTS + [long_ids[:n] for n in (300, 700, 1100, 1500)]
    client = _client(oscar)
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: _complete(client, p, max_tokens=40, ignore_eos=True), prompts))
    for text, usage in results:
        assert usage.completion_tokens == 40 and text.strip()


# a prefix read against the module server's (--oscar-extend-prefix auto: flashinfer where it
# imports), teacher-forced: mean |NLL difference| per token and the ratio of the mean NLLs, over
# the tokens that read a cached prefix. Measured on the H200 (session 5, against the int2 read):
# bf16 read 0.0301 nats mean (max 1.44), NLL ratio 0.9999; flashinfer read 0.0322 (max 0.95),
# 0.9997. All three reads compute the same attention over the same dequantised prefix, in other
# orders and roundings; the spread is the INT2 code flips that such a rounding-level change in a
# hidden state causes in the tokens that chunk stores (a wrong read -- rotation, scale, position
# -- moves the NLL ratio by far more than 0.5%). The first bound, 0.02, was a guess below that.
READ_NLL_MEAN_ABS_DIFF = 0.05
READ_NLL_RATIO_TOLERANCE = 0.005


def _default_prefix_read() -> str:
    import importlib.util

    from sglang_ext.settings import DEFAULT_EXTEND_PREFIX, resolve_extend_prefix

    return resolve_extend_prefix(DEFAULT_EXTEND_PREFIX, True, importlib.util.find_spec("flashinfer") is not None)


@pytest.mark.parametrize("read", ["int2", "bf16"])
def test_prefix_reads_score_a_prompt_as_the_default_read_does(oscar, tinylm_dir, tinylm_rotations, tmp_path, read):
    """--oscar-extend-prefix int2 / bf16 against the default (flashinfer): a 3,000-token
    prompt prefilled in 1,024-token chunks (chunks 2 and 3 read the cached prefix through the
    read under test) gets the default read's per-token negative log-likelihoods up to
    rounding: mean |difference| <= READ_NLL_MEAN_ABS_DIFF nats and mean NLL within
    READ_NLL_RATIO_TOLERANCE, over the tokens of chunks 2 and 3. Teacher-forced, not greedy:
    a greedy continuation drifts (a rounding-level change of one hidden state can flip an INT2
    code of a later token; seen on the H200, session 4: the bf16 read's 21st greedy token
    differed, top-2 gap 0.75 nats), so token equality would not tell a wrong read from a
    reordered sum."""
    from transformers import AutoTokenizer

    default = _default_prefix_read()
    if read == default:
        pytest.skip(f"the module server already reads {read} (flashinfer does not import)")
    h = _harness()
    from benchmarks import server_fidelity

    tok = AutoTokenizer.from_pretrained(str(tinylm_dir))
    ids = tok((ROOT / "sglang_ext" / "backend.py").read_text() * 4)["input_ids"][:3000]
    assert len(ids) == 3000
    assert oscar.get("/flush_cache") is not None
    want = server_fidelity.window_nll(oscar, ids)
    args = ["--model-path", str(tinylm_dir), "--kv-cache-dtype", "oscar_int2", "--oscar-rotations", tinylm_rotations,
            "--oscar-sink-tokens", str(SINKS), "--oscar-recent-window", str(WINDOW),
            "--oscar-extend-prefix", read, *COMMON]
    args[args.index("--mem-fraction-static") + 1] = "0.3"  # next to the module's oscar server
    with h.Server(f"oscar-{read}-prefix", args, str(tmp_path)) as server:
        got = server_fidelity.window_nll(server, ids)
    tail = slice(1023, None)  # predictions by tokens 1024.. (chunks 2 and 3)
    diffs = [abs(a - b) for a, b in zip(got[tail], want[tail])]
    mean_diff = sum(diffs) / len(diffs)
    ratio = sum(got[tail]) / sum(want[tail])
    print(f"{read} read vs {default} read over {len(diffs)} tokens: mean |dNLL| {mean_diff:.4f} nats, "
          f"max {max(diffs):.3f}, NLL ratio {ratio:.4f}")
    assert mean_diff <= READ_NLL_MEAN_ABS_DIFF and abs(ratio - 1) <= READ_NLL_RATIO_TOLERANCE, \
        (mean_diff, max(diffs), ratio)


def test_deterministic_inference_outputs_do_not_depend_on_the_load(tinylm_dir, tinylm_rotations, tmp_path):
    """--enable-deterministic-inference: four prompts of 1,200-3,000 tokens (prefilled in
    1,024-token chunks, INT2 history) give the same 48 greedy tokens alone and sent at once
    with four other requests (other batch sizes, other chunk packings, decode in padded
    CUDA-graph batches)."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    h = _harness()
    tok = AutoTokenizer.from_pretrained(str(tinylm_dir))
    ids = tok((ROOT / "sglang_ext" / "pool.py").read_text() * 4)["input_ids"]
    probes = [ids[s:s + n] for s, n in ((0, 3000), (500, 1200), (900, 2100), (1700, 2600))]
    noise = [ids[s:s + n] for s, n in ((100, 700), (250, 1900), (40, 300), (1300, 1500))]
    args = ["--model-path", str(tinylm_dir), "--kv-cache-dtype", "oscar_int2", "--oscar-rotations", tinylm_rotations,
            "--enable-deterministic-inference", *COMMON]
    args[args.index("--mem-fraction-static") + 1] = "0.3"  # next to the module's oscar server
    with h.Server("oscar-deterministic", args, str(tmp_path)) as server:
        client = _client(server)
        run = lambda p: _complete(client, p, max_tokens=48, ignore_eos=True)[0]  # noqa: E731
        alone = [run(p) for p in probes]
        with ThreadPoolExecutor(len(probes) + len(noise)) as pool:
            loaded = list(pool.map(run, probes + noise))[:len(probes)]
    assert all(alone) and loaded == alone
