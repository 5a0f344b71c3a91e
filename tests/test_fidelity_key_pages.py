"""FakeInt2KVSim's KIVI-style keys (``key_channel_page``): one scale and min per rotated channel over
a page of positions, checked against a hand-written loop (CPU, no model)."""
from __future__ import annotations

import math

import pytest
import torch

from calibration.fidelity.sim_cache import FakeInt2KVSim, fake_quantise_channels
from oscar_kernels.hybrid_cache import LayerRotation

H, D = 2, 8


def _ref_channels(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, D] of one head -> per channel over the T tokens, written out element by element."""
    out = torch.empty_like(x, dtype=torch.float32)
    for c in range(x.shape[1]):
        col = [float(v) for v in x[:, c]]
        lo = float(torch.tensor(min(col)).to(dtype).float())
        scale = float(torch.tensor((max(col) - min(col)) / 3).to(dtype).float())
        for t, v in enumerate(col):
            code = 0 if scale == 0 else min(3, max(0, math.floor((v - lo) / scale + 0.5)))
            out[t, c] = lo + code * scale
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_fake_quantise_channels_matches_a_loop(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, H, D, generator=g) * torch.linspace(0.1, 4, D)  # channels of unequal range
    x[1, :, 0, 3] = 0.7  # a constant channel: scale 0, every code 0
    got = fake_quantise_channels(x, dtype)
    for b in range(2):
        for h in range(H):
            torch.testing.assert_close(got[b, :, h], _ref_channels(x[b, :, h], dtype), rtol=0, atol=1e-6)
    assert torch.equal(got[1, :, 0, 3], torch.full((5,), float(torch.tensor(0.7).to(dtype).float())))


def _rotation(seed: int) -> LayerRotation:
    g = torch.Generator().manual_seed(seed)
    q = torch.stack([torch.linalg.qr(torch.randn(D, D, generator=g))[0] for _ in range(H)])
    inf = torch.full((H, D), math.inf)
    return LayerRotation(q, q.clone(), -inf, inf, -inf, inf, torch.randn(H, D, generator=g))


def test_key_pages_quantise_complete_pages_per_channel():
    """Pages of P=4 after S=2 sinks, stored in uneven chunks: each complete page's keys equal
    rotate -> shift -> per-channel INT2 over the page's positions -> unshift -> rotate back;
    the incomplete last page is never quantised; reads take INT2 keys on [S, n - W) only."""
    P, S, W, N = 4, 2, 4, 13
    rot = _rotation(1)
    sim = FakeInt2KVSim([rot], 4, S, W, 1, N, parts="k", scale_dtype="float8_e4m3fn",
                        key_channel_page=P, key_page_scale_dtype="float16")
    sim.begin(1)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, N, H, D, generator=g).to(torch.bfloat16)
    v = torch.randn(1, N, H, D, generator=g).to(torch.bfloat16)
    n = 0
    for t in (5, 3, 1, 1, 1, 1, 1):
        sim._store(0, 1, n, n + t, k[:, n:n + t], v[:, n:n + t])
        n += t
    kq = sim.kq[0][0].float()
    for lo, hi in ((S, 4), (4, 8), (8, 12)):  # the first page loses its sinks
        for h in range(H):
            xr = k[0, lo:hi, h].float() @ rot.k_rot[h] - rot.k_shift[h]
            want = ((_ref_channels(xr, torch.float16) + rot.k_shift[h]) @ rot.k_rot[h].T).to(torch.bfloat16)
            # one bf16 step: the simulator rotates with a batched einsum, this with a per-head matmul,
            # whose float32 sums may round apart on another CPU's BLAS
            torch.testing.assert_close(kq[lo:hi, h], want.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.count_nonzero(kq[:S]) == 0 and torch.count_nonzero(kq[12:]) == 0
    # a decode step at n = 13 reads INT2 keys on [S, 13 - W = 9), BF16 elsewhere; values stay BF16
    kk, vv = sim._read(0, 1, 12, 13, 1)
    assert torch.equal(kk[0, S:9], sim.kq[0][0, S:9]) and torch.equal(kk[0, 9:13], k[0, 9:13])
    assert torch.equal(kk[0, :S], k[0, :S]) and torch.equal(vv[0], v[0])
    # per-channel pages are not the per-token groups
    plain = FakeInt2KVSim([rot], 4, S, W, 1, N, parts="k", scale_dtype="float8_e4m3fn")
    plain.begin(1)
    plain._store(0, 1, 0, N, k, v)
    assert not torch.equal(plain.kq[0][0, S:12], sim.kq[0][0, S:12])


def test_key_pages_refusals():
    rot = _rotation(3)
    with pytest.raises(ValueError, match="recent window"):
        FakeInt2KVSim([rot], 4, 2, 2, 1, 16, key_channel_page=4)
    with pytest.raises(ValueError, match="key channel page"):
        FakeInt2KVSim([rot], 4, 2, 8, 1, 16, key_channel_page=-1)


def test_oscar_eval_refuses_key_pages_outside_fake_runs(capsys):
    from calibration.fidelity import cli
    common = ["--model", "/nonexistent", "--method", "a=/nonexistent.safetensors", "--key-channel-page", "64"]
    for argv, why in ((common, "needs --int2-parts kv-fake or k"),  # the kernels store per-token groups only
                      ([*common, "--int2-parts", "kv-fake", "--recent", "32"], "needs --recent >= it"),
                      (["--model", "/nonexistent", "--method", "a=/x", "--key-page-scale-dtype", "float16"],
                       "needs --key-channel-page")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert why in capsys.readouterr().err
