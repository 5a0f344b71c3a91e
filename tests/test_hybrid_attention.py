"""HybridAttention's plans and warm-up on CPU (the reference path, and the Triton kernels
interpreted where OSCAR_FORCE_TRITON=1); its outputs against the per-kernel API are
checked in test_kernels_interpret (attention_session) and the server's protocol in
test_sglang_backend."""
import copy

import pytest
import torch

from oscar_kernels import testing as kc
from oscar_kernels.hybrid_attention import HybridAttention
from oscar_kernels.hybrid_cache import HybridCache


def _attention(monkeypatch, triton: bool, **kw):
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1" if triton else "0")
    sc = kc.build([40, 24], H=2, D=64, G=16, S=4, W=8, page=8, seed=3)
    cache = HybridCache([sc.layer], [sc.rotation], sc.index, sc.req_to_token)
    return sc, HybridAttention(cache, 4, sc.sm_scale, **kw)


@pytest.mark.parametrize("triton", [False, True])
def test_warm_up_leaves_the_real_cache_and_plans_alone(monkeypatch, triton):
    sc, attn = _attention(monkeypatch, triton)
    before = copy.deepcopy((sc.layer, vars(sc.index)))
    assert attn.warm_up() > 0
    after = (sc.layer, vars(sc.index))
    for name in sc.layer.__dataclass_fields__:
        assert torch.equal(getattr(after[0], name), getattr(before[0], name)), name
    for name, value in before[1].items():
        assert torch.equal(after[1][name], value) if isinstance(value, torch.Tensor) else after[1][name] == value
    assert attn.cache.layers[0] is sc.layer and attn._decode is None and attn._extend is None


def test_layer_calls_must_match_the_planned_batch(monkeypatch):
    sc, attn = _attention(monkeypatch, False)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="planned decode batch has None"):
        attn.decode(0, q, kv, kv)
    rows = sc.rows.long()
    attn.plan_decode(rows, torch.tensor([41, 25]), torch.tensor([40, 24]), sc.req_to_token[rows, torch.tensor([40, 24])])
    with pytest.raises(RuntimeError, match="decode of 3 requests, but the planned decode batch has 2"):
        attn.decode(0, q, kv, kv)
    with pytest.raises(ValueError, match=r"slots/positions must have shape \(5,\)"):
        attn.plan_extend(rows, torch.tensor([0, 0]), torch.tensor([2, 3]), torch.arange(4), torch.arange(4),
                         prefix_lens_host=[0, 0], extend_lens_host=[2, 3], owners=torch.zeros(2, dtype=torch.int64))


def test_extend_plan_hands_out_sinks_and_restarts_foreign_rings(monkeypatch):
    """A sequence that starts at position 0 gets a sink slot for its first page (never the
    padding page); a row whose ring another owner wrote restarts at its prefix, a
    continuation keeps it."""
    sc, attn = _attention(monkeypatch, False, padding_page=0)
    index, r2t = sc.index, sc.req_to_token
    index.sink_slot_of_page.fill_(-1)
    index.page_of_sink_slot.fill_(-1)
    rows = sc.rows.long()

    def plan(prefix, new, owners):
        pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)])
        slots = torch.cat([r2t[r, p:p + n].long() for r, p, n in zip(rows.tolist(), prefix, new)])
        attn.plan_extend(rows, torch.tensor(prefix), torch.tensor(new), pos, slots, prefix_lens_host=prefix,
                         extend_lens_host=new, owners=torch.tensor(owners))

    plan([0, 8], [8, 4], [1, 2])  # row 0 starts, row 1 is a radix hit in a reused row
    first_page = int(r2t[rows[0], 0]) // 8
    assert int(index.sink_slot_of_page[first_page]) >= 0
    assert index.ring_valid_from[rows].tolist() == [0, 8] and index.ring_end[rows].tolist() == [8, 12]
    plan([8, 12], [4, 4], [1, 2])  # both continue
    assert index.ring_valid_from[rows].tolist() == [0, 8]
    plan([12, 16], [4, 4], [3, 2])  # row 0 taken by another request at the same length
    assert index.ring_valid_from[rows].tolist() == [12, 8]
