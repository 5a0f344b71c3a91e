"""Numerics contracts: transforms, the INT2 layout, INT2 quantisation/packing, and the
reference read rule."""
import inspect
import math

import pytest
import torch

from calibration import transforms as tf
from oscar_kernels import int2, reference as ref
from oscar_kernels.contract import layout
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.rotations_file import orthogonality_error
from oscar_kernels.hybrid_cache import allocate_index, allocate_layer, assign_sink_slots, sink_slot_for


# ---------------------------------------------------------------- transforms
@pytest.mark.parametrize("n", [1, 2, 4, 16, 128])
def test_hadamard_orthogonal_symmetric_involution(n):
    h = tf.hadamard_matrix(n)
    assert orthogonality_error(h) < 1e-12
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64))


@pytest.mark.parametrize("n", [2, 8, 64])
def test_hadamard_sylvester_recursion(n):
    half = tf.hadamard_matrix(n // 2) * math.sqrt(n // 2)
    full = tf.hadamard_matrix(n) * math.sqrt(n)
    expected = torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0)
    assert torch.allclose(full, expected, atol=1e-12)
    assert float(full[0, 0]) == pytest.approx(1.0) and float(full[-1, -1]) == pytest.approx((-1.0) ** (n.bit_length() - 1))


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        tf.hadamard_matrix(12)


def test_block_hadamard_structure():
    b = tf.block_hadamard_matrix(16, 4)
    assert orthogonality_error(b) < 1e-12
    h4 = tf.hadamard_matrix(4)
    for i in range(4):
        for j in range(4):
            blk = b[4 * i:4 * i + 4, 4 * j:4 * j + 4]
            assert torch.allclose(blk, h4 if i == j else torch.zeros_like(h4))
    with pytest.raises(ValueError):
        tf.block_hadamard_matrix(16, 3)
    with pytest.raises(ValueError):
        tf.block_hadamard_matrix(8, 16)


def test_bit_reversal_values_and_involution():
    assert tf.bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    for n in (1, 2, 16, 128):
        p = tf.bit_reversal_permutation(n)
        assert torch.equal(p[p], torch.arange(n))
        assert sorted(p.tolist()) == list(range(n))


def test_permutation_matrix_form():
    perm = tf.bit_reversal_permutation(16)
    p = tf.permutation_matrix(perm)
    x = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(x @ p, x[:, perm])
    assert orthogonality_error(p) == 0.0
    assert torch.equal(p, p.T)  # an involution's permutation matrix is symmetric


# ---------------------------------------------------------------- INT2 packing
def test_pack_bit_layout_hand_made():
    # D = 8: two bytes per token; byte j bits 2i..2i+1 hold channel i*2 + j.
    codes = torch.tensor([[1, 2, 3, 0, 0, 1, 2, 3]], dtype=torch.uint8)
    # byte 0: channels 0,2,4,6 = 1,3,0,2 -> 1 | 3<<2 | 0<<4 | 2<<6 = 1+12+0+128 = 141
    # byte 1: channels 1,3,5,7 = 2,0,1,3 -> 2 | 0 | 1<<4 | 3<<6 = 2+16+192 = 210
    assert int2.pack(codes).tolist() == [[141, 210]]
    assert torch.equal(int2.unpack(torch.tensor([[141, 210]], dtype=torch.uint8)), codes)


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 4, (5, 3, 128), generator=g, dtype=torch.uint8)
    packed = int2.pack(codes)
    assert packed.shape == (5, 3, 32) and packed.dtype == torch.uint8
    assert torch.equal(int2.unpack(packed), codes)
    with pytest.raises(ValueError):
        int2.packed_dim(6)


# ---------------------------------------------------------------- the INT2 layout
def test_default_layout():
    assert KVLayout.resolve(128) == KVLayout(32, 128, "float8_e4m3fn")
    assert KVLayout.resolve(64) == KVLayout(16, 64, "float8_e4m3fn")
    assert KVLayout.resolve(256) == KVLayout(64, 128, "float8_e4m3fn")
    assert KVLayout.resolve(128).bytes_per_token_per_head(128) == 74  # 64 B codes + 5 groups x 2 x 1 B


def test_layout_resolve_fills_only_what_is_open():
    assert KVLayout.resolve(128, 64) == KVLayout(64, 64, "float8_e4m3fn")  # a key group alone: both
    assert KVLayout.resolve(128, None, 64) == KVLayout(32, 64, "float8_e4m3fn")
    assert KVLayout.resolve(128, 16, 128, "float16") == KVLayout(16, 128, "float16")


def test_layout_bytes_and_checks():
    # codes 2 * D/4, plus (scale, min) per key group and per value group
    assert KVLayout(128, 128, "float16").bytes_per_token_per_head(128) == 64 + 2 * 2 * 2
    assert KVLayout(32, 64, "float32").bytes_per_token_per_head(128) == 64 + (4 + 2) * 2 * 4
    assert KVLayout(16, 32, "bfloat16").check(64) == KVLayout(16, 32, "bfloat16")
    with pytest.raises(ValueError, match="^group size 24 must be a power of two dividing head_dim 128$"):
        KVLayout(24, 128, "float16").check(128)
    with pytest.raises(ValueError, match="^value group size 256 must be"):
        KVLayout(32, 256, "float16").bytes_per_token_per_head(128)
    with pytest.raises(ValueError, match="unknown scale dtype 'int8'"):
        KVLayout(32, 128, "int8").check(128)
    assert [KVLayout(8, 8, n).torch_scale_dtype for n in layout.SCALE_DTYPES] == [
        torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
    assert all(torch.empty((), dtype=layout.torch_scale_dtype(n)).element_size() == b
               for n, b in layout.SCALE_DTYPE_BYTES.items())


def test_layout_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from oscar_kernels.contract.layout import KVLayout; "
            "KVLayout.resolve(128).bytes_per_token_per_head(128); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # benchmarks' --help and the byte arithmetic stay torch-free


@pytest.mark.parametrize("fn", [int2.quantise, int2.quantise_rotated, int2.fake_quantise, allocate_layer])
def test_numerics_default_to_the_layout_scale_dtype(fn):
    default = inspect.signature(fn).parameters["scale_dtype"].default
    assert default == KVLayout.resolve(128).torch_scale_dtype


# ---------------------------------------------------------------- quantisation
@pytest.mark.parametrize("group", [4, 32, 128])
@pytest.mark.parametrize("sdt", [torch.float16, torch.float32])
def test_quantise_error_bound(group, sdt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 128, generator=g) * 3
    codes, scales = int2.quantise(x, group, sdt)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 3
    assert scales.shape == (64, 4, 128 // group, 2) and scales.dtype == sdt
    xh = int2.dequantise(codes, scales)
    scale = scales[..., 0].float().repeat_interleave(group, -1)
    # |x - x^| <= scale/2, plus the rounding of (scale, min) to the scale dtype
    slack = 4e-3 * x.abs().amax() if sdt == torch.float16 else 1e-5
    assert bool(((x - xh).abs() <= scale / 2 + slack).all())


def test_quantise_constant_group_and_exact_levels():
    x = torch.full((2, 8), 0.75)
    codes, scales = int2.quantise(x, 4)
    assert int(codes.max()) == 0 and bool((scales[..., 0] == 0).all())
    assert torch.equal(int2.dequantise(codes, scales), x)
    lv = torch.tensor([[-1.0, 0.0, 1.0, 2.0]])  # four exact levels: reproduced exactly
    codes, scales = int2.quantise(lv, 4)
    assert codes.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(int2.dequantise(codes, scales), lv)


def test_check_group_size_errors():
    with pytest.raises(ValueError):
        layout.check_group_size(128, 24)
    with pytest.raises(ValueError):
        layout.check_group_size(64, 128)


def test_clip_behaviour():
    x = torch.tensor([[-5.0, -0.5, 0.5, 5.0]])
    lo = torch.tensor([-1.0, -float("inf"), -1.0, -1.0])
    hi = torch.tensor([1.0, 1.0, float("inf"), 2.0])
    assert int2.clip(x, lo, hi).tolist() == [[-1.0, -0.5, 0.5, 2.0]]
    assert torch.equal(int2.clip(x, None, None), x)
    # clipping bounds the quantisation range of an outlier group
    y = torch.tensor([[0.0, 0.1, 0.2, 100.0]])
    plain = int2.fake_quantise(y, 4)
    clipped = int2.fake_quantise(y, 4, torch.full((4,), -1.0), torch.full((4,), 0.3))
    assert (clipped[0, :3] - y[0, :3]).abs().max() < (plain[0, :3] - y[0, :3]).abs().max()


# ---------------------------------------------------------------- reference read rule
def _tiny_cache(S=2, W=3, page=4, H=1, D=8, rows=2, num_slots=32):
    layer = allocate_layer(num_slots, H, D, D, S, W, num_sink_slots=2, num_rows=rows)
    index = allocate_index(num_slots, page, num_sink_slots=2, num_rows=rows)
    return layer, index


def _fill_markers(layer, slots):
    """INT2 at slot s dequantises to the constant s (scale 0, min s): a slot marker."""
    layer.k_scales[slots, :, :, 0] = 0
    layer.k_scales[slots, :, :, 1] = slots.to(layer.k_scales.dtype).view(-1, 1, 1)
    layer.v_scales.copy_(layer.k_scales)


def test_reference_read_rule_hand_built():
    layer, index = _tiny_cache()
    req_to_token = torch.zeros(2, 16, dtype=torch.int32)
    req_to_token[0, :10] = torch.arange(8, 18)  # starts at page 2
    slots = torch.arange(32)
    _fill_markers(layer, slots)
    assign_sink_slots(index, torch.tensor([8]), 2)
    c = int(sink_slot_for(index, torch.tensor([8]))[0])
    assert c >= 0
    layer.k_sink[c, :, 0, :] = torch.tensor([[-1.0], [-2.0]])
    layer.k_ring[0, :, 0, :] = torch.tensor([[100.0], [101.0], [102.0]])  # cell = pos % 3
    index.ring_valid_from[0] = 0
    k, _ = ref.hybrid_kv(layer, index, req_to_token, 0, 10)
    # n=10, S=2, W=3: pos 0,1 sink; 2..6 INT2 (slot = 8 + pos); 7,8,9 ring cells 1,2,0
    assert k[:, 0, 0].tolist() == [-1, -2, 10, 11, 12, 13, 14, 101, 102, 100]
    # ring valid only from 9 (request started there after a prefix hit)
    index.ring_valid_from[0] = 9
    k, _ = ref.hybrid_kv(layer, index, req_to_token, 0, 10)
    assert k[:, 0, 0].tolist() == [-1, -2, 10, 11, 12, 13, 14, 15, 16, 100]
    # evicted sink: the slot now belongs to another page -> INT2
    assign_sink_slots(index, torch.tensor([0, 20]), 2)
    assert int(sink_slot_for(index, torch.tensor([8]))[0]) == -1
    k, _ = ref.hybrid_kv(layer, index, req_to_token, 0, 10)
    assert k[:2, 0, 0].tolist() == [8, 9]


@pytest.mark.parametrize("shift", [0.0, 1.0])
def test_reference_decode_equals_exact_attention_in_bf16_windows(shift):
    """With n <= S + W every key/value is BF16: decode is exact attention on rotated q, k, v,
    with or without a key shift (every logit of a query moves by the same -q'.shift)."""
    torch.manual_seed(0)
    S, W, H, Hq, D, page = 4, 12, 2, 4, 16, 4
    layer = allocate_layer(64, H, D, 4, S, W, num_sink_slots=2, num_rows=2)
    index = allocate_index(64, page, num_sink_slots=2, num_rows=2)
    rot = torch.linalg.qr(torch.randn(H, D, D))[0]
    from oscar_kernels.hybrid_cache import LayerRotation
    inf = torch.full((H, D), float("inf"))
    rotation = LayerRotation(rot, rot.flip(-1), -inf, inf, -inf, inf, k_shift=shift * torch.randn(H, D))
    n = 14
    req_to_token = torch.zeros(2, 32, dtype=torch.int32)
    req_to_token[1, :n] = torch.arange(16, 16 + n)
    assign_sink_slots(index, req_to_token[1, :1], 2)
    k = torch.randn(n, H, D).bfloat16()
    v = torch.randn(n, H, D).bfloat16()
    pos = torch.arange(n)
    ref.reference_store(layer, index, rotation, req_to_token, k, v, req_to_token[1, :n], pos,
                        torch.full((n,), 1), torch.full((n,), n))
    q = torch.randn(1, Hq, D)
    q_rot = ref.rotate(q, ref.expand_gqa(rotation.k_rot, Hq))
    o_rot = ref.reference_decode(q_rot, layer, index, req_to_token, torch.tensor([1]), torch.tensor([n]), 0.25)
    o = ref.rotate(o_rot, ref.expand_gqa(rotation.v_rot, Hq).transpose(-1, -2))
    kk = ref.expand_gqa(k.float().transpose(0, 1), Hq)
    vv = ref.expand_gqa(v.float().transpose(0, 1), Hq)
    p = torch.softmax(torch.einsum("hd,hkd->hk", q[0], kk) * 0.25, -1)
    exact = torch.einsum("hk,hkd->hd", p, vv)
    assert torch.allclose(o[0], exact, atol=2e-2, rtol=2e-2)  # only the bf16 rounding of k', v'


def test_quantise_float8_scales_error_bound():
    """float8_e4m3fn (scale, min) (reference only): round to nearest with 3 mantissa bits
    moves min and scale by at most 1/16 of themselves, on top of half a step."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4, 128, generator=g) * 3
    codes, scales = int2.quantise(x, 64, torch.float8_e4m3fn)
    assert scales.dtype == torch.float8_e4m3fn and int(codes.max()) <= 3
    xh = int2.dequantise(codes, scales)
    xg = x.reshape(64, 4, 2, 64)
    lo, step = xg.amin(-1), (xg.amax(-1) - xg.amin(-1)) / 3
    bound = step / 2 + lo.abs() / 16 + 3 * step / 16 + 1e-6
    assert bool(((xg - xh.reshape(64, 4, 2, 64)).abs() <= bound.unsqueeze(-1)).all())
    assert KVLayout(64, 64, "float8_e4m3fn").bytes_per_token_per_head(128) == KVLayout(
        128, 128, "float16").bytes_per_token_per_head(128)  # groups of 64 in float8 cost what groups of 128 in float16 do


def test_key_shift_removes_a_common_key_offset_from_the_int2_error():
    """Keys with a large common offset (as real models' keys have): quantising k' - mean and
    adding the mean back errs far less than quantising k' (the offset no longer sets each
    group's range), and quantise_rotated returns the shifted keys it quantised."""
    from oscar_kernels.int2 import dequantise, quantise_rotated, unpack

    torch.manual_seed(0)
    t, h, d, g = 256, 2, 64, 16
    offset = 4.0 * torch.randn(h, d)
    k = torch.randn(t, h, d) + offset
    eye = torch.eye(d).expand(h, d, d)
    errs = {}
    for name, shift in (("none", None), ("mean", k.mean(0))):
        k_rot, packed, scales = quantise_rotated(k, eye, None, None, g, torch.float32, shift)
        assert torch.allclose(k_rot, k - (0 if shift is None else shift))
        k_hat = dequantise(unpack(packed), scales) + (0 if shift is None else shift)
        errs[name] = float((k_hat - k).pow(2).mean())
    assert errs["mean"] < 0.3 * errs["none"], errs


def test_learned_sink_joins_the_softmax_as_a_valueless_column():
    """The reference's sink term (gpt-oss) against its closed form o * sigmoid(lse - sink), per
    query head; a sink of -inf changes nothing."""
    from oscar_kernels.reference import _attend

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 16, generator=g), torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    sinks = torch.tensor([-1.0, 0.5, 3.0, 8.0])
    plain = _attend(q, k, v, 0.25)
    kq = k.repeat_interleave(2, dim=1)  # GQA: query head h reads KV head h // 2
    lse = torch.logsumexp(torch.einsum("qhd,khd->qhk", q, kq) * 0.25, dim=-1)  # [3, 4]
    want = plain * torch.sigmoid(lse - sinks)[..., None]
    torch.testing.assert_close(_attend(q, k, v, 0.25, sinks=sinks), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_attend(q, k, v, 0.25, sinks=torch.full((4,), float("-inf"))), plain)
