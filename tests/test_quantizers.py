"""The INT2 quantiser candidates of calibration.fidelity.quantizers and their simulator path (CPU)."""
from __future__ import annotations

import pytest
import torch

from calibration.fidelity import quantizers
from calibration.fidelity.sim_cache import FakeInt2KVSim
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.hybrid_cache import LayerRotation
from oscar_kernels.int2 import dequantise, fake_quantise

F8 = torch.float8_e4m3fn
H, D = 2, 128


def _gauss(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mse(a, b):
    return (a - b).pow(2).mean().item()


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("sdt", [torch.float32, F8])
def test_lloyd_max_beats_minmax_on_gaussian_groups(group, sdt):
    x = _gauss(512, D)
    lm = _mse(quantizers.fake_lloyd_max(x, group, 1.5, sdt), x)
    mm = _mse(fake_quantise(x, group, scale_dtype=sdt), x)
    assert lm < 0.85 * mm
    # near the Gaussian Lloyd-Max distortion (0.1175 sigma^2) when the group is large
    if group == 128 and sdt == torch.float32:
        assert lm < 0.13


def test_lloyd_max_codes_follow_the_gaussian_thresholds():
    """P(|z| < 0.9816) = 0.673: codes 1 and 2 take a third each, 0 and 3 a sixth each."""
    x = _gauss(2048, D, seed=1)
    codes, scales = quantizers.lloyd_max_quantise(x, 128, 1.5, torch.float32)
    frac = torch.bincount(codes.flatten().long(), minlength=4).float() / codes.numel()
    assert frac.tolist() == pytest.approx([0.1635, 0.3365, 0.3365, 0.1635], abs=0.01)
    assert scales.shape == (2048, 1, 2) and codes.dtype == torch.uint8 and int(codes.max()) == 3


def test_lloyd_max_stores_the_uniform_grid_of_its_span():
    """The stored (scale, min) put the 4 levels at mean + sigma * (-s, -s/3, s/3, s); the kernels'
    dequantise reads them back."""
    x = _gauss(1, 128, seed=2) * 3 + 5
    span = 1.7
    codes, scales = quantizers.lloyd_max_quantise(x, 128, span, torch.float32)
    mu, sd = x.mean().item(), x.std(unbiased=False).item()
    levels = sorted(set(dequantise(codes, scales).flatten().tolist()))
    assert levels == pytest.approx([mu + sd * f for f in (-span, -span / 3, span / 3, span)], rel=1e-5)
    assert scales[0, 0, 0].item() == pytest.approx(2 * span * sd / 3, rel=1e-6)


def test_lloyd_max_constant_group_is_exact_and_bad_span_refused():
    x = torch.full((3, 128), 0.5)
    assert torch.equal(quantizers.fake_lloyd_max(x, 32, 1.5, F8), x)
    with pytest.raises(ValueError, match="span"):
        quantizers.fake_lloyd_max(x, 32, 0.0, F8)


def test_per_channel_is_exact_on_data_constant_per_channel():
    chan = torch.tensor([0.5, -2.0, 0.0, 3.0]).repeat(32)  # float8-representable
    x = chan.expand(64, D).clone()
    assert torch.equal(quantizers.fake_per_channel(x, F8), x)
    # 4 uniform levels per channel over the page are exact too
    ramp = torch.arange(4.0).repeat(16).view(64, 1) * 0.25
    y = x + ramp
    assert torch.equal(quantizers.fake_per_channel(y, torch.float32), y)


def test_per_channel_leaves_sinks_out_of_the_page_range():
    x = _gauss(64, D, seed=3)
    x[:4] = 100.0  # BF16 sinks: would blow the range up
    exact = torch.arange(64) < 4
    with_sinks_out = quantizers.fake_per_channel(x, F8, exact)
    naive = quantizers.fake_per_channel(x, F8)
    assert _mse(with_sinks_out[4:], x[4:]) < 0.3 < 0.9 < _mse(naive[4:], x[4:])
    assert torch.equal(quantizers.fake_per_channel(x, F8, torch.ones(64, dtype=torch.bool)), x)


def test_bytes_per_token_no_candidate_costs_more_than_the_default():
    default = KVLayout.resolve(D)
    table = {q: quantizers.bytes_per_token_per_head(q, D, default.key_group_size, default.value_group_size,
                                                    default.scale_dtype) for q in quantizers.QUANTIZERS}
    assert table["minmax"]["total"] == default.bytes_per_token_per_head(D) == 74
    assert table["lloyd-max"]["total"] == 74
    # per channel: 2 float8 per channel per 64-token page = 4 B per token, values 2 B, codes 64 B
    assert table["per-channel-keys"] == {"codes": 64, "key_scales": 4.0, "value_scales": 2, "total": 70.0}
    # float16 (scale, min) for both tensors: 8 B of key pages + 4 B of values, over the budget
    assert quantizers.bytes_per_token_per_head("per-channel-keys", D, 32, 128, "float16")["total"] == 76.0
    with pytest.raises(ValueError, match="quantizer"):
        quantizers.bytes_per_token_per_head("kmeans", D, 32, 128, "float16")


def test_span_curve_is_lowest_near_the_gaussian_optimum():
    xs = [_gauss(256, D, seed=s) for s in range(2)]
    spans = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5]
    curve = quantizers.span_curve(xs, 128, spans, torch.float32)
    assert spans[curve.index(min(curve))] == 1.5
    assert quantizers.relative_mse(xs[0], xs[0]) == 0.0


# ---------------------------------------------------------------- the simulator path
def _rot(seed=0):
    q, _ = torch.linalg.qr(_gauss(H, D, D, seed=seed))
    inf = torch.full((H, D), float("inf"))
    return [LayerRotation(q, q.flip(-1), -inf, inf, -inf, inf)]


def _sim(quantizer, recent=128, **kw):
    return FakeInt2KVSim(_rot(), 32, 16, recent, 1, 400, scale_dtype="float8_e4m3fn", value_group_size=128,
                         quantizer=quantizer, **kw)


def _fill(sim, k, v, bounds):
    sim.begin(1)
    for lo, hi in bounds:
        sim._store(0, 1, lo, hi, k[:, lo:hi], v[:, lo:hi])
        sim.length = hi


def _rotate(x, r):
    return torch.einsum("bthd,hde->bthe", x.float(), r)


def test_sim_minmax_is_the_servers_fake_quantisation():
    k, v = _gauss(1, 300, H, D, seed=4).bfloat16(), _gauss(1, 300, H, D, seed=5).bfloat16()
    sim = _sim("minmax")
    _fill(sim, k, v, [(0, 300)])
    r = sim.rotations[0]
    want = torch.einsum("bthe,hde->bthd", fake_quantise(_rotate(k, r.k_rot), 32, scale_dtype=F8), r.k_rot)
    assert torch.equal(sim.kq[0][:, :300], want.bfloat16())


def test_sim_lloyd_max_uses_its_spans_per_tensor():
    k, v = _gauss(1, 200, H, D, seed=6).bfloat16(), _gauss(1, 200, H, D, seed=7).bfloat16()
    sim = _sim("lloyd-max", key_span=1.4, value_span=1.9)
    _fill(sim, k, v, [(0, 120), (120, 200)])
    r = sim.rotations[0]
    want_v = torch.einsum("bthe,hde->bthd", quantizers.fake_lloyd_max(_rotate(v, r.v_rot), 128, 1.9, F8), r.v_rot)
    assert torch.equal(sim.vq[0][:, :200], want_v.bfloat16())
    want_k = torch.einsum("bthe,hde->bthd", quantizers.fake_lloyd_max(_rotate(k, r.k_rot), 32, 1.4, F8), r.k_rot)
    assert torch.equal(sim.kq[0][:, :200], want_k.bfloat16())
    assert _sim("lloyd-max").key_span == quantizers.UPSTREAM_SPAN


def test_sim_per_channel_keys_quantises_complete_pages_only():
    k, v = _gauss(1, 300, H, D, seed=8).bfloat16(), _gauss(1, 300, H, D, seed=9).bfloat16()
    sim = _sim("per-channel-keys")
    _fill(sim, k, v, [(0, 100), (100, 130), (130, 300)])  # pages complete at 64, 128, 192, 256
    r = sim.rotations[0]
    assert sim.kq[0][0, 256:300].abs().sum() == 0  # the page being filled: not yet quantised
    page = _rotate(k[:, 64:128], r.k_rot)[0].transpose(0, 1)  # [H, 64, D]
    want = torch.einsum("hte,hde->thd", quantizers.fake_per_channel(page, F8), r.k_rot)
    assert torch.equal(sim.kq[0][0, 64:128], want.bfloat16())
    page0 = _rotate(k[:, :64], r.k_rot)[0].transpose(0, 1)
    want0 = torch.einsum("hte,hde->thd", quantizers.fake_per_channel(page0, F8, torch.arange(64) < 16), r.k_rot)
    assert torch.equal(sim.kq[0][0, 16:64], want0[16:].bfloat16())
    # values: per token as minmax
    want_v = torch.einsum("bthe,hde->bthd", fake_quantise(_rotate(v, r.v_rot), 128, scale_dtype=F8), r.v_rot)
    assert torch.equal(sim.vq[0][:, :300], want_v.bfloat16())
    # a decode step at n = 301 reads INT2 keys at [16, 173) -- all on complete pages -- and BF16 beyond
    sim.length = 300
    sim._store(0, 1, 300, 301, k[:, :1], v[:, :1])
    kk, _ = sim._read(0, 1, 300, 301, 1)
    assert torch.equal(kk[:, 16:173], sim.kq[0][:, 16:173])
    assert torch.equal(kk[:, 173:300], k[:, 173:300])
    assert torch.equal(kk[:, :16], k[:, :16])


def test_sim_per_channel_keys_needs_the_ring_to_hold_a_page():
    with pytest.raises(ValueError, match="recent window"):
        _sim("per-channel-keys", recent=32)
    with pytest.raises(ValueError, match="quantizer"):
        _sim("kmeans")


def test_oscar_eval_quantizer_needs_a_fake_run(tmp_path):
    from calibration.fidelity import cli
    assert "--quantizer" in cli.build_parser().format_help()
    with pytest.raises(SystemExit, match="int2-parts"):
        cli.main(["--model", str(tmp_path), "--quantizer", "lloyd-max"])
    with pytest.raises(SystemExit, match="recent"):
        cli.main(["--model", str(tmp_path), "--int2-parts", "kv-fake", "--quantizer", "per-channel-keys",
                  "--recent", "32"])
    with pytest.raises(SystemExit):
        cli.main(["--model", str(tmp_path), "--lloyd-max-span", "0"])


def test_attention_out_error_counts_only_the_int2_positions():
    t, d = 64, 16
    q, k, v = _gauss(8, d, seed=10), _gauss(t, d, seed=11), _gauss(t, d, seed=12)
    pos = torch.arange(t - 1, t - 9, -1)
    ref = quantizers.attention_reference(q, pos, k, v, sink=4, recent=16, scale=d ** -0.5)
    assert quantizers.attention_out_error(q, ref, v, k, v, d ** -0.5)[0] == pytest.approx(0.0, abs=1e-9)
    outside = torch.ones(t, 1)
    outside[4:t - 16] = 0  # beyond: the sinks and positions in every query's ring (never read from INT2)
    assert quantizers.attention_out_error(q, ref, v, k + 5 * outside, v - 5 * outside, d ** -0.5)[0] \
        == pytest.approx(0.0, abs=1e-6)
    e, o2 = quantizers.attention_out_error(q, ref, v, None, v + (1 - outside), d ** -0.5)
    assert e > 1e-3 * o2 > 0
