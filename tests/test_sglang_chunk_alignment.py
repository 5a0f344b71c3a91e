"""Prompt cut points under --enable-deterministic-inference, through SGLang's own
PrefillAdder with the plugin's hooks applied (sglang_ext.chunk_alignment): real Reqs, the
ChunkCache SGLang uses with the radix cache off, and a token allocator reduced to the free
token count the adder asks it for."""
from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
import sglang.srt.managers.schedule_policy as schedule_policy  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_ext import chunk_alignment, plugin  # noqa: E402

PAGE = 64


@pytest.fixture
def adder_for(monkeypatch):
    plugin.activate()
    # context-parallel lookups read SGLang's published server config, absent here
    monkeypatch.setattr(schedule_policy, "is_dsa_prefill_cp_in_seq_split", lambda: False)
    monkeypatch.setattr(schedule_policy, "is_prefill_context_parallel_enabled", lambda: False)

    def make(chunk=1024, free=100_000):
        allocator = SimpleNamespace(available_size=lambda: free)
        cache = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                           page_size=PAGE))
        return PrefillAdder(page_size=PAGE, tree_cache=cache, token_to_kv_pool_allocator=allocator,
                            running_batch=None, new_token_ratio=0.5, rem_input_tokens=16384,
                            rem_chunk_tokens=chunk)
    yield make
    chunk_alignment.set_alignment(None)


def request(rid, n, prefix=0, ignore_eos=True):
    sp = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=ignore_eos)
    sp.normalize(None)
    r = Req(rid, "", array("q", range(n)), sp)
    r.init_next_round_input(None)
    r.prefix_indices = torch.arange(prefix)
    return r


def cuts(adder, reqs, align):
    """(result, extend range or None) of each request offered to the adder in turn."""
    out = []
    for r in reqs:
        r.extend_range = None
        res = adder.add_one_req(r, False, align)
        got = r.extend_range if r in adder.can_run_list else None
        out.append((res, None if got is None else (got.start, got.end)))
    return out


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_a_new_prompt_is_cut_at_a_multiple_of_the_alignment_or_waits(adder_for, ignore_eos):
    """ignore_eos with the radix cache off takes SGLang's add_one_req_ignore_eos, which cuts
    where the budget ends (704 here) unless the hook is active; other requests take the
    aligned branch either way."""
    reqs = lambda: [request("a", 300, ignore_eos=ignore_eos), request("b", 900, ignore_eos=ignore_eos)]  # noqa: E731
    chunk_alignment.set_alignment(None)
    unaligned = cuts(adder_for(), reqs(), 1024)
    assert unaligned[0][1] == (0, 300)
    assert unaligned[1][1] == (None if not ignore_eos else (0, 704))
    chunk_alignment.set_alignment(1024)
    aligned = cuts(adder_for(), reqs(), 1024)
    assert aligned[0][1] == (0, 300) and aligned[1] == (AddReqResult.OTHER, None)
    # alone in a batch: one full step; whole when it fits
    assert cuts(adder_for(), [request("c", 1500, ignore_eos=ignore_eos)], 1024)[0][1] == (0, 1024)
    assert cuts(adder_for(), [request("d", 1000, ignore_eos=ignore_eos)], 1024)[0][1] == (0, 1000)
    # a smaller prompt may still use the budget the cut one left
    adder = adder_for(chunk=2048)
    got = cuts(adder, [request("e", 300), request("f", 2000), request("g", 500)], 1024)
    assert [g[1] for g in got] == [(0, 300), (0, 1024), (0, 500)]


def test_a_continuing_prompt_keeps_aligned_cuts_when_the_pool_runs_low(adder_for, caplog):
    """add_chunked_req cuts at min(chunk budget, free tokens); aligned down when that is at
    least one step, SGLang's cut (logged) when under one step: the request must run."""
    def next_chunk(free, align):
        chunk_alignment.set_alignment(align)
        adder = adder_for(chunk=2048, free=free)
        r = request("a", 4000, prefix=1024)
        adder.add_chunked_req(r)
        return r.extend_range.start, r.extend_range.end

    assert next_chunk(1500, None) == (1024, 2524)
    assert next_chunk(1500, 1024) == (1024, 2048)
    assert next_chunk(100_000, 1024) == (1024, 3072)
    assert next_chunk(100_000, 1024) == next_chunk(100_000, None)
    assert next_chunk(700, 1024) == (1024, 1724)
    assert "unaligned chunk" in caplog.text


def test_aligned_budget():
    assert chunk_alignment.aligned_budget(704, 900, 1024) == 0
    assert chunk_alignment.aligned_budget(704, 700, 1024) == 704
    assert chunk_alignment.aligned_budget(2500, 5000, 1024) == 2048
    assert chunk_alignment.aligned_budget(704, 900, None) == 704
