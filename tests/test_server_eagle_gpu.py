"""End-to-end on a GPU: EAGLE-3 and NEXTN (MTP) speculative decoding (issue 49) with
--kv-cache-dtype oscar_int2, against the same server without speculation. Written without a GPU at
hand: not run yet.

Run on the GPU machine, after the SGLang wheelhouse is installed (../shared/device/README.md):

    PYTHONPATH=/tmp/site python3 -m pytest -m gpu tests/test_server_eagle_gpu.py -v -s

Rows (calibration/architectures.py, random weights from build_model_dir, rotations calibrated on
them as test_server_hybrid_gpu does):
- "eagle3": llama-3.1-8b (LlamaForCausalLM, 2 layers) with an EAGLE-3 draft folder holding only a
  config (LlamaForCausalLMEagle3: one layer of the target's attention geometry, fed the target's
  hidden states after layers -1 and 0 -- eagle_aux_hidden_state_layer_ids [-1, 0], the two a
  2-layer target can capture --, its LM head the target's), loaded with
  --speculative-draft-load-format dummy;
- "nextn": glm-4.7 (Glm4MoeForCausalLM, 2 layers) with num_nextn_predict_layers 1 in its config:
  SGLang serves its MTP layer (Glm4MoeForCausalLMNextN, the target's folder as the draft, the
  target's embedding and LM head) with --speculative-algorithm NEXTN, the layer's weights dummy
  (the checkpoint has none).
Both draft chains (the oscar defaults: --speculative-num-steps 3, --speculative-eagle-topk 1,
--speculative-num-draft-tokens 4), the draft's KV in SGLang's BF16 pool on Triton, the target's
verify through the oscar backend and its acceptance through OscarKVPool.clear_unaccepted_c128_draft_states.

Per row one server pair, one at a time: the reference (oscar_int2, no speculation; started,
queried, stopped), then the speculative server. S = 64 sinks, W = 128, page 64, chunked prefill
1,024. Prompts: two of 150 tokens + 96 new (drafts cross S + W = 192 and page boundaries), one of
1,100 tokens (two chunks, INT2 history) + 48 new, then 8 concurrent requests of 300-1,000 tokens
+ 32 new; greedy, ignore_eos. Checks: every speculative output equals the reference's greedy tokens
up to a near-tie (at the first divergence, the reference's own top candidates within NEAR_TIE
nats: a verify computes the drafts in one batch); every request was verified (spec_verify_ct > 0);
the target's budget charged the draft's BF16 KV (the oscar pool-plan log line); no decode CUDA
graph was captured (the verify's nor the draft's). Random-weight drafts accept little: the accept
lengths (meta_info spec_accept_length, the server's average) are printed, not asserted.
"""
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_cases import gpu_model_dir, stdlib_token_ids, calibrate_on_gpu, generate

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu

SINKS, WINDOW, PAGE, CHUNK = 64, 128, 64, 1024
COMMON = ["--sampling-backend", "pytorch", "--mem-fraction-static", "0.4", "--page-size", str(PAGE),
          "--chunked-prefill-size", str(CHUNK), "--max-running-requests", "16", "--log-level", "info"]
# row -> (architecture row, speculative flags; {draft} is the EAGLE-3 draft folder)
ROWS = {
    "eagle3": ("llama-3.1-8b", ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "{draft}",
                                "--speculative-draft-load-format", "dummy"]),
    "nextn": ("glm-4.7", ["--speculative-algorithm", "NEXTN", "--speculative-draft-load-format", "dummy"]),
}
SINGLE = [(0, 150, 96), (3000, 150, 96), (6000, 1100, 48)]  # (offset, prompt tokens, new tokens)
CONCURRENT = [(9000 + 613 * i, 300 + 100 * i, 32) for i in range(8)]  # 300 .. 1,000 tokens
NEAR_TIE = 0.1
TOP = 5
DRAFT_CHARGED = re.compile(r"oscar_int2 pool plan: .* \+ (\d+) B/token of the draft model's BF16 KV")


def _harness():
    from benchmarks import server_harness

    return server_harness


@pytest.fixture(scope="module", params=sorted(ROWS))
def row(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(row, tmp_path_factory):
    out = gpu_model_dir(ROWS[row][0], tmp_path_factory)
    if row == "nextn":  # the config of a model with one MTP layer (SGLang loads it as the NEXTN draft)
        path = Path(out) / "config.json"
        cfg = json.loads(path.read_text())
        cfg["num_nextn_predict_layers"] = 1
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


@pytest.fixture(scope="module")
def draft_dir(row, model_dir, tmp_path_factory):
    """The EAGLE-3 draft: a config only (its weights are dummy), sized to the target."""
    if row != "eagle3":
        return None
    target = json.loads((Path(model_dir) / "config.json").read_text())
    out = tmp_path_factory.mktemp("eagle3-draft")
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "vocab_size",
            "bos_token_id", "eos_token_id", "pad_token_id")
    cfg = {k: target[k] for k in keep if k in target}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               intermediate_size=512, target_hidden_size=target["hidden_size"], tie_word_embeddings=False,
               torch_dtype="bfloat16", eagle_config={"eagle_aux_hidden_state_layer_ids": [-1, 0]})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return str(out)


@pytest.fixture(scope="module")
def ids(model_dir):
    return stdlib_token_ids(model_dir, max(o + n for o, n, _ in SINGLE + CONCURRENT))


@pytest.fixture(scope="module")
def rotations(row, model_dir, tmp_path_factory):
    return calibrate_on_gpu(model_dir, tmp_path_factory.mktemp("rot") / f"{row}.oscar.safetensors")


def _generate(server, input_ids, new, top=False):
    return generate(server, input_ids, new, TOP if top else 0)


def _run_all(server, ids, top):
    """name -> generate output: the single prompts one by one (cache flushed first), then the
    concurrent ones at once."""
    assert server.get("/flush_cache") is not None
    outs = {f"single{o}x{n}": _generate(server, ids[o:o + n], new, top) for o, n, new in SINGLE}
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        done = pool.map(lambda c: _generate(server, ids[c[0]:c[0] + c[1]], c[2], top), CONCURRENT)
        outs.update({f"concurrent{o}x{n}": d for (o, n, _), d in zip(CONCURRENT, done)})
    return outs


def _oscar_args(model_dir, rotations):
    return ["--model-path", model_dir, "--kv-cache-dtype", "oscar_int2", "--oscar-rotations", rotations,
            "--oscar-sink-tokens", str(SINKS), "--oscar-recent-window", str(WINDOW), *COMMON]


@pytest.fixture(scope="module")
def reference(row, model_dir, rotations, ids, tmp_path_factory):
    """oscar_int2 without speculation: greedy tokens and their top candidates (then stopped)."""
    h = _harness()
    with h.Server(f"{row}-oscar-reference", _oscar_args(model_dir, rotations),
                  str(tmp_path_factory.mktemp("logs"))) as server:
        outs = _run_all(server, ids, top=True)
    return {name: (o["output_ids"], [{int(c[1]): float(c[0]) for c in pos}
                                     for pos in o["meta_info"]["output_top_logprobs"]])
            for name, o in outs.items()}


@pytest.fixture(scope="module")
def speculative(row, model_dir, draft_dir, rotations, ids, reference, tmp_path_factory):
    """The speculative server's outputs, log and reported accept lengths (then stopped)."""
    h = _harness()
    flags = [a.replace("{draft}", draft_dir or "") for a in ROWS[row][1]]
    with h.Server(f"{row}-oscar-spec", _oscar_args(model_dir, rotations) + flags,
                  str(tmp_path_factory.mktemp("logs"))) as server:
        outs = _run_all(server, ids, top=False)
        info = server.get("/server_info")
        log_text = server.log_text()
    avg = info.get("avg_spec_accept_length") if isinstance(info, dict) else None
    if avg is None and isinstance(info, dict):  # per data-parallel rank
        avg = next((i.get("avg_spec_accept_length") for i in info.get("internal_states", [])
                    if isinstance(i, dict) and "avg_spec_accept_length" in i), None)
    lens = {n: o["meta_info"].get("spec_accept_length") for n, o in outs.items()}
    print(f"\n{row} ({ROWS[row][0]}): server avg accept length {avg}; per request "
          + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in lens.items()))
    return outs, log_text


def test_greedy_outputs_equal_oscar_without_speculation(row, speculative, reference):
    h = _harness()
    outs, _ = speculative
    bad = {}
    for name, (want, tops) in reference.items():
        why = h.agree_up_to_a_near_tie(outs[name]["output_ids"], want, tops, NEAR_TIE)
        if why is not None:
            bad[name] = why
    assert not bad, f"{row}: {bad}"


def test_every_request_was_verified(row, speculative):
    outs, _ = speculative
    unverified = [n for n, o in outs.items() if not o["meta_info"].get("spec_verify_ct")]
    assert not unverified, f"{row}: no verify reported for {unverified}"
    assert all(o["meta_info"].get("spec_accept_length") is not None for o in outs.values()), row


def test_the_budget_charged_the_drafts_bf16_kv_and_no_graph_was_captured(row, speculative):
    """The draft's KV is SGLang's BF16 pool, charged beside the INT2 cells (a 1-layer draft of
    the target's KV geometry here); the verify and the draft run without CUDA graphs."""
    _, log_text = speculative
    m = DRAFT_CHARGED.search(log_text)
    assert m and int(m.group(1)) > 0, f"{row}: no draft KV in the oscar pool plan"
    assert "Capture target decode CUDA graph end" not in log_text, row
    assert "Capture draft decode CUDA graph" not in log_text, row
