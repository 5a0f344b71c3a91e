"""Helpers shared by the Triton kernels (no sglang).

``INTERPRET`` mirrors ``TRITON_INTERPRET=1`` (CPU tests). Triton 3.6's interpreter
multiplies the raw uint16 bits of bfloat16 operands in ``tl.dot``, so :func:`mma` feeds
it float32 copies there; on a GPU it is a plain ``tl.dot`` (tensor cores for bf16).

:func:`set_interp_tc_bits` (interpreter only, for tests): tensor cores add into their
float32 accumulator with truncation (round toward zero) after aligning the addends, so a
long chain dot(a, b, acc) drifts by about one ulp of acc per step. With n bits set, every
interpreted dot result keeps only n mantissa bits, rounded toward zero: the same drift,
magnified, so that small CPU tests see what only long contexts show on a GPU.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SCALE_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                   torch.float8_e4m3fn: tl.float8e4nv}


INTERP_TC_KEEP = tl.constexpr(-1)  # int32 mask of the bits a dot result keeps (-1: all)


def set_interp_tc_bits(bits: int) -> None:
    """Interpreter only: keep ``bits`` mantissa bits of every dot result (0: exact)."""
    global INTERP_TC_KEEP
    if not 0 <= bits <= 23:
        raise ValueError(f"mantissa bits {bits} not in [0, 23]")
    INTERP_TC_KEEP = tl.constexpr(-(1 << (23 - bits)) if bits else -1)


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b with a float32 accumulator."""
    if INTERP:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        if INTERP_TC_KEEP != -1:
            r = (r.to(tl.int32, bitcast=True) & INTERP_TC_KEEP).to(tl.float32, bitcast=True)
        return r
    else:
        return tl.dot(a, b, acc)


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+): block until the kernel launched before this
    one has finished and its writes are visible (griddepcontrol.wait). A kernel launched
    with ``launch_pdl`` may start while its predecessor still runs, so it must call this
    before reading what the predecessor wrote and before writing what it reads."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependent_grid(PDL: tl.constexpr):
    """Let the next kernel, if launched with ``launch_pdl``, start now (its programs run
    up to their wait_for_prior_grid while this kernel finishes)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def pdl_supported(device) -> bool:
    """Programmatic dependent launch is available: a CUDA device of compute capability 9.0
    or newer, outside the interpreter."""
    device = torch.device(device)
    if INTERPRET or device.type != "cuda":
        return False
    return _capability_major(torch.cuda.current_device() if device.index is None else device.index) >= 9


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@triton.jit
def head_index(h, SLOT64: tl.constexpr):
    """KV head index to multiply by an INT2 buffer's head stride: int64 when offsets may
    pass 2^31 (needs_int64_slots; head-major storage puts the last head near the end)."""
    if SLOT64:
        return h.to(tl.int64)
    else:
        return h


@triton.jit
def to_scale_dtype(x, SCALE_DTYPE: tl.constexpr):
    """x (float32) in the scale dtype. float8_e4m3fn: rounded to nearest-even on 3 mantissa
    bits in float32 first (carry into the exponent included; steps of 2^-9 below 2^-6;
    saturated at 448), so the final cast is exact: the same value as torch's conversion on
    every backend (Triton's interpreter rounds 1.98 to 1.0 in a direct cast)."""
    if SCALE_DTYPE == tl.float8e4nv:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        tiny = tl.floor(x * 512.0 + 0.5) * (1.0 / 512.0)
        y = tl.where(tl.abs(x) < 0.015625, tiny, normal)
        return tl.minimum(tl.maximum(y, -448.0), 448.0).to(SCALE_DTYPE)
    else:
        return x.to(SCALE_DTYPE)


@triton.jit
def sink_slot_of_row(row, req_to_token_ptr, stride_req_to_token_row, sink_slot_of_page_ptr,
                     page_of_sink_slot_ptr, page_size):
    """Sink slot valid for the sequence in ``row`` (-1 if none): the slot c registered for
    the page of position 0, valid while page_of_sink_slot[c] still names that page
    (hybrid_cache.sink_slot_for). ``row`` may be a scalar or a tensor."""
    first = tl.load(req_to_token_ptr + row.to(tl.int64) * stride_req_to_token_row).to(tl.int64)
    page = first // page_size
    c = tl.load(sink_slot_of_page_ptr + page).to(tl.int64)
    owner = tl.load(page_of_sink_slot_ptr + tl.maximum(c, 0)).to(tl.int64)
    return tl.where((c >= 0) & (owner == page), c, -1)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride {t.stride()})")


def check_cache_layout(layer) -> None:
    """The kernels index K and V buffers with one set of strides and unit last strides;
    each token's (scale, min) pairs are contiguous."""
    for name in ("k_packed", "k_scales", "k_sink", "k_ring"):
        kt, vt = getattr(layer, name), getattr(layer, "v" + name[1:])
        if kt.stride() != vt.stride() or kt.dtype != vt.dtype:
            raise ValueError(f"{name} and v{name[1:]} must share strides and dtype")
        if kt.numel() and kt.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if layer.k_scales.numel() and layer.k_scales.stride(2) != 2:
        raise ValueError("k/v_scales must be contiguous in their last two dimensions")
    if layer.k_scales.dtype not in SCALE_TL_DTYPES:
        names = "/".join(str(t).removeprefix("torch.") for t in SCALE_TL_DTYPES)
        raise ValueError(f"the Triton kernels read {names} scales, not {layer.k_scales.dtype}")


def group_scale_args(layer):
    """(k_pairs, v_pairs, stride_slot, stride_head, PAIR) for group_scales: 16-bit scales as one
    int32 (scale, min) pair per token and group, float8 ones as float8_words_view's words, else
    int16 pairs; strides in pair units. float32 scales (or odd strides): elements (PAIR None)."""
    ks, vs = layer.k_scales, layer.v_scales
    pair = {2: torch.int32, 1: torch.int16}.get(ks.element_size())
    if pair is not None and ks.stride(0) % 2 == 0 and ks.stride(1) % 2 == 0:
        kgs, vgs = ks.view(pair), vs.view(pair)
        if pair == torch.int16:
            kw, vw = float8_words_view(ks), float8_words_view(vs)
            if kw is not None and vw is not None:
                kgs, vgs = kw, vw
        return (kgs, vgs, ks.stride(0) // 2, ks.stride(1) // 2, SCALE_TL_DTYPES[ks.dtype])
    return ks, vs, ks.stride(0), ks.stride(1), None


def float8_words_view(scales: torch.Tensor) -> torch.Tensor | None:
    """int32 view of a float8 (scale, min) tensor's storage from its first element: pair i lies
    in word i >> 1, bits 16 (i & 1) up. Triton's pipeliner prefetches 4-byte loads into shared
    memory but leaves 2-byte ones synchronous (one memory latency per block). None when the
    view does not start or the storage does not end on a 4-byte boundary (the last pair's word
    would read past the end): the kernels then read int16 pairs."""
    start = scales.storage_offset() * scales.element_size()
    nbytes = scales.untyped_storage().nbytes()
    base = scales.untyped_storage().data_ptr()
    if start % 4 or nbytes % 4 or base % 4:
        return None
    words = torch.empty(0, dtype=torch.int32, device=scales.device)
    words.set_(scales.untyped_storage(), start // 4, ((nbytes - start) // 4,), (1,))
    return words


def pair_views(layer):
    """(k_pairs, v_pairs, stride_slot, stride_head): the packed codes read as int16 byte
    pairs (triton_hybrid_attn.unpack_pair), strides in int16 units."""
    kp, vp = layer.k_packed, layer.v_packed
    if kp.shape[-1] % 2 or kp.stride(0) % 2 or kp.stride(1) % 2 or kp.storage_offset() % 2 \
            or vp.storage_offset() % 2:
        raise ValueError(f"k/v_packed {tuple(kp.shape)} strides {kp.stride()}: byte pairs must be "
                         "2-byte aligned (head_dim a multiple of 8, even strides)")
    k16, v16 = kp.view(torch.int16), vp.view(torch.int16)
    return k16, v16, k16.stride(0), k16.stride(1)


def scale_args(layer):
    """(k_scales, v_scales, stride_slot, stride_head, stride_group): the (scale, min) tensors
    with their element strides (K and V share them: check_cache_layout)."""
    ks = layer.k_scales
    return (ks, layer.v_scales, *ks.stride()[:3])


def code_args(layer):
    """(k_packed, v_packed, stride_slot, stride_head): the packed INT2 codes as bytes."""
    kp = layer.k_packed
    return (kp, layer.v_packed, kp.stride(0), kp.stride(1))


def bf16_side_args(layer):
    """The BF16 side cache as every kernel takes it: (k_sink, v_sink, stride_sink_slot,
    stride_sink_pos, stride_sink_head, k_ring, v_ring, stride_ring_row, stride_ring_cell,
    stride_ring_head) of the [C, S, H, D] sinks and [R, W, H, D] rings."""
    ks, kr = layer.k_sink, layer.k_ring
    return (ks, layer.v_sink, *ks.stride()[:3], kr, layer.v_ring, *kr.stride()[:3])


def sink_index_args(index, req_to_token: torch.Tensor):
    """(req_to_token, stride_req_to_token_row, sink_slot_of_page, page_of_sink_slot,
    page_size): what sink_slot_of_row reads to find a request's sink slot."""
    return (req_to_token, req_to_token.stride(0), index.sink_slot_of_page, index.page_of_sink_slot,
            index.page_size)


def element_extent(t: torch.Tensor) -> int:
    """One past the largest element offset a view reaches from its first element, in bytes
    (whatever the order of its strides: allocate_layer's buffers are head-major views)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def needs_int64_slots(layer) -> bool:
    """True when an offset into the INT2 buffers may not fit in int32: the kernels then
    compute slot and head offsets in int64 (bounded in bytes: they index these buffers in
    units of 1-4 bytes)."""
    bufs = (layer.k_packed, layer.v_packed, layer.k_scales, layer.v_scales)
    return max(element_extent(t) + t.storage_offset() * t.element_size() for t in bufs) >= 2 ** 31
