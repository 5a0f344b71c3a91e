"""EAGLE, EAGLE3 and NEXTN speculative decoding on an oscar_int2 target, on CPU (issue 49).

SGLang 0.5.17 runs all three in the EAGLE-family V2 worker that serves STANDALONE (refusals'
module doc): the same TARGET_VERIFY forward and the same acceptance call on the target's pool
(``clear_unaccepted_c128_draft_states``, no KV move for a chain). What differs -- the draft fed
the target's hidden states, NEXTN's draft being the target's own MTP layers -- stays on the draft
runner. So the tests here:

- pin those facts in the installed SGLang (one verify path, NEXTN an alias of EAGLE, the draft
  runner a draft worker, the draft extend on the draft runner's backend and pool, hidden states
  captured outside the attention backend);
- drive the oscar verify with SGLang's own EagleVerifyInput as EAGLE builds it (topk 1, hidden
  states captured: CaptureHiddenMode.FULL) and commit through the pool hook; the oracle of
  test_sglang_speculative (a second server decoding the accepted drafts one by one: equal
  outputs, an equal cache, an equal next decode);
- the plugin: the draft runner gets SGLang's ordinary pool and its BF16 KV is charged to the
  target's budget, with the draft's own geometry (an EAGLE3 draft's config);
- the refusals: the three algorithms resolve like STANDALONE; trees, adaptive steps, the
  multi-layer worker, other draft workers and speculation on hybrids are refused in one line.
"""
import inspect
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from test_sglang_speculative import REQS, next_decode, servers  # noqa: E402
from test_sglang_standalone import T, chain_round  # noqa: E402

EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN")


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "0")


def _resolved(algo: str) -> str:
    """--speculative-algorithm as SGLang's __post_init__ leaves it (no draft path: no Gemma-4 check)."""
    from sglang.srt.arg_groups.speculative_hook import _resolve_speculative_algorithm_alias

    return _resolve_speculative_algorithm_alias(algo, None)


def eagle_verify_input(algo: str):
    """Server.verify's make_spec: SGLang's EagleVerifyInput of a chain as EAGLEWorkerV2 builds it
    (build_eagle_verify_input: topk 1, spec_steps T - 1; eagle_prepare_for_verify sets the hidden
    states capture, FULL but for STANDALONE)."""
    capture = CaptureHiddenMode.NULL if SpeculativeAlgorithm.from_string(_resolved(algo)).is_standalone() \
        else CaptureHiddenMode.FULL

    def make(t, custom_mask, positions, topk):
        b = positions.numel() // t
        return EagleVerifyInput(
            draft_token=torch.zeros(b * t, dtype=torch.long), custom_mask=custom_mask, positions=positions,
            retrieve_index=torch.arange(b * t).view(b, t), retrieve_next_token=torch.full((b, t), -1),
            retrieve_next_sibling=torch.full((b, t), -1), retrieve_cum_len=None, spec_steps=t - 1, topk=topk,
            draft_token_num=t, capture_hidden_mode=capture, seq_lens_sum=None, seq_lens_cpu=None)
    return make


# -- SGLang 0.5.17: one verify path for the EAGLE family ---------------------------------------


@pytest.mark.parametrize("algo", EAGLE_FAMILY + ("STANDALONE",))
def test_sglang_serves_the_family_with_one_worker_and_one_verify(algo):
    """NEXTN resolves to EAGLE; EAGLE/EAGLE3 get EAGLEWorkerV2 (the multi-layer worker only under
    --enable-multi-layer-eagle), STANDALONE its subclass, which keeps the parent's verify and
    forward: every one accepts through run_eagle_verify, the path the oscar commit hooks."""
    from sglang.srt.speculative import eagle_worker_common
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.speculative.multi_layer_eagle_worker_v2 import MultiLayerEagleWorkerV2

    name = _resolved(algo)
    assert name == {"NEXTN": "EAGLE"}.get(algo, algo)
    spec = SpeculativeAlgorithm.from_string(name)
    worker = spec.create_worker(SimpleNamespace(enable_multi_layer_eagle=False))
    assert issubclass(worker, EAGLEWorkerV2)
    for method in ("verify", "forward_batch_generation"):
        assert getattr(worker, method) is getattr(EAGLEWorkerV2, method)
    assert "run_eagle_verify(" in inspect.getsource(EAGLEWorkerV2.verify)
    assert "clear_unaccepted_c128_draft_states" in inspect.getsource(eagle_worker_common.run_eagle_verify)
    if spec.is_eagle():
        assert spec.create_worker(SimpleNamespace(enable_multi_layer_eagle=True)) is MultiLayerEagleWorkerV2


def test_sglang_keeps_the_eagle_draft_on_its_own_runner():
    """What EAGLE adds beside STANDALONE stays off the target's pool and backend: the draft runner
    is a TpModelWorker(is_draft_worker=True) (the plugin's hooks give it SGLang's ordinary pool),
    its backends come from --speculative-draft-attention-backend, the draft extend after a verify
    is planned and run on the draft runner (its pool), and the hidden states the draft reads are
    captured by the model's forward (capture_hidden_mode), not by attention."""
    from sglang.srt.speculative import draft_utils, eagle_utils, eagle_worker_common
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    init = inspect.getsource(EagleDraftWorker.__init__)
    assert "is_draft_worker=True" in init
    assert "speculative_draft_attention_backend" in inspect.getsource(draft_utils.DraftBackendFactory.__init__)
    extend = inspect.getsource(eagle_worker_common.prepare_for_draft_extend)
    assert "ForwardMode.DRAFT_EXTEND_V2" in extend
    assert "ForwardBatch.init_new(\n        batch,\n        draft_model_runner," in extend
    assert "draft_model_runner.attn_backend.init_forward_metadata(forward_batch)" in extend
    assert "target" not in extend.replace("target verify", "")
    verify = inspect.getsource(eagle_utils.eagle_prepare_for_verify)
    assert "CaptureHiddenMode.FULL" in verify and "is_standalone()" in verify
    # the verify is planned in the forward (the oscar backend's init_forward_metadata) without graphs
    assert "mark_forward_metadata_ready()" in verify.split("if can_run_cuda_graph:")[1].split("return")[0]


def test_sglang_builds_a_target_backend_per_adaptive_step_count():
    """Why --speculative-adaptive is refused with EAGLE: each step count gets a target attention
    backend of its own (each OscarAttnBackend would take over the pool's commit hooks)."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    src = inspect.getsource(EAGLEWorkerV2.build_adaptive_runtime_state)
    assert "target_model_runner._get_attention_backend(" in src


# -- the oscar verify and commit under EAGLE's verify input ------------------------------------


@pytest.mark.parametrize("counts", [[T, T], [1, 1], [3, 2]], ids=["all", "none", "k_of_n"])
@pytest.mark.parametrize("algo", EAGLE_FAMILY)
def test_eagle_chain_through_the_pool_hook_equals_plain_decode(algo, counts):
    """SGLang's EagleVerifyInput of each algorithm (hidden states captured) through the oscar
    verify, the acceptance through the pool hook: the accepted drafts' outputs, the cache and the
    next decode equal a server decoding them one by one (prefixes 45 and 30: drafts cross the
    page boundary 48 and the ring)."""
    spec, plain = servers(T, REQS)
    lens = chain_round(spec, plain, REQS, counts, make_spec=eagle_verify_input(algo))
    next_decode(spec, plain, REQS, lens)


def test_eagle3_rounds_in_a_row_across_the_ring_a_page_and_the_sinks():
    reqs = [dict(r) for r in REQS] + [dict(rid="C", row=2, n=2)]
    spec, plain = servers(T, reqs)
    for counts in ([4, 2, 3], [1, 4, 2], [2, 3, 4]):
        lens = chain_round(spec, plain, reqs, counts, make_spec=eagle_verify_input("EAGLE3"))
        for r, n in zip(reqs, lens):
            r["n"] = n
    next_decode(spec, plain, reqs, [r["n"] for r in reqs])


def test_an_eagle_tree_verify_is_not_committed_as_a_chain():
    """A topk-2 EagleVerifyInput (refused at start-up) plans a tree; the chain acceptance then
    refuses in one line instead of committing the wrong drafts."""
    from test_sglang_speculative import TREE
    from test_sglang_standalone import accept_chain

    spec, _ = servers(6, REQS)
    _, fb = spec.verify(REQS, [TREE, TREE], topk=2, make_spec=eagle_verify_input("EAGLE"))
    with pytest.raises(NotImplementedError, match="chain verify only") as e:
        accept_chain(spec, fb, REQS, [2, 1])
    assert "\n" not in str(e.value)


# -- the plugin: the draft's pool and the target's budget -------------------------------------


@pytest.fixture
def rotations(tmp_path):
    from sglang_cases import SMALL_QWEN3, write_hadamard_file

    return write_hadamard_file(tmp_path / "r.safetensors", SMALL_QWEN3)


def _kvc(path, algo, draft_layers, *, is_draft_worker=False, server_args=None):
    from test_sglang_pool import fake_configurator

    kvc = fake_configurator(path, max_running_requests=7)
    if server_args is not None:
        for k, v in vars(kvc.server_args).items():
            setattr(server_args, k, v)
        kvc.server_args = server_args
    kvc.is_draft_worker = is_draft_worker
    kvc.spec_algorithm = SpeculativeAlgorithm.from_string(_resolved(algo))
    kvc.spec_aux_config = SimpleNamespace(eagle_draft_num_layers=draft_layers)
    kvc.use_mla_backend = False
    return kvc


@pytest.mark.parametrize("algo", EAGLE_FAMILY)
def test_the_draft_runner_gets_sglangs_pool_and_the_target_budget_charges_it(algo, rotations):
    """The draft runner's configurator passes through every hook (SGLang's pool, its own sizing);
    the target's cell and budget hold the draft's BF16 KV (1 layer: a NextN layer, or an EAGLE
    draft) beside the INT2 cells, as for STANDALONE."""
    from sglang_ext import plugin
    from sglang_ext.memory import bf16_bytes_per_token
    from sglang_ext.pool import plan_for_configurator

    sglang_pool = object()
    draft = _kvc(rotations, algo, None, is_draft_worker=True)
    assert plugin.build_token_to_kv_pool_hook(lambda kvc, **k: sglang_pool, draft, sizes=None,
                                              req_to_token_pool=None) is sglang_pool
    for hook in (plugin.profile_available_bytes_hook, plugin.resolve_max_num_reqs_hook):
        assert hook(1 << 20, draft) is None
    target = _kvc(rotations, algo, 1)
    plan = plan_for_configurator(target)
    extra = bf16_bytes_per_token(1, plan.num_kv_heads, plan.head_dim)
    assert plugin.draft_kv_bytes_per_token(target, plan) == extra
    configurator = SimpleNamespace(_cell_size=0)
    plugin.default_pool_sizing_hook(None, configurator, target)
    assert configurator._cell_size == plan.bytes_per_token + extra
    budget = 50 << 20
    assert plugin.profile_available_bytes_hook(budget, target, 0) == \
        plan.max_total_tokens(budget, extra) * (plan.bytes_per_token + extra)


def test_an_eagle3_draft_is_charged_with_its_own_kv_geometry(rotations, tmp_path):
    """An EAGLE3 draft whose KV heads differ from the target's (here 4 x 128 against the target's
    2 x 64 per layer): the draft's pool, which SGLang builds from the draft's config, is charged at
    its own geometry, read as SGLang reads the draft (ModelConfig, is_draft_model); an unreadable
    draft config falls back to the target's geometry."""
    from sglang.srt.server_args import ServerArgs

    from sglang_ext import plugin
    from sglang_ext.pool import plan_for_configurator
    from unittest import mock

    draft_dir = tmp_path / "eagle3-draft"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 1,
        "intermediate_size": 1024, "vocab_size": 1024, "draft_vocab_size": 256, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False}))
    with mock.patch.object(ServerArgs, "__post_init__", lambda self: None):
        sa = ServerArgs(model_path="dummy", speculative_algorithm="EAGLE3",
                        speculative_draft_model_path=str(draft_dir))
    target = _kvc(rotations, "EAGLE3", 1, server_args=sa)
    plan = plan_for_configurator(target)
    assert plugin.draft_kv_geometry(target) == (4, 128, 128)
    assert plugin.draft_kv_bytes_per_token(target, plan) == 1 * 4 * (128 + 128) * 2
    assert (plan.num_kv_heads, plan.head_dim) == (2, 64)
    sa.speculative_draft_model_path = str(tmp_path / "missing")
    assert plugin.draft_kv_geometry(target) is None
    assert plugin.draft_kv_bytes_per_token(target, plan) == 1 * 2 * (64 + 64) * 2


# -- the refusals ------------------------------------------------------------------------------


def _args(algo, **kw):
    base = dict(speculative_algorithm=algo, speculative_draft_model_path="/models/draft",
                speculative_eagle_topk=None, speculative_draft_attention_backend=None,
                speculative_num_steps=None, speculative_num_draft_tokens=None, speculative_adaptive=False,
                enable_multi_layer_eagle=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("algo", EAGLE_FAMILY)
def test_the_family_is_served_as_chains_with_an_ordinary_draft_backend(algo):
    from sglang_ext import refusals

    for resolved in {algo, _resolved(algo)}:  # before and after SGLang's __post_init__
        refusals._check_speculative(_args(resolved))
        refusals._check_speculative(_args(resolved, speculative_eagle_topk=1))
        refusals._check_speculative(_args(resolved, speculative_draft_model_path=None))  # NEXTN: the target's
    sa = _args(algo)
    refusals._apply_draft_defaults(sa)
    assert sa.speculative_draft_attention_backend == refusals.DRAFT_ATTENTION_BACKEND
    assert (sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens) == \
        refusals.CHAIN_DEFAULTS
    named = _args(algo, speculative_draft_attention_backend="fa3", speculative_num_steps=2)
    refusals._apply_draft_defaults(named)
    assert (named.speculative_draft_attention_backend, named.speculative_eagle_topk) == ("fa3", None)


@pytest.mark.parametrize("algo", EAGLE_FAMILY)
@pytest.mark.parametrize("kw, flag, why", [
    (dict(speculative_eagle_topk=4), "--speculative-eagle-topk 4 with {algo}", "use --speculative-eagle-topk 1"),
    (dict(speculative_draft_attention_backend="oscar"), "--speculative-draft-attention-backend oscar",
     "SGLang's ordinary pool"),
    (dict(speculative_adaptive=True), "--speculative-adaptive with {algo}", "one target attention backend per step"),
    (dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle with {algo}", "multi-layer EAGLE worker"),
], ids=["tree", "draft_backend", "adaptive", "multi_layer"])
def test_what_the_family_cannot_carry_is_refused_in_one_line(algo, kw, flag, why):
    from sglang_ext import refusals
    from sglang_ext.settings import OscarConfigError

    with pytest.raises(OscarConfigError) as ei:
        refusals._check_speculative(_args(algo, **kw))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{flag.format(algo=algo)} is not supported with "
                                              "--kv-cache-dtype oscar_int2") and why in msg


def test_standalone_keeps_what_sglang_drops():
    """SGLang turns --speculative-adaptive off for STANDALONE itself (adaptive_unsupported_reason):
    not refused there."""
    from sglang_ext import refusals

    refusals._check_speculative(_args("STANDALONE", speculative_adaptive=True))


@pytest.mark.parametrize("algo", ["DFLASH", "DSPARK", "FROZEN_KV_MTP"])
def test_the_other_draft_workers_stay_refused(algo):
    from sglang_ext import refusals
    from sglang_ext.settings import OscarConfigError

    with pytest.raises(OscarConfigError) as ei:
        refusals._check_speculative(_args(algo))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"--speculative-algorithm {algo} is not supported") and \
        "EAGLE-family chain drafts" in msg


@pytest.mark.parametrize("algo", EAGLE_FAMILY)
@pytest.mark.parametrize("sliding, arch", [(False, "Qwen3NextForCausalLM"), (True, "GptOssForCausalLM")])
def test_the_family_on_a_hybrid_model_is_refused_in_one_line(algo, sliding, arch):
    """NEXTN on Qwen3-Next (its MTP layer) or EAGLE3 on gpt-oss: speculation stays refused on hybrids."""
    from sglang_ext import refusals
    from sglang_ext.settings import OscarConfigError

    sa = SimpleNamespace(device="cpu", enable_hierarchical_cache=False, hicache_storage_backend=None,
                         speculative_algorithm=algo)
    with pytest.raises(OscarConfigError) as ei:
        refusals._check_hybrid_features(sa, arch, sliding=sliding)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"--speculative-algorithm {algo} on {arch} is not supported")
