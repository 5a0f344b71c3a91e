"""The INT2 quantiser candidates of calibration.fidelity.quantizers and their simulator path (CPU)."""
from __future__ import annotations

import pytest
import torch

from calibration.fidelity import quantizers
from calibration.fidelity.sim_cache import FakeInt2KVSim
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.hybrid_cache import LayerRotation
from oscar_kernels.int2 import fake_quantise

F8 = torch.float8_e4m3fn
H, D = 2, 128


def _gauss(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mse(a, b):
    return (a - b).pow(2).mean().item()


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
    # per channel: 2 float8 per channel per 64-token page = 4 B per token, values 2 B, codes 64 B
    assert table["per-channel-keys"] == {"codes": 64, "key_scales": 4.0, "value_scales": 2, "total": 70.0}
    # float16 (scale, min) for both tensors: 8 B of key pages + 4 B of values, over the budget
    assert quantizers.bytes_per_token_per_head("per-channel-keys", D, 32, 128, "float16")["total"] == 76.0
    with pytest.raises(ValueError, match="quantizer"):
        quantizers.bytes_per_token_per_head("kmeans", D, 32, 128, "float16")


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


def test_oscar_eval_per_channel_keys_needs_the_ring_to_hold_a_page(tmp_path):
    from calibration.fidelity import cli
    assert "--quantizer" in cli.build_parser().format_help()
    for parts in ("kv", "kv-fake"):
        with pytest.raises(SystemExit, match="recent"):
            cli.main(["--model", str(tmp_path), "--int2-parts", parts, "--quantizer", "per-channel-keys",
                      "--recent", "32"])
