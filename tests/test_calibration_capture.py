"""The capture sees exactly what the model computes; C_Q / C_S equal a direct computation."""
import pytest
import torch

from calibration.capture import attention_modules, capture_attention, group_by_kv_head
from calibration.statistics import AttentionStats, Reservoir
from calibration_helpers import tiny_model


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _independent_attention(model, input_ids):
    """Per layer (q, k, v, o) recomputed from each attention module's inputs, eager math."""
    out = {}

    def pre_hook(mod, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        b, t, _ = h.shape
        d = mod.head_dim

        def heads(proj, norm):
            x = proj(h).view(b, t, -1, d)
            if norm is not None:
                x = norm(x)
            return x.transpose(1, 2)

        q = heads(mod.q_proj, getattr(mod, "q_norm", None))
        k = heads(mod.k_proj, getattr(mod, "k_norm", None))
        v = heads(mod.v_proj, None)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        rep = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        logits = (q @ kk.transpose(-1, -2)) * mod.scaling
        logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        o = torch.softmax(logits.double(), -1).to(q.dtype) @ vv
        out[mod.layer_idx] = (q, k, v, o)

    hooks = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in attention_modules(model)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for hk in hooks:
            hk.remove()
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
def test_capture_matches_independent_computation_and_sdpa(family):
    model = tiny_model(family, kv_heads=2 if family != "llama" else 4)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = _independent_attention(model, ids)
    seen = {}
    with torch.no_grad():
        sdpa_logits = model(input_ids=ids).logits
        with capture_attention(model, lambda l, q, k, v, o: seen.__setitem__(l, (q, k, v, o))):
            cap_logits = model(input_ids=ids).logits
    assert model.config._attn_implementation == "sdpa"  # restored
    assert torch.equal(sdpa_logits, cap_logits)
    assert sorted(seen) == list(range(model.config.num_hidden_layers))
    for layer, (q, k, v, o) in seen.items():
        for got, want in zip((q, k, v, o), ref[layer]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family,kv_heads", [("qwen3", 2), ("llama", 1), ("mistral", 4)])
def test_covariances_equal_direct_computation(family, kv_heads):
    model = tiny_model(family, kv_heads=kv_heads)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(3)]
    stats = AttentionStats(2, kv_heads, 32)
    with torch.no_grad(), capture_attention(model, stats):
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    sum_qq = torch.zeros(2, kv_heads, 32, 32, dtype=torch.float64)
    sum_oo = torch.zeros_like(sum_qq)
    n = 0
    for ids in batches:
        ref = _independent_attention(model, ids)
        n += ids.numel()
        for layer, (q, _, _, o) in ref.items():
            rep = q.shape[1] // kv_heads
            for h in range(q.shape[1]):
                qh = q[:, h].reshape(-1, 32).double()
                oh = o[:, h].reshape(-1, 32).double()
                sum_qq[layer, h // rep] += qh.T @ qh
                sum_oo[layer, h // rep] += oh.T @ oh
    assert stats.tokens == [n, n]
    torch.testing.assert_close(stats.c_q(), sum_qq / n, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats.c_s(), sum_oo / n, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_capture_on_a_real_model_is_exact(real_model_dir):
    """SmolLM2-135M-Instruct: trained weights, 3 query heads per KV head, head_dim 64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(3))
    attn_out, seen = {}, {}
    hooks = [m.register_forward_hook(lambda mod, a, out: attn_out.__setitem__(mod.layer_idx, out[0]))
             for m in attention_modules(model)]
    with torch.no_grad():
        sdpa_logits = model(input_ids=ids).logits
        attn_out.clear()
        with capture_attention(model, lambda l, q, k, v, o: seen.__setitem__(l, (q, k, v, o))):
            cap_logits = model(input_ids=ids).logits
    for hk in hooks:
        hk.remove()
    assert torch.equal(sdpa_logits, cap_logits)
    ref = _independent_attention(model, ids)
    for layer, mod in enumerate(attention_modules(model)):
        q, k, v, o = seen[layer]
        assert q.shape == (1, 9, 128, 64) and k.shape == (1, 3, 128, 64) and o.shape == q.shape
        for got, want in zip((q, k, v, o), ref[layer]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the captured per-head output, through o_proj, is the attention module's output
        b, h, t, d = o.shape
        torch.testing.assert_close(mod.o_proj(o.transpose(1, 2).reshape(b, t, h * d)), attn_out[layer])


def test_group_by_kv_head_follows_repeat_kv():
    x = torch.arange(2 * 6 * 3 * 4, dtype=torch.float32).reshape(2, 6, 3, 4)  # B, Hq=6, T, D
    g = group_by_kv_head(x, 2)  # Hkv = 2, rep = 3: query heads 0-2 -> kv 0, 3-5 -> kv 1
    assert g.shape == (2, 2 * 3 * 3, 4)
    assert set(map(tuple, g[0].tolist())) == set(map(tuple, x[:, 0:3].reshape(-1, 4).tolist()))
    assert set(map(tuple, g[1].tolist())) == set(map(tuple, x[:, 3:6].reshape(-1, 4).tolist()))


def test_reservoir_is_bounded_deterministic_and_made_of_stream_rows():
    def run(seed):
        r = Reservoir(50, seed=seed)
        for start in range(0, 1000, 64):
            rows = torch.arange(start, min(start + 64, 1000), dtype=torch.float32)[:, None, None].expand(-1, 2, 3)
            r.add(rows)
        return r

    a, b, c = run(0), run(0), run(1)
    assert a.sample().shape == (50, 2, 3) and a.seen == 1000
    assert torch.equal(a.sample(), b.sample())
    assert not torch.equal(a.sample(), c.sample())
    ids = a.sample()[:, 0, 0]
    assert len(set(ids.tolist())) == 50 and (ids >= 0).all() and (ids < 1000).all()
    assert (a.sample() == ids[:, None, None]).all()
    assert ids.float().mean() > 250  # not just the first rows: algorithm R keeps later ones too


def test_reservoir_uniformity():
    counts = torch.zeros(200)
    for seed in range(300):
        r = Reservoir(20, seed=seed)
        for start in range(0, 200, 32):
            r.add(torch.arange(start, min(start + 32, 200), dtype=torch.float32)[:, None])
        counts[r.sample()[:, 0].long()] += 1
    # each row is kept with probability 20/200: expected 30 of 300 runs
    first, last = counts[:100].mean(), counts[100:].mean()
    assert 25 < first < 35 and 25 < last < 35


def test_stats_memory_does_not_grow_with_tokens():
    stats = AttentionStats(1, 2, 8, reservoir_tokens=16, skip_first=2)
    for _ in range(5):
        q = torch.randn(2, 4, 32, 8)
        k, v = torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
        stats(0, q, k, v, q.clone())
    assert stats.tokens == [320]
    assert stats.k_res[0].rows.shape == (16, 2, 8) and stats.k_res[0].seen == 5 * 2 * 30
    assert stats.sum_qq.shape == (1, 2, 8, 8)


def test_k_and_v_reservoirs_draw_the_same_tokens():
    stats = AttentionStats(1, 2, 8, reservoir_tokens=16, skip_first=0)
    for _ in range(4):
        k = torch.randn(1, 2, 40, 8)
        stats(0, torch.randn(1, 4, 40, 8), k, k + 1, torch.randn(1, 4, 40, 8))
    torch.testing.assert_close(stats.v_res[0].sample(), stats.k_res[0].sample() + 1)
