"""STANDALONE speculative decoding (a draft model; SGLang 0.5.17's EAGLE-family V2 worker) on an
oscar_int2 target, on CPU. The target's verify is the NGRAM one (a TARGET_VERIFY batch, here a
chain with EagleVerifyInput's ``topk`` 1, whose mask the backend does not read); the acceptance
is what run_eagle_verify does after eagle_sample: no ``move_kv_cache`` for a chain, one call of
``clear_unaccepted_c128_draft_states(req_pool_indices, seq_lens, accept_lens, num_draft_tokens)``
on the allocator's KV cache (eagle_worker_common.py:590), looked up with getattr as SGLang does.

Oracle (test_sglang_speculative's): a second server decodes the accepted drafts one by one; the
accepted drafts' verify outputs, the whole cache and the next decode must equal its. Also: the
plugin gives the draft model's runner SGLang's ordinary pool and charges its BF16 KV in the
target's budget; the refusals serve STANDALONE chains only.
"""
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from test_sglang_speculative import (REQS, TREE, _chain, assert_same_cache, close,  # noqa: E402
                                     decode_accepted, ensure_pages, next_decode, servers)


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "0")


T = 4  # STANDALONE's default chain: --speculative-num-steps 3, topk 1, 4 draft tokens


def accept_chain(server, fb, reqs, counts):
    """SGLang's acceptance of an EAGLE-family chain verify: accept_lens [B] int32 (draft 0, the
    last sampled token, included) handed to the pool's hook, nothing moved."""
    allocator = SimpleNamespace(get_kvcache=lambda: server.sim.pool)
    hook = getattr(allocator.get_kvcache(), "clear_unaccepted_c128_draft_states", None)
    assert hook is not None  # SGLang would skip the call silently
    hook(fb.req_pool_indices, fb.seq_lens, torch.tensor(counts, dtype=torch.int32), server.t)
    for r, c in zip(reqs, counts):
        for k in range(c):
            server.sim.source[(r["row"], r["n"] + k)] = (r["rid"], r["n"], k)


def chain_round(spec, plain, reqs, counts, make_spec=None):
    """One chain verify + acceptance of counts[b] drafts on ``spec``, the same drafts decoded on
    ``plain``: equal outputs of the accepted drafts and an equal cache. Returns the new lengths.
    ``make_spec``: Server.verify's (the verify's spec_info, e.g. SGLang's EagleVerifyInput)."""
    outs, fb = spec.verify(reqs, [_chain(spec.t)] * len(reqs), topk=1, make_spec=make_spec)
    for r in reqs:
        ensure_pages(plain.sim, r["row"], r["n"] + spec.t)
    accept_chain(spec, fb, reqs, counts)
    accepted = [list(range(c)) for c in counts]
    for (b, i), per_layer in decode_accepted(plain, reqs, accepted).items():
        for l, w in enumerate(per_layer):
            close(outs[l][b * spec.t + i], w.float())
    lens = [r["n"] + c for r, c in zip(reqs, counts)]
    assert_same_cache(spec, plain, reqs, lens)
    return lens


# REQS: prefixes 45 and 30, so drafts 45..48 cross the page boundary 48 (P = 16) and both rows'
# rings (W = 8) wrap
@pytest.mark.parametrize("counts", [[T, T], [1, 1], [3, 2]], ids=["all", "none", "k_of_n"])
def test_chain_acceptance_through_the_pool_hook_equals_plain_decode(counts):
    spec, plain = servers(T, REQS)
    lens = chain_round(spec, plain, REQS, counts)
    next_decode(spec, plain, REQS, lens)


def test_rounds_in_a_row_across_the_ring_a_page_and_the_sinks():
    """Rounds of a STANDALONE server: each verify starts where the last acceptance ended; row C's
    2-token prompt puts its first drafts on sink positions (S = 4), which only the commit writes."""
    reqs = [dict(r) for r in REQS] + [dict(rid="C", row=2, n=2)]
    spec, plain = servers(T, reqs)
    for counts in ([4, 2, 3], [1, 4, 2], [2, 3, 4], [4, 1, 1]):
        lens = chain_round(spec, plain, reqs, counts)
        for r, n in zip(reqs, lens):
            r["n"] = n
    next_decode(spec, plain, reqs, [r["n"] for r in reqs])


def test_one_commit_per_verify():
    """The hook without a planned verify, twice for one verify, or after a tree verify (NGRAM's,
    which commits through move_kv_cache) is refused in one line; a move after the hook's commit
    finds nothing pending either."""
    spec, _ = servers(T, REQS)
    pool = spec.sim.pool
    rows, lens = torch.tensor([3, 1]), torch.tensor([45, 30])
    with pytest.raises(NotImplementedError, match="right after an EAGLE-family chain verify") as e:
        pool.clear_unaccepted_c128_draft_states(rows, lens, torch.tensor([2, 2], dtype=torch.int32), T)
    assert "\n" not in str(e.value)
    _, fb = spec.verify(REQS, [_chain(T)] * 2, topk=1)
    accept_chain(spec, fb, REQS, [2, 1])
    with pytest.raises(NotImplementedError, match="right after an EAGLE-family chain verify"):
        accept_chain(spec, fb, REQS, [2, 1])
    with pytest.raises(NotImplementedError, match="right after a speculative verify"):
        pool.move_kv_cache(torch.tensor([16]), torch.tensor([16]))
    tree, _ = servers(6, REQS)
    _, fb = tree.verify(REQS, [TREE, TREE])
    with pytest.raises(NotImplementedError, match="chain verify only") as e:
        accept_chain(tree, fb, REQS, [2, 1])
    assert "\n" not in str(e.value) and "--speculative-eagle-topk 1" in str(e.value)


def test_without_the_hook_the_cache_differs():
    """The oracle has teeth: with the pool's hook emptied (SGLang's chain acceptance then commits
    nothing, as before this hook) the rings lack the accepted drafts."""
    spec, plain = servers(T, REQS)
    spec.sim.pool.verify_commit_chain = lambda accept_lens, t: None
    with pytest.raises(AssertionError):
        chain_round(spec, plain, REQS, [3, 2])


def test_sglang_accepts_an_eagle_chain_through_this_hook_only():
    """The installed SGLang's EAGLE-family verify (run_eagle_verify) calls the pool's
    clear_unaccepted_c128_draft_states with accept_lens after sampling and moves KV only for
    topk > 1 (_finalize_accept_tree_path): the commit point above is its one chance."""
    from sglang.srt.speculative import eagle_worker_common

    src = inspect.getsource(eagle_worker_common.run_eagle_verify)
    hook = src.index('"clear_unaccepted_c128_draft_states"')
    assert src.index("eagle_sample(") < hook < src.index("_finalize_accept_tree_path(")
    call = src[hook:src.index("commit_mamba_states_after_verify(")]
    assert "token_to_kv_pool_allocator.get_kvcache()" in src[hook - 120:hook]
    assert "accept_lens," in call and "num_draft_tokens," in call
    assert "topk > 1" in src[src.index("if finalize_tree_path"):src.index("_finalize_accept_tree_path(")]
    assert "move_kv_cache" not in src


# -- the plugin: the draft model's runner and the target's budget ----------------------------


def _kvc(path, *, draft_layers=None, is_draft_worker=False):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from test_sglang_pool import fake_configurator

    kvc = fake_configurator(path, max_running_requests=7)
    kvc.is_draft_worker = is_draft_worker
    kvc.spec_algorithm = SpeculativeAlgorithm.from_string("STANDALONE" if draft_layers else None)
    kvc.spec_aux_config = SimpleNamespace(eagle_draft_num_layers=draft_layers)
    kvc.use_mla_backend = False
    return kvc


@pytest.fixture
def rotations(tmp_path):
    from sglang_cases import SMALL_QWEN3, write_hadamard_file

    return write_hadamard_file(tmp_path / "r.safetensors", SMALL_QWEN3)


def test_the_draft_runner_gets_sglangs_ordinary_pool(rotations):
    from sglang.srt.mem_cache import kv_cache_dtype

    from sglang_ext import plugin
    from sglang_ext.settings import OSCAR_KV_DTYPE

    kw = dict(server_args_kv_cache_dtype=OSCAR_KV_DTYPE, model=None, model_dtype=torch.bfloat16,
              is_dflash=False, speculative_draft_attention_backend="triton")
    configure = kv_cache_dtype.configure_kv_cache_dtype
    assert plugin.configure_kv_cache_dtype_hook(configure, is_draft_worker=True, **kw) == ("auto", torch.bfloat16)
    assert plugin.configure_kv_cache_dtype_hook(configure, is_draft_worker=False, **kw) == (OSCAR_KV_DTYPE,
                                                                                           torch.bfloat16)
    sglang_pool = object()
    draft = _kvc(rotations, is_draft_worker=True)
    assert plugin.build_token_to_kv_pool_hook(lambda kvc, **k: sglang_pool, draft, sizes=None,
                                              req_to_token_pool=None) is sglang_pool
    target = _kvc(rotations, draft_layers=2)
    built = plugin.build_token_to_kv_pool_hook(
        lambda kvc, **k: sglang_pool, target, sizes=SimpleNamespace(max_total_num_tokens=64),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(8, 64, dtype=torch.int32)))
    assert type(built).__name__ == "OscarKVPool"
    for hook in (plugin.profile_available_bytes_hook, plugin.resolve_max_num_reqs_hook):
        assert hook(1 << 20, draft) is None  # SGLang's own answer for the draft


def test_the_target_budget_charges_the_draft_models_bf16_kv(rotations):
    """With a 2-layer draft the target's budget holds INT2 cells + fixed reserve + the draft's BF16
    K/V per token (the count SGLang gives the draft's pool), the largest such page multiple; the
    pool configurator's cell agrees, so SGLang's division lands on that count."""
    from sglang_ext import plugin
    from sglang_ext.memory import bf16_bytes_per_token
    from sglang_ext.pool import plan_for_configurator

    kvc = _kvc(rotations, draft_layers=2)
    plan = plan_for_configurator(kvc)
    draft = bf16_bytes_per_token(2, plan.num_kv_heads, plan.head_dim)
    assert plugin.draft_kv_bytes_per_token(kvc, plan) == draft > plan.bytes_per_token
    budget = 50 << 20
    sized = plugin.profile_available_bytes_hook(budget, kvc, 0)
    configurator = SimpleNamespace(_cell_size=int(plan.bytes_per_token * 2))  # SGLang's 1 + 2/2 scaling
    plugin.default_pool_sizing_hook(None, configurator, kvc)
    assert configurator._cell_size == plan.bytes_per_token + draft
    tokens = sized // configurator._cell_size  # DefaultPoolConfigurator.calculate_pool_sizes
    assert tokens % plan.page_size == 0 and tokens == plan.max_total_tokens(budget, draft)
    assert plan.pool_bytes(tokens) + (tokens + plan.page_size) * draft <= budget
    more = tokens + plan.page_size
    assert plan.pool_bytes(more) + (more + plan.page_size) * draft > budget - plan.page_size * (plan.bytes_per_token + draft)
    without = _kvc(rotations)
    assert plugin.draft_kv_bytes_per_token(without, plan) == 0
    assert plugin.profile_available_bytes_hook(budget, without, 0) == plan.max_total_tokens(budget) * plan.bytes_per_token


# -- the refusals ---------------------------------------------------------------------------


def _standalone_args(**kw):
    base = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/models/draft",
                speculative_eagle_topk=None, speculative_draft_attention_backend=None)
    return SimpleNamespace(**{**base, **kw})


def test_standalone_chains_are_served_and_trees_refused_in_one_line():
    from sglang_ext import refusals
    from sglang_ext.settings import OscarConfigError

    refusals._check_speculative(_standalone_args())
    refusals._check_speculative(_standalone_args(speculative_eagle_topk=1))
    refusals._check_speculative(_standalone_args(speculative_draft_attention_backend="flashinfer"))
    for kw, flag in ((dict(speculative_eagle_topk=4), "--speculative-eagle-topk 4 with STANDALONE"),
                     (dict(speculative_draft_attention_backend="oscar"), "--speculative-draft-attention-backend oscar")):
        with pytest.raises(OscarConfigError) as ei:
            refusals._check_speculative(_standalone_args(**kw))
        msg = str(ei.value)
        assert "\n" not in msg and msg.startswith(f"{flag} is not supported with --kv-cache-dtype oscar_int2")


def test_the_draft_attention_backend_defaults_to_an_ordinary_one(rotations):
    """apply_oscar_defaults: the target on oscar, the draft on DRAFT_ATTENTION_BACKEND (unless
    named), decode graphs (the verify's, and the draft worker's, one switch) off."""
    from sglang_ext import refusals
    from test_sglang_flags import oscar_bare

    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/models/draft")
    sa = oscar_bare(rotations, **spec)
    refusals.apply_oscar_defaults(sa)
    assert (sa.attention_backend, sa.speculative_draft_attention_backend) == ("oscar", refusals.DRAFT_ATTENTION_BACKEND)
    assert sa.disable_decode_cuda_graph
    named = oscar_bare(rotations, speculative_draft_attention_backend="fa3", **spec)
    refusals.apply_oscar_defaults(named)
    assert named.speculative_draft_attention_backend == "fa3"
    ngram = oscar_bare(rotations, speculative_algorithm="NGRAM")
    refusals.apply_oscar_defaults(ngram)
    assert ngram.speculative_draft_attention_backend is None
