"""Speculative decoding on the hybrid cache (issue 49), reference path: plan_verify / verify /
move / commit against plain decode of the accepted drafts (kernel_helpers.speculative_vs_decode);
the Triton path of the same protocol is in test_kernels_interpret.py."""
import pytest
import torch

import kernel_helpers as kh
from oscar_kernels import reference as ref
from oscar_kernels import testing as kc
from oscar_kernels.speculative import accept_index_from_lens, chain_parents, commit_tokens, draft_ancestors


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "0")


def _chain(b, t):
    return [[i - 1 for i in range(t)] for _ in range(b)]


# 0 root; 1, 2 its children; 3 <- 1, 4 <- 2; 5 <- 3, 6 <- 4 (topk 2, depth 4)
_TREE = [-1, 0, 0, 1, 2, 3, 4]


def test_draft_ancestors_and_commit_tokens():
    anc = draft_ancestors(torch.tensor([_TREE]))[0]
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}, 6: {0, 2, 4, 6}}
    for i, a in want.items():
        assert set(torch.nonzero(anc[i]).flatten().tolist()) == a
    assert torch.equal(draft_ancestors(chain_parents(1, 4))[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    acc = accept_index_from_lens(torch.tensor([2, 0]), 3)
    assert acc.tolist() == [[0, 1, -1], [-1, -1, -1]]
    tok, pos, ends, new = commit_tokens(torch.tensor([10, 20]), acc, 3, 4, 8)
    assert tok.tolist() == [0, 1, 0, 3, 3, 3] and new.tolist() == [12, 20]
    assert pos.tolist() == [10, 11, 4, 4, 4, 4] and ends.tolist() == [12, 12, 13, 13, 13, 13]


@pytest.mark.parametrize("accept", [[5, 5, 5], [0, 0, 0], [5, 0, 3], [1, 4, 2]],
                         ids=["all", "none", "mixed", "k_of_n"])
def test_chain_verify_commit_equals_decode(accept):
    """Drafts 13..17, 22..26, 31..35: across page boundaries (page 8) and ring cells wrapping (W 8)."""
    sc = kc.build([13, 22, 31], H=2, D=64, G=16, S=4, W=8, page=8, seed=1)
    kh.speculative_vs_decode(sc, 4, _chain(3, 5), [list(range(a)) for a in accept])


def test_chain_deeper_than_the_window():
    """W = 4 < 6 drafts: a deep draft reads its shallow ancestors as INT2, as decode does."""
    sc = kc.build([9, 14], H=2, D=64, G=16, S=4, W=4, page=8, seed=2)
    kh.speculative_vs_decode(sc, 4, _chain(2, 6), [list(range(6)), list(range(5))])


@pytest.mark.parametrize("s, w", [(0, 8), (4, 0), (0, 0)])
def test_chain_without_sinks_or_ring(s, w):
    sc = kc.build([11, 17], H=2, D=64, G=16, S=s, W=w, page=8, seed=3)
    kh.speculative_vs_decode(sc, 4, _chain(2, 4), [[0, 1, 2], [0]])


@pytest.mark.parametrize("accepted", [[[0, 2, 4, 6], [0, 1, 3], [0]], [[0, 1, 3, 5], [], [0, 2]]],
                         ids=["second_branch", "first_branch"])
def test_tree_verify_move_commit_equals_decode(accepted):
    """topk 2: tree nodes share positions; the accepted path is moved to the front slots."""
    sc = kc.build([13, 21, 6], H=2, D=64, G=16, S=4, W=8, page=8, seed=4)
    kh.speculative_vs_decode(sc, 4, [_TREE] * 3, accepted)


def test_radix_hit_prefix_with_shared_slots():
    """Request 1's first two pages are request 0's (a radix hit; its sinks are request 0's)
    and its ring starts at its prefix (valid_from = 20)."""
    sc = kc.build([20, 20], H=2, D=64, G=16, S=4, W=8, page=8, seed=5, valid_from=[0, 20])
    r0, r1 = (int(r) for r in sc.rows)
    sc.req_to_token[r1, :16] = sc.req_to_token[r0, :16]
    kh.speculative_vs_decode(sc, 4, [_TREE, _TREE], [[0, 2, 4], [0, 1, 3, 5]])
    kh.speculative_vs_decode(sc, 4, _chain(2, 5), [[0, 1, 2, 3, 4], [0, 1]])


@pytest.mark.parametrize("accept", [[5, 5], [2, 3], [0, 1]])
def test_inside_the_sink_window(accept):
    """Prefixes 1 and 3 < S = 6: drafts write sinks at commit only (positions 1..5, 3..7)."""
    sc = kc.build([1, 3], H=2, D=64, G=16, S=6, W=8, page=8, seed=6)
    kh.speculative_vs_decode(sc, 4, _chain(2, 5), [list(range(a)) for a in accept])
    kh.speculative_vs_decode(sc, 4, [[-1, 0, 0, 1, 2]] * 2, [[0, 2, 4], [0, 1]][:2])


def test_two_layers_and_learned_sinks():
    sc = kc.build([13, 30], H=2, D=64, G=16, S=4, W=8, page=8, seed=7)
    sinks = torch.tensor([1.0, -2.0, 0.5, 30.0]).bfloat16()
    kh.speculative_vs_decode(sc, 4, [_TREE] * 2, [[0, 2, 4, 6], [0, 1]], sinks=sinks, extra_layer_seed=11)


def test_the_per_draft_window_matters():
    """Reading every draft's prefix with the window at the prefix end (as extend does) is not
    what decode reads (its window ends past the draft itself): the decode comparison has teeth."""
    sc = kc.build([13], H=2, D=64, G=16, S=4, W=8, page=8, seed=8)
    outs = kh.speculative_vs_decode(sc, 4, _chain(1, 5), [list(range(5))])[0]
    # the same drafts through extend's read (prefix window ends at 13), on a fresh copy
    from oscar_kernels.hybrid_attention import HybridAttention
    from oscar_kernels.hybrid_cache import HybridCache
    lay = kh.clone_layer(sc.layer)
    index = kc.index_to(sc.index, "cpu")
    index.ring_end[sc.rows.long()] = 13  # a continuation: extend keeps the ring
    attn = HybridAttention(HybridCache([lay], [sc.rotation], index, sc.req_to_token), 4, sc.sm_scale)
    g = torch.Generator().manual_seed(5)  # the helper's q, k, v
    q, k, v = ((torch.randn(5, hh, 64, generator=g) * 2).bfloat16() for hh in (4, 2, 2))
    pos = torch.arange(13, 18)
    attn.plan_extend(sc.rows, torch.tensor([13]), torch.tensor([5]), pos, sc.req_to_token[int(sc.rows[0]), 13:18],
                     prefix_lens_host=[13], extend_lens_host=[5], owners=torch.zeros(1, dtype=torch.int64))
    o_ext = attn.extend(0, q, k, v)
    # decode of draft i reads positions < 13 + i + 1 - W as INT2; extend reads 5..12 from the ring
    assert (o_ext.float() - outs.float()).abs().max() > 0.1


def test_evicted_sink_slot_and_a_request_without_one():
    """Request 0's sink slot went to another page, request 1 never had one: their positions
    < S are INT2 for decode, so for the drafts too."""
    sc = kc.build([3, 12], H=2, D=64, G=16, S=4, W=4, page=8, seed=9, evict_sink_of=(0,), no_sink=(1,))
    kh.speculative_vs_decode(sc, 4, [_TREE[:6]] * 2, [[0, 2, 4], [0, 1, 3, 5]])
