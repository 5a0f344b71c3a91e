"""The INT2 keys' logit debias (oscar_kernels.reference module doc): its math, the kernels
against their twin with it on and off, and the simulators agreeing on it."""
import functools
import math
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: the kernel checks here run interpreted (TRITON_INTERPRET=1)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from oscar_kernels import reference as ref  # noqa: E402
from oscar_kernels import testing as kc  # noqa: E402
from oscar_kernels.int2 import dequantise, quantise  # noqa: E402
import kernel_helpers as kh  # noqa: E402

_, _, _, triton_decode_mod, triton_materialize_mod, triton_extend_mod = kh.interpreted_kernel_modules()
_SMALL = dict(max_splits=4, min_chunk=16)


def test_debias_removes_the_rounding_noise_inflation():
    """Over many keys, sum exp(logit) of INT2 keys overshoots the exact keys' by about
    exp(var / 2); subtracting the debias brings the ratio back near 1, for queries of
    several sizes (the inflation grows with |q|^2)."""
    g = torch.Generator().manual_seed(0)
    d, grp, n = 64, 16, 20000
    k = torch.randn(n, 1, d, generator=g)
    codes, scales = quantise(k, grp, torch.float16)
    k_hat = dequantise(codes, scales)
    var = scales[..., 0].float().pow(2)  # [n, 1, NG]
    for size in (0.5, 1.0, 1.5, 2.0, 3.0):
        q = torch.randn(1, 1, d, generator=g)
        q = q / q.norm() * size * math.sqrt(d)
        sm = d ** -0.5
        exact = (q[0, 0] @ k[:, 0].T) * sm
        noisy = (q[0, 0] @ k_hat[:, 0].T) * sm
        bias = ref.key_noise_bias(q, var, sm)[0, 0]
        plain = torch.logsumexp(noisy, 0) - torch.logsumexp(exact, 0)
        debiased = torch.logsumexp(noisy - bias, 0) - torch.logsumexp(exact, 0)
        assert plain > 0.02 * size ** 2  # the inflation the debias targets
        assert abs(debiased) < 0.35 * plain


def test_key_noise_bias_is_half_the_variance_per_group():
    """sm^2 / 24 sum_g scale_g^2 |q_g|^2, GQA-expanded: query head h reads KV head h // (Hq / H)."""
    q = torch.zeros(1, 4, 8)
    q[0, 0, :4] = 1.0  # group 0 of query head 0 (KV head 0): |q_0|^2 = 4
    q[0, 3, 4:] = 2.0  # group 1 of query head 3 (KV head 1): |q_1|^2 = 16
    var = torch.tensor([[[1.0, 5.0], [7.0, 3.0]]])  # [Tk=1, H=2, NG=2]
    b = ref.key_noise_bias(q, var, 0.5)
    assert b.shape == (4, 1, 1)
    assert b[0, 0, 0] == pytest.approx(0.25 / 24 * 4 * 1.0)
    assert b[3, 0, 0] == pytest.approx(0.25 / 24 * 16 * 3.0)
    assert b[1, 0, 0] == 0 and b[2, 0, 0] == 0


@pytest.mark.parametrize("grp", [16, 4])  # a group per plane (dots) and G < D/4 (per-channel dequant)
def test_decode_debias_on_and_off_match_their_twin_and_differ(grp):
    sc = kc.build([1, 13, 140], H=2, D=64, G=grp, S=4, W=8, page=8, seed=grp)
    cfg = triton_decode_mod.DecodeConfig(**_SMALL)
    on = kh.check_decode(sc, 4, triton_decode_mod.triton_decode, cfg, key_debias=True)
    off = kh.check_decode(sc, 4, triton_decode_mod.triton_decode, cfg, key_debias=False)
    # the request with an INT2 history moves; the one that reads only BF16 does not (to rounding:
    # the interpreter's dots round in the CPU's BLAS order, so nothing bitwise here)
    assert (on[2].float() - off[2].float()).abs().max() > 1e-2
    torch.testing.assert_close(on[0].float(), off[0].float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("prefix_read", ["int2", "bf16"])
@pytest.mark.parametrize("debias", [True, False])
def test_extend_debias_matches_its_twin(prefix_read, debias):
    sc = kc.build([0, 5, 13, 90], H=2, D=64, G=16, S=4, W=8, page=8, seed=7, scale_dtype=torch.float8_e4m3fn)
    fn = functools.partial(triton_extend_mod.triton_extend, prefix_lens_host=[0, 5, 13, 90])
    kh.check_extend(sc, 4, [7, 1, 70, 9], fn, prefix_read, key_debias=debias)


def test_materialized_prefix_carries_the_keys_scales():
    """var_out: scale^2 of each key group at the INT2 positions, 0 at sinks and ring
    (reference.hybrid_kv's with_var), request after request."""
    lens = [0, 5, 13, 77]
    sc = kc.build(lens, H=2, D=64, G=16, S=4, W=8, page=8, seed=3, scale_dtype=torch.float8_e4m3fn)
    pre = torch.tensor(lens, dtype=torch.int32)
    var = torch.full((sum(lens), 2, 4), -1.0)
    got = triton_materialize_mod.triton_materialize_prefix(sc.layer, sc.index, sc.req_to_token, sc.rows, pre, lens,
                                                           var_out=var)
    assert len(got) == 3
    want = torch.cat([ref.hybrid_kv(sc.layer, sc.index, sc.req_to_token, int(r), n, with_var=True)[2]
                      for r, n in zip(sc.rows, lens)])
    torch.testing.assert_close(got[2], want)
    assert (want == 0).any() and (want > 0).any()
    with pytest.raises(ValueError, match="var_out"):
        triton_materialize_mod.triton_materialize_prefix(sc.layer, sc.index, sc.req_to_token, sc.rows, pre, lens,
                                                         var_out=torch.empty(sum(lens), 2, 3))
