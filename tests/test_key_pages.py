"""Per-channel key pages (oscar_kernels.key_pages) through HybridAttention's protocol on the
reference path: after chunked prefill (pages straddling chunks) and decode steps, every
complete page holds what the simulator's per-channel-keys quantiser makes of the same keys."""
import pytest
import torch

from calibration.fidelity.quantizers import fake_per_channel
from oscar_kernels import key_pages
from oscar_kernels.hybrid_attention import HybridAttention
from oscar_kernels.hybrid_cache import HybridCache, LayerRotation, allocate_index, allocate_layer
from oscar_kernels.reference import rotate

H, D, S, W, PAGE, HQ = 2, 16, 4, 16, 8, 4


def _cache(key_group=1, recent=W):
    g = torch.Generator().manual_seed(0)
    rot = torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]
    clip = torch.full((H, D), 1.5)
    lr = LayerRotation(rot, rot.clone(), -clip, clip, -clip * 2, clip * 2)
    layer = allocate_layer(256, H, D, key_group, S, recent, 2, 2, value_group_size=D)
    index = allocate_index(256, PAGE, 2, 2)
    return HybridCache([layer], [lr], index, torch.arange(256, dtype=torch.int32).view(2, 128)), lr


def test_complete_pages_hold_the_simulators_per_channel_keys(monkeypatch):
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "0")
    cache, lr = _cache()
    attn = HybridAttention(cache, HQ, 0.25, key_pages=True)
    g = torch.Generator().manual_seed(1)
    n_total = 43
    k = torch.randn(n_total, H, D, generator=g).to(torch.bfloat16)
    v = torch.randn(n_total, H, D, generator=g).to(torch.bfloat16)
    q = torch.randn(n_total, HQ, D, generator=g).to(torch.bfloat16)
    row = torch.tensor([0])
    r2t = cache.req_to_token
    owner = torch.tensor([7])
    for lo, hi in [(0, 13), (13, 30)]:  # chunked prefill; the second chunk completes a page begun in the first
        pos = torch.arange(lo, hi)
        attn.plan_extend(row, torch.tensor([lo]), torch.tensor([hi - lo]), pos, r2t[0, lo:hi].long(),
                         prefix_lens_host=[lo], extend_lens_host=[hi - lo], owners=owner)
        attn.extend(0, q[lo:hi], k[lo:hi], v[lo:hi])
    for p in range(30, n_total):  # decode completes pages 3 and 4 from the ring
        attn.plan_decode(row, torch.tensor([p + 1]), torch.tensor([p]), r2t[0, p:p + 1].long())
        attn.decode(0, q[p:p + 1], k[p:p + 1], v[p:p + 1])

    complete = (n_total // PAGE) * PAGE
    x = rotate(k.float(), lr.k_rot).to(torch.bfloat16).float()  # the ring's / the batch's k'
    x = torch.maximum(torch.minimum(x, lr.k_clip_max), lr.k_clip_min)
    x = x[:complete]
    pages = x.view(-1, PAGE, H, D).transpose(1, 2)  # [pages, H, P, D]
    exact = (torch.arange(complete) < S).view(-1, PAGE)
    want = torch.stack([fake_per_channel(pages[i], torch.float8_e4m3fn, exact[i]) for i in range(len(pages))])
    want = want.transpose(1, 2).reshape(complete, H, D)
    layer = cache.layers[0]
    got = key_pages._stored_keys(layer, r2t[0, :complete].long())
    torch.testing.assert_close(got[S:], want[S:], rtol=0, atol=0)
    # one (scale, min) per channel for the whole page
    sc = layer.k_scales[r2t[0, :complete].long()].float().view(-1, PAGE, H, D, 2)
    assert torch.equal(sc[:, S:], sc[:, S:S + 1].expand_as(sc[:, S:]))
    # the unfinished page keeps the store's per-token values (groups of one channel: the min)
    tail = key_pages._stored_keys(layer, r2t[0, complete:n_total].long())
    x_tail = torch.einsum("thd,hde->the", k[complete:].float(), lr.k_rot)  # the store's float32 k'
    x_tail = torch.maximum(torch.minimum(x_tail, lr.k_clip_max), lr.k_clip_min)
    torch.testing.assert_close(tail, x_tail.to(torch.float8_e4m3fn).float(), rtol=0, atol=0)


def test_a_page_the_ring_lost_enters_with_its_stored_keys(monkeypatch):
    """A row restarted mid-page (re-admission): the page's earlier tokens are no longer valid
    in the ring, so their stored INT2 values enter the page's range."""
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "0")
    cache, lr = _cache()
    attn = HybridAttention(cache, HQ, 0.25, key_pages=True)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(16, H, D, generator=g).to(torch.bfloat16)
    q = torch.randn(16, HQ, D, generator=g).to(torch.bfloat16)
    row, r2t = torch.tensor([0]), cache.req_to_token
    spans = [(0, 12, 1), (12, 16, 2)]  # the second batch comes from another owner: its ring restarts at 12
    for lo, hi, owner in spans:
        pos = torch.arange(lo, hi)
        if lo == 12:
            before = key_pages._stored_keys(cache.layers[0], r2t[0, 8:12].long()).clone()
        attn.plan_extend(row, torch.tensor([lo]), torch.tensor([hi - lo]), pos, r2t[0, lo:hi].long(),
                         prefix_lens_host=[lo], extend_lens_host=[hi - lo], owners=torch.tensor([owner]))
        attn.extend(0, q[lo:hi], k[lo:hi], k[lo:hi])
    x = rotate(k[12:16].float(), lr.k_rot).to(torch.bfloat16).float()
    x = torch.maximum(torch.minimum(x, lr.k_clip_max), lr.k_clip_min)
    page = torch.cat([before, x])  # [8, H, D]
    want = fake_per_channel(page.transpose(0, 1), torch.float8_e4m3fn).transpose(0, 1)
    got = key_pages._stored_keys(cache.layers[0], r2t[0, 8:16].long())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("key_group, recent, why", [(4, W, "groups of 1 channel"), (1, 4, "recent window")])
def test_key_pages_refuse_a_cache_they_cannot_serve(key_group, recent, why):
    cache, _ = _cache(key_group, recent)
    with pytest.raises(ValueError, match=why):
        HybridAttention(cache, HQ, 0.25, key_pages=True)
