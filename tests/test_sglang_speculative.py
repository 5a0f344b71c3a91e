"""NGRAM speculative decoding through OscarAttnBackend and OscarKVPool on CPU, driven as SGLang
0.5.17 drives it: a TARGET_VERIFY forward batch (out_cache_loc = req_to_token[row, n:n+T],
positions n + depth, the CUDA layout of spec_info.custom_mask), then SGLang's own
``move_accept_tokens_to_target_kvcache`` (spec_utils.py:687; its Triton kernels interpreted)
on the pool, which is where the backend commits the acceptance.

Oracle: a second, identical server that decodes the accepted drafts one by one (plain
DECODE batches through the same backend class): the accepted drafts' verify outputs, the
whole cache afterwards (INT2 cells of every live position, sinks, rings, ring ends) and the
next decode's outputs must equal its; the next decode is also checked against the read-rule
oracle of test_sglang_backend (Sim.expected_decode), which does not look at the pool.
"""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache  # noqa: E402

import kernel_helpers as kh  # noqa: E402
from oscar_kernels.hybrid_cache import HybridLayerCache  # noqa: E402
from oscar_kernels.speculative import draft_ancestors  # noqa: E402
from sglang_ext.backend import accept_index_from_move, verify_parents  # noqa: E402
from test_sglang_backend import HQ, P, S, W, Sim, close  # noqa: E402


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "0")


def _chain(t):
    return [i - 1 for i in range(t)]


# 0 root; 1, 2 its children; 3 <- 1, 4 <- 2; 5 <- 3 (NGRAM's BFS tree of width 2)
TREE = [-1, 0, 0, 1, 2, 3]


def _depths(parents):
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def ensure_pages(sim, row, end):
    """Pages for positions up to ``end`` of ``row`` (both servers allocate in the same order)."""
    have = 0
    while have < end and int(sim.pool.req_to_token[row, have]) != 0:
        have += P
    if have < end:
        sim.alloc(row, have, end)


def full_mask(parents, n):
    """SGLang's CUDA verify mask of one request: T rows of n prefix columns, then T draft
    columns (draft i sees itself and its ancestors)."""
    t = len(parents)
    anc = draft_ancestors(torch.tensor([parents]))[0]
    return torch.cat([torch.ones(t, n, dtype=torch.bool), anc], 1).flatten()


class Server:
    """One Sim as a speculative server (``max_draft_tokens`` = T)."""

    def __init__(self, t):
        self.sim = Sim(max_draft_tokens=t)
        self.t = t

    def prefill(self, reqs, chunk=16):
        for r in reqs:
            for start in range(0, r["n"], chunk):
                new = min(chunk, r["n"] - start)
                self.sim.extend([dict(rid=r["rid"], row=r["row"], content=r["rid"], prefix=start, new=new)])

    def verify(self, reqs, parents, topk=None, make_spec=None):
        """reqs: dicts rid, row, n (cached length); parents [B][T]; ``topk``: the spec_info's
        (EagleVerifyInput.topk; NGRAM's has none); ``make_spec(t, custom_mask, positions, topk)``:
        the spec_info itself (e.g. SGLang's EagleVerifyInput), else a namespace of those fields.
        Drafts' K/V content (rid, round n, draft i). Returns per-layer outputs [B*T, HQ*D] and the batch."""
        sim, t = self.sim, self.t
        rows, seq, slots, pos, masks = [], [], [], [], []
        for r, par in zip(reqs, parents):
            ensure_pages(sim, r["row"], r["n"] + t)
            rows.append(r["row"]); seq.append(r["n"])
            slots.append(sim.pool.req_to_token[r["row"], r["n"]:r["n"] + t].long())
            pos.append(torch.tensor([r["n"] + d for d in _depths(par)]))
            masks.append(full_mask(par, r["n"]))
        if make_spec is not None:
            spec = make_spec(t, torch.cat(masks), torch.cat(pos), topk)
        else:
            spec = SimpleNamespace(draft_token_num=t, custom_mask=torch.cat(masks), positions=torch.cat(pos),
                                   **({} if topk is None else {"topk": topk}))
        fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(reqs),
                             req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq),
                             out_cache_loc=torch.cat(slots), positions=torch.cat(pos), spec_info=spec, rids=None)
        sim.backend.init_forward_metadata(fb)
        outs = []
        for layer in sim.layers:
            l = layer.layer_id
            k, v, q = [], [], []
            for r, par in zip(reqs, parents):
                for i, d in enumerate(_depths(par)):
                    kk, vv = sim.kv((r["rid"], r["n"], i), l, [r["n"] + d])
                    k.append(kk); v.append(vv)
                    q.append(sim.q((r["rid"], i), l, [r["n"] + d]))
            outs.append(sim.attend(torch.cat(q), torch.cat(k), torch.cat(v), layer, fb))
        return outs, fb

    def accept(self, fb, reqs, accepted):
        """SGLang's move of the accepted paths (draft indices per request, root first)."""
        t = self.t
        width = t
        acc = torch.full((len(reqs), width), -1, dtype=torch.int64)
        for b, a in enumerate(accepted):
            acc[b, :len(a)] = torch.tensor([b * t + i for i in a], dtype=torch.int64)
        correct = torch.tensor([len(a) - 1 for a in accepted])
        batch = SimpleNamespace(seq_lens=fb.seq_lens, req_pool_indices=fb.req_pool_indices,
                                req_to_token_pool=SimpleNamespace(req_to_token=self.sim.pool.req_to_token),
                                out_cache_loc=fb.out_cache_loc)
        move_accept_tokens_to_target_kvcache(batch, acc, correct,
                                             SimpleNamespace(get_kvcache=lambda: self.sim.pool))
        for r, a in zip(reqs, accepted):
            for k, i in enumerate(a):
                self.sim.source[(r["row"], r["n"] + k)] = (r["rid"], r["n"], i)


def decode_accepted(plain, reqs, accepted):
    """The oracle server decodes each accepted draft (one DECODE batch per depth); returns
    {(b, draft): per-layer output [HQ*D]}."""
    sim = plain.sim
    got = {}
    for k in range(max(len(a) for a in accepted)):
        step = [(b, r, a[k]) for b, (r, a) in enumerate(zip(reqs, accepted)) if k < len(a)]
        batch = [dict(rid=(r["rid"], i), row=r["row"], content=(r["rid"], r["n"], i), n=r["n"] + k + 1)
                 for _, r, i in step]
        outs = sim.decode(batch)
        for j, (b, _, i) in enumerate(step):
            got[(b, i)] = [o[j] for o in outs]
    return got


def _live_slots(sim, reqs, lens):
    return torch.cat([sim.pool.req_to_token[r["row"], :n].long() for r, n in zip(reqs, lens)])


def assert_same_cache(spec, plain, reqs, lens):
    """INT2 cells of every live position, every sink and ring cell, the rows' ring ends."""
    slots = _live_slots(spec.sim, reqs, lens)
    assert torch.equal(slots, _live_slots(plain.sim, reqs, lens))
    int2 = ("k_packed", "v_packed", "k_scales", "v_scales")
    for a, b in zip(spec.sim.pool.layers, plain.sim.pool.layers):
        kh.assert_layers_close(
            HybridLayerCache(**{**a.__dict__, **{f: getattr(a, f)[slots] for f in int2}}),
            HybridLayerCache(**{**b.__dict__, **{f: getattr(b, f)[slots] for f in int2}}))
    for name in ("ring_end", "ring_valid_from", "sink_slot_of_page"):
        assert torch.equal(getattr(spec.sim.pool.index, name), getattr(plain.sim.pool.index, name)), name


def run_round(spec, plain, reqs, parents, accepted):
    """One verify + acceptance on ``spec``, the accepted drafts decoded on ``plain``; checks the
    accepted drafts' outputs and the cache. Returns the requests' new lengths."""
    outs, fb = spec.verify(reqs, parents)
    for r in reqs:
        ensure_pages(plain.sim, r["row"], r["n"] + spec.t)
    spec.accept(fb, reqs, accepted)
    want = decode_accepted(plain, reqs, accepted)
    for (b, i), per_layer in want.items():
        for l, w in enumerate(per_layer):
            close(outs[l][b * spec.t + i], w.float())
    lens = [r["n"] + len(a) for r, a in zip(reqs, accepted)]
    assert_same_cache(spec, plain, reqs, lens)
    return lens


def next_decode(spec, plain, reqs, lens):
    """One plain decode step on both servers after the acceptance: equal outputs, and the
    read-rule oracle's (sinks and the request's ring window BF16 from its ``valid_from``, 0
    unless given, the rest INT2)."""
    step = [dict(rid=r["rid"], row=r["row"], content=("next", r["rid"]), n=n + 1) for r, n in zip(reqs, lens)]
    for r, n in zip(reqs, lens):
        ensure_pages(spec.sim, r["row"], n + 1)
        ensure_pages(plain.sim, r["row"], n + 1)
    a, b = spec.sim.decode(step), plain.sim.decode(step)
    for l in range(len(a)):
        close(a[l], b[l].float())
        for j, (r, n) in enumerate(zip(reqs, lens)):
            close(a[l][j:j + 1], spec.sim.expected_decode(r["row"], r["rid"], l, n + 1, ("next", r["rid"]),
                                                          r.get("valid_from", 0)))


def servers(t, reqs):
    spec, plain = Server(t), Server(t)
    for s in (spec, plain):
        s.prefill(reqs)
    return spec, plain


# prefixes 45 and 30: drafts 45..50 cross the page boundary 48 (P = 16) and wrap the ring (W = 8)
REQS = [dict(rid="A", row=3, n=45), dict(rid="B", row=1, n=30)]


@pytest.mark.parametrize("accepted", [
    [list(range(6)), list(range(6))],  # all
    [[0], [0]],  # none (the root, the last sampled token, is always accepted)
    [[0, 1, 2, 3], [0, 1]],  # k of n
], ids=["all", "none", "k_of_n"])
def test_chain_verify_then_move_equals_plain_decode(accepted):
    spec, plain = servers(6, REQS)
    lens = run_round(spec, plain, REQS, [_chain(6)] * 2, accepted)
    next_decode(spec, plain, REQS, lens)


@pytest.mark.parametrize("accepted", [[[0, 2, 4], [0, 1, 3, 5]], [[0, 1], [0]]], ids=["branches", "short"])
def test_tree_verify_moves_the_accepted_path_and_equals_plain_decode(accepted):
    """topk 2 (NGRAM's BFS tree): the accepted path is moved to the front slots by SGLang's
    move (tgt != src), the INT2 cells with it; sinks and ring are committed from the verify."""
    spec, plain = servers(6, REQS)
    lens = run_round(spec, plain, REQS, [TREE, TREE], accepted)
    next_decode(spec, plain, REQS, lens)


def test_rounds_in_a_row_across_the_ring_and_a_page():
    """Three verify rounds, chains and trees, each starting where the last acceptance ended."""
    spec, plain = servers(6, REQS)
    reqs = [dict(r) for r in REQS]
    for parents, accepted in (([_chain(6), TREE], [[0, 1, 2], [0, 2, 4]]),
                              ([TREE, _chain(6)], [[0, 1, 3, 5], list(range(6))]),
                              ([_chain(6), _chain(6)], [[0], [0, 1]])):
        lens = run_round(spec, plain, reqs, parents, accepted)
        for r, n in zip(reqs, lens):
            r["n"] = n
    next_decode(spec, plain, reqs, [r["n"] for r in reqs])


@pytest.mark.slow
def test_the_triton_path_tree_then_chain(monkeypatch):
    """The kernels a GPU runs (Triton, interpreted here): the verify through triton_decode over
    the virtual requests, the commit through triton_store; a tree round, then a chain round."""
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1")
    spec, plain = servers(6, REQS)
    assert spec.sim.backend.attention.triton and spec.sim.backend.attention.verify_workspace is not None
    reqs = [dict(r) for r in REQS]
    for parents, accepted in (([TREE, TREE], [[0, 2, 4], [0, 1, 3, 5]]), ([_chain(6)] * 2, [[0, 1], list(range(6))])):
        lens = run_round(spec, plain, reqs, parents, accepted)
        for r, n in zip(reqs, lens):
            r["n"] = n
    next_decode(spec, plain, reqs, [r["n"] for r in reqs])


def test_after_a_radix_hit():
    """D's first 32 positions are A's slots (a radix hit: A's sinks, read as INT2 past them;
    D's ring valid from 32), its prompt ends at 40; verify rounds of D beside A."""
    spec, plain = servers(6, REQS[:1])
    for s in (spec, plain):
        s.sim.share(4, 3, 32)
        s.sim.extend([dict(rid="D", row=4, content="D", prefix=32, new=8)])
    reqs = [dict(REQS[0]), dict(rid="D", row=4, n=40, valid_from=32)]
    for parents, accepted in (([TREE, _chain(6)], [[0, 2, 4], [0, 1, 2, 3]]), ([_chain(6), TREE], [[0], [0, 1, 3, 5]])):
        lens = run_round(spec, plain, reqs, parents, accepted)
        for r, n in zip(reqs, lens):
            r["n"] = n
    assert int(spec.sim.pool.index.ring_valid_from[4]) == 32
    next_decode(spec, plain, reqs, [r["n"] for r in reqs])


def test_inside_the_sinks():
    """A 2-token prompt: the drafts at positions 2..5 include sink positions (S = 4), which
    only the commit writes."""
    reqs = [dict(rid="C", row=2, n=2)]
    spec, plain = servers(5, reqs)
    lens = run_round(spec, plain, reqs, [_chain(5)], [[0, 1, 2, 3]])
    next_decode(spec, plain, reqs, lens)


def test_without_the_commit_the_cache_differs():
    """The oracle has teeth: a move of the INT2 cells alone (no ring/sink commit) leaves the
    ring short of the accepted drafts, and assert_same_cache sees it."""
    spec, plain = servers(6, REQS)
    outs, fb = spec.verify(REQS, [_chain(6)] * 2)
    spec.sim.backend.commit_accepted = lambda tgt, src: None  # the pool's hook, emptied
    spec.sim.pool.verify_commit = spec.sim.backend.commit_accepted
    for r in REQS:
        ensure_pages(plain.sim, r["row"], r["n"] + 6)
    accepted = [[0, 1, 2], [0, 1]]
    spec.accept(fb, REQS, accepted)
    decode_accepted(plain, REQS, accepted)
    with pytest.raises(AssertionError):
        assert_same_cache(spec, plain, REQS, [48, 32])


def test_a_move_without_a_verify_is_refused():
    spec, _ = servers(4, REQS[:1])
    idx = torch.tensor([16, 17])
    with pytest.raises(NotImplementedError, match="oscar_int2") as e:
        spec.sim.pool.move_kv_cache(idx, idx)
    assert "\n" not in str(e.value)
    outs, fb = spec.verify(REQS[:1], [_chain(4)])
    spec.accept(fb, REQS[:1], [[0, 1]])
    with pytest.raises(NotImplementedError, match="right after a speculative verify"):
        spec.sim.pool.move_kv_cache(idx, idx)  # one commit per verify


def test_verify_parents_reads_both_mask_layouts():
    parents = [TREE, _chain(6), [-1, 0, 1, 0, 3, 3]]
    n = torch.tensor([3, 7, 1])
    want = torch.tensor(parents)
    full = torch.cat([full_mask(p, int(k)) for p, k in zip(parents, n)])
    assert torch.equal(verify_parents(full, n, 3, 6), want)
    compact = draft_ancestors(want).flatten()  # SGLang's CPU path: T x T per request
    assert torch.equal(verify_parents(compact, n, 3, 6), want)


def test_accept_index_from_move():
    slots = torch.arange(100, 112)  # 2 requests x 6 drafts
    src = torch.tensor([100, 102, 104, 106, 107, 0, 0, 0, 0, 0, 0, 0])
    got = accept_index_from_move(torch.zeros(12, dtype=torch.int64), src, slots, 2, 6)
    assert got.tolist() == [[0, 2, 4, -1, -1, -1], [0, 1, -1, -1, -1, -1]]
    src = torch.tensor([106, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])  # request 0 accepts nothing
    got = accept_index_from_move(torch.zeros(12, dtype=torch.int64), src, slots, 2, 6)
    assert got.tolist() == [[-1] * 6, [0, -1, -1, -1, -1, -1]]


@pytest.mark.parametrize("algo, drafts, adaptive_max, want", [
    (None, 8, None, 0), ("NGRAM", 8, None, 8), ("NGRAM", 4, 7, 7), ("STANDALONE", 4, None, 4)])
def test_the_backend_sizes_the_verify_from_the_server_arguments(algo, drafts, adaptive_max, want, tmp_path):
    """A speculative server's backend stages up to --speculative-num-draft-tokens drafts per
    request (ServerArgs.max_speculative_num_draft_tokens under --speculative-adaptive) and is the
    pool's verify_commit and verify_commit_chain; without speculation it stages none and the pool
    refuses moves. It carries the model's context length as max_context_len (SGLang's EAGLE-family
    worker sizes the verify mask with it)."""
    from sglang_ext.backend import OscarAttnBackend
    from sglang_ext.settings import OSCAR_KV_DTYPE
    from test_sglang_backend import CTX

    sim = Sim()
    sim.pool.verify_commit = sim.pool.verify_commit_chain = None  # the Sim's own backend's
    rotations = tmp_path / "r.safetensors"
    rotations.write_bytes(b"")
    sa = SimpleNamespace(kv_cache_dtype=OSCAR_KV_DTYPE, oscar_rotations=str(rotations),
                         enable_deterministic_inference=False, speculative_algorithm=algo,
                         speculative_num_draft_tokens=drafts, max_speculative_num_draft_tokens=adaptive_max)
    runner = SimpleNamespace(server_args=sa, model_config=SimpleNamespace(get_max_num_attention_heads=lambda: HQ,
                                                                          context_len=CTX),
                             ps=SimpleNamespace(attn_tp_size=1), token_to_kv_pool=sim.pool,
                             req_to_token_pool=sim.req_pool, model=torch.nn.ModuleList(sim.layers))
    backend = OscarAttnBackend.from_model_runner(runner)
    assert backend.attention.max_draft_tokens == want
    assert (sim.pool.verify_commit is not None) == (sim.pool.verify_commit_chain is not None) == bool(want)
    assert backend.max_context_len == CTX
    if want:
        assert sim.pool.verify_commit.__self__ is backend and sim.pool.verify_commit_chain.__self__ is backend
        assert backend.attention.draft_kv.shape[:3] == (len(sim.layers), 2, sim.pool.req_to_token.shape[0] * want)


@pytest.mark.parametrize("sliding, arch, layers", [(False, "Qwen3NextForCausalLM", "Gated DeltaNet"),
                                                   (True, "GptOssForCausalLM", "sliding-window")])
def test_ngram_on_a_hybrid_model_is_refused_in_one_line(sliding, arch, layers):
    from sglang_ext import refusals
    from sglang_ext.settings import OSCAR_KV_DTYPE, OscarConfigError

    sa = SimpleNamespace(device="cpu", enable_hierarchical_cache=False, hicache_storage_backend=None,
                         speculative_algorithm="ngram")
    with pytest.raises(OscarConfigError) as ei:
        refusals._check_hybrid_features(sa, arch, sliding=sliding)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"--speculative-algorithm NGRAM on {arch} is not supported with "
                                              f"--kv-cache-dtype {OSCAR_KV_DTYPE}") and layers in msg
    refusals._check_hybrid_features(SimpleNamespace(**{**vars(sa), "speculative_algorithm": None}), arch,
                                    sliding=sliding)


@pytest.mark.parametrize("field, value, flag, why", [
    ("speculative_algorithm", "dflash", "--speculative-algorithm DFLASH", "serves NGRAM and the EAGLE-family"),
    ("speculative_algorithm", "FROZEN_KV_MTP", "--speculative-algorithm FROZEN_KV_MTP",
     "serves NGRAM and the EAGLE-family"),
    ("speculative_draft_model_path", "/models/draft", "--speculative-draft-model-path with --speculative-algorithm "
     "None", "with --speculative-algorithm STANDALONE, EAGLE, EAGLE3, NEXTN")])
def test_other_draft_model_speculation_is_refused_in_one_line(field, value, flag, why):
    from sglang_ext import refusals
    from sglang_ext.settings import OscarConfigError

    sa = SimpleNamespace(speculative_algorithm=None, speculative_draft_model_path=None)
    setattr(sa, field, value)
    with pytest.raises(OscarConfigError) as ei:
        refusals._check_speculative(sa)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{flag} is not supported") and why in msg
    refusals._check_speculative(SimpleNamespace(speculative_algorithm="NGRAM", speculative_draft_model_path=None))
