"""Eigen-decomposition, rotation variants, clip search."""
import math

import pytest
import torch

from calibration.clip import quant_error, search_clip
from calibration.compose import VARIANTS, compose, hadamard_rotation, identity_rotation, sorted_eigh
from calibration.transforms import hadamard_matrix
from oscar_kernels.contract.rotations_file import orthogonality_error
from oscar_kernels.int2 import fake_quantise

F16 = torch.float16  # float16 (scale, min): the rounding these error comparisons were made with


def _random_cov(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4 * d, d, generator=g, dtype=torch.float64) * torch.logspace(1, -2, d, dtype=torch.float64)
    return a.T @ a / (4 * d)


def test_sorted_eigh_descending_and_reconstructs():
    c = _random_cov(64)
    vals, u = sorted_eigh(c)
    assert (vals[:-1] >= vals[1:]).all()
    torch.testing.assert_close(u @ torch.diag(vals) @ u.T, c)
    assert orthogonality_error(u) < 1e-12
    pivot = u.abs().argmax(0)
    assert (u[pivot, torch.arange(64)] > 0).all()  # deterministic signs


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("group", [128, 32, 8])
def test_every_variant_is_orthogonal(variant, group):
    _, u = sorted_eigh(torch.stack([_random_cov(128, s) for s in range(2)]))
    r = compose(u, variant, group)
    assert r.shape == (2, 128, 128)
    assert orthogonality_error(r) < 1e-10


def test_bit_reversal_commutes_with_hadamard():
    _, u = sorted_eigh(_random_cov(128))
    torch.testing.assert_close(compose(u, "U-P-H", 128), compose(u, "U-H-P", 128))


def test_permutation_after_h_changes_nothing_with_one_group_per_head():
    _, u = sorted_eigh(_random_cov(128))
    x = torch.randn(64, 128, dtype=torch.float64) * torch.logspace(1, -1, 128, dtype=torch.float64)
    a = (x @ compose(u, "U-H", 128)).float()
    b = (x @ compose(u, "U-H-P", 128)).float()
    ea = (fake_quantise(a, 128, scale_dtype=F16) - a).pow(2).sum(-1)
    eb = (fake_quantise(b, 128, scale_dtype=F16) - b).pow(2).sum(-1)
    torch.testing.assert_close(ea, eb, rtol=1e-4, atol=1e-6)
    # ... but not with smaller groups
    a32, b32 = (x @ compose(u, "U-Hblock-P", 32)).float(), (x @ compose(u, "U-P-Hblock", 32)).float()
    ea32, eb32 = ((fake_quantise(y, 32, scale_dtype=F16) - y).pow(2).sum() for y in (a32, b32))
    assert not torch.allclose(ea32, eb32)


def test_variant_definitions():
    _, u = sorted_eigh(_random_cov(16))
    h = hadamard_matrix(16)
    torch.testing.assert_close(compose(u, "U-H", 16), u @ h)
    torch.testing.assert_close(compose(u, "U", 16), u)
    torch.testing.assert_close(compose(u, "P-H-Ut", 16), compose(u, "U-H-P", 16).T)
    with pytest.raises(ValueError, match="unknown variant"):
        compose(u, "H-U", 16)
    assert orthogonality_error(hadamard_rotation(3, 16)) < 1e-12
    torch.testing.assert_close(identity_rotation(2, 8), torch.eye(8, dtype=torch.float64).expand(2, 8, 8))


def _outlier_sample(n=512, h=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g)
    spikes = torch.rand(n, h, d, generator=g) < 0.003
    return x + spikes * 25 * torch.sign(torch.randn(n, h, d, generator=g))


def test_clip_none_is_infinite():
    lo, hi, det = search_clip(_outlier_sample(), "none", 64, torch.float16)
    assert torch.isinf(lo).all() and (lo < 0).all() and torch.isinf(hi).all() and (hi > 0).all()
    assert det == {"granularity": "none"}


@pytest.mark.parametrize("granularity", ["layer", "head", "channel"])
def test_clip_search_reduces_error_on_outliers(granularity):
    x = _outlier_sample()
    lo, hi, det = search_clip(x, granularity, 64, torch.float16)
    assert lo.shape == hi.shape == (2, 64) and (lo < hi).all()
    base = quant_error(x, None, None, 64, torch.float16)
    clipped = quant_error(x, lo, hi, 64, torch.float16)
    assert (clipped < 0.8 * base).all()
    assert all(0 < m < 10 for m in det["std_multiple"]) and all(g < 1 for g in det["error_gain"])
    if granularity == "layer":
        assert len(set(det["std_multiple"])) == 1


def test_clip_search_keeps_gaussian_data_mostly_unclipped_or_better():
    x = torch.randn(512, 1, 32, generator=torch.Generator().manual_seed(4))
    lo, hi, det = search_clip(x, "head", 32, torch.float16)
    err = quant_error(x, lo, hi, 32, torch.float16)
    assert err <= quant_error(x, None, None, 32, torch.float16)
    if det["std_multiple"][0] is None:
        assert torch.isinf(lo).all() and torch.isinf(hi).all()
    else:
        assert torch.isfinite(lo).all() and (lo < hi).all()


def test_attn_objective_with_identity_weight_is_mse():
    x = _outlier_sample(seed=5)
    w = torch.eye(64).expand(2, 64, 64)
    a = search_clip(x, "channel", 32, torch.float16)
    b = search_clip(x, "channel", 32, torch.float16, weight=w)
    torch.testing.assert_close(a[0], b[0])
    assert a[2]["std_multiple"] == b[2]["std_multiple"]


def test_quant_error_weight_is_a_quadratic_form():
    x = torch.randn(16, 2, 8)
    w = torch.randn(2, 8, 8)
    w = w @ w.transpose(1, 2)
    err = fake_quantise(x, 8, scale_dtype=F16) - x
    want = torch.einsum("nhd,hde,nhe->h", err.double(), w.double(), err.double())
    torch.testing.assert_close(quant_error(x, None, None, 8, torch.float16, w), want, rtol=1e-4, atol=1e-6)
    assert not math.isnan(float(want.sum()))
