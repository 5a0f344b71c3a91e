"""INT2 quantiser candidates for the fake-quantisation simulator (issue 29, section 1).

Every candidate stores what today's layout stores -- 2-bit codes and a uniform (scale, min)
per group, dequantised as ``min + code * scale`` -- so the decode kernels would read it
unchanged (``per-channel-keys`` moves the keys' (scale, min) from per token to per page):

- ``minmax`` (the server's default, :func:`oscar_kernels.int2.fake_quantise`): per token and
  group, ``min`` = the group's minimum, ``scale`` = (max - min) / 3, nearest code.
- ``lloyd-max``: per token and group, standardise by the mean and standard deviation; the
  stored grid is centred on the mean with its outer levels at +-``span`` sigma (``scale`` =
  2 span sigma / 3, ``min`` = mean - span sigma); codes are chosen with the Gaussian
  Lloyd-Max decision thresholds, 0 and +-0.9816 sigma about the grid's centre (sigma as the
  stored scale implies it). The Gaussian Lloyd-Max levels (+-0.4528, +-1.510 sigma) are not
  uniform: ``span`` says which uniform grid stands in for them (tuned on calibration data).
- ``per-channel-keys``: keys quantised per channel over a page of ``PAGE_TOKENS`` tokens
  (KIVI's choice): one (scale, min) per channel per page from the page's INT2 tokens (its
  sink positions are BF16 and left out), nearest code; values as ``minmax``. A page is
  quantised once complete, so the decode loop carries no per-token key scale.

All functions work in the rotated space (after clip) on float32 and return float32.
"""
from __future__ import annotations

import torch

from oscar_kernels.contract.layout import SCALE_DTYPE_BYTES, check_group_size, packed_dim
from oscar_kernels.int2 import LEVELS, dequantise, fake_quantise

QUANTIZERS = ("minmax", "lloyd-max", "per-channel-keys")
DEFAULT_QUANTIZER = "minmax"
LLOYD_MAX_THRESHOLD = 0.9816  # Gaussian 4-level Lloyd-Max decision thresholds: 0, +-0.9816 sigma
LLOYD_MAX_LEVELS = (0.4528, 1.5104)  # its reconstruction levels (+- sigma)
UPSTREAM_SPAN = round(1.16 * LLOYD_MAX_LEVELS[1], 4)  # the public upstream's span: 1.16 x the outer level
PAGE_TOKENS = 64  # per-channel-keys: tokens sharing one (scale, min) per channel (the pool's page)


def check_quantizer(name: str) -> str:
    if name not in QUANTIZERS:
        raise ValueError(f"unknown quantizer {name!r} (choose from {', '.join(QUANTIZERS)})")
    return name


def lloyd_max_quantise(x: torch.Tensor, group_size: int, span: float, scale_dtype: torch.dtype):
    """x [..., D] -> (codes uint8 [..., D], scales [..., D/G, 2] (scale, min)) in the stored format
    of :mod:`oscar_kernels.int2`, chosen by the Lloyd-Max rule with outer levels at +-span sigma."""
    if not span > 0:
        raise ValueError(f"lloyd-max span must be > 0 (in sigma), got {span}")
    d = x.shape[-1]
    check_group_size(d, group_size)
    xg = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    mu = xg.mean(-1)
    sigma = xg.std(-1, unbiased=False)
    scale_q = (2.0 * span * sigma / (LEVELS - 1)).to(scale_dtype)
    lo_q = (mu - span * sigma).to(scale_dtype)
    scale_f = scale_q.float().unsqueeze(-1)
    lo_f = lo_q.float().unsqueeze(-1)
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    # position about the stored grid's centre, in the stored scale; thresholds 0, +-r where
    # r * scale = 0.9816 sigma (sigma = 3 scale / (2 span))
    u = (xg - lo_f) / safe - (LEVELS - 1) / 2
    r = LLOYD_MAX_THRESHOLD * (LEVELS - 1) / (2.0 * span)
    codes = (u >= -r).to(torch.uint8) + (u >= 0).to(torch.uint8) + (u >= r).to(torch.uint8)
    codes = torch.where(scale_f > 0, codes, torch.zeros_like(codes))
    return codes.reshape(x.shape), torch.stack([scale_q, lo_q], dim=-1)


def fake_lloyd_max(x: torch.Tensor, group_size: int, span: float, scale_dtype: torch.dtype) -> torch.Tensor:
    """quantise (lloyd-max) -> dequantise with the kernels' rule, float32, x's shape."""
    codes, scales = lloyd_max_quantise(x, group_size, span, scale_dtype)
    return dequantise(codes, scales)


def fake_per_channel(x: torch.Tensor, scale_dtype: torch.dtype, exact: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., P, D]: one (scale, min) per channel over the P tokens (dim -2), nearest code,
    dequantised, float32. ``exact`` [P] bool: tokens left out of the statistics (BF16 sinks; their
    reconstruction is never read)."""
    xf = x.float()
    if exact is not None and bool(exact.all()):
        return xf.clone()
    if exact is not None and bool(exact.any()):
        keep = (~exact).view(-1, 1)
        lo = torch.where(keep, xf, torch.full_like(xf, float("inf"))).amin(-2, keepdim=True)
        hi = torch.where(keep, xf, torch.full_like(xf, float("-inf"))).amax(-2, keepdim=True)
    else:
        lo, hi = xf.amin(-2, keepdim=True), xf.amax(-2, keepdim=True)
    scale = ((hi - lo) / (LEVELS - 1)).to(scale_dtype).float()
    lo = lo.to(scale_dtype).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.floor((xf - lo) / safe + 0.5).clamp_(0, LEVELS - 1)
    codes = torch.where(scale > 0, codes, torch.zeros_like(codes))
    return lo + codes * scale


def fake_tokens(x: torch.Tensor, quantizer: str, group_size: int, scale_dtype: torch.dtype,
                span: float | None = None) -> torch.Tensor:
    """Per-token candidates on x [..., D] (already clipped): minmax or lloyd-max."""
    if quantizer == "lloyd-max":
        return fake_lloyd_max(x, group_size, span, scale_dtype)
    return fake_quantise(x, group_size, None, None, scale_dtype)


def bytes_per_token_per_head(quantizer: str, head_dim: int, key_group_size: int, value_group_size: int,
                             scale_dtype: str, page_tokens: int = PAGE_TOKENS) -> dict:
    """INT2 bytes one token costs per KV head under ``quantizer``: codes, the keys' and the values'
    (scale, min), their sum ("total"). Per-channel keys: 2 scale elements per channel per page,
    amortised over ``page_tokens``."""
    check_quantizer(quantizer)
    el = SCALE_DTYPE_BYTES[scale_dtype]
    codes = 2 * packed_dim(head_dim)
    if quantizer == "per-channel-keys":
        key_scales = 2 * head_dim * el / page_tokens
    else:
        key_scales = 2 * el * head_dim // key_group_size
    value_scales = 2 * el * head_dim // value_group_size
    return {"codes": codes, "key_scales": key_scales, "value_scales": value_scales,
            "total": codes + key_scales + value_scales}


def relative_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """||x_hat - x||^2 / ||x||^2 (0 for an all-zero x reconstructed exactly)."""
    num = (x_hat.float() - x.float()).pow(2).sum().item()
    den = x.float().pow(2).sum().item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def span_curve(layers: list[torch.Tensor], group_size: int, spans, scale_dtype: torch.dtype) -> list[float]:
    """Mean over ``layers`` (rotated, clipped [..., D] tensors) of lloyd-max's relative MSE, per span:
    the objective the span is tuned on (calibration data only)."""
    return [sum(relative_mse(x, fake_lloyd_max(x, group_size, s, scale_dtype)) for x in layers) / len(layers)
            for s in spans]


def attention_reference(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        sink: int, recent: int, scale: float) -> tuple:
    """(logits, probabilities, output, INT2 mask) of exact attention for attention_out_error: query
    i at q_pos[i] reads key j from INT2 when sink <= j <= q_pos[i] - recent (outside the BF16 sink
    and ring); causal. q [N, D] (its query heads' rows), k/v [T, D]."""
    j = torch.arange(k.shape[0]).view(1, -1)
    i = q_pos.view(-1, 1)
    causal = j <= i
    logits = ((q @ k.T) * scale).masked_fill(~causal, float("-inf"))
    p = torch.softmax(logits, -1)
    return logits, p, p @ v, (j >= sink) & (j <= i - recent) & causal


def attention_out_error(q: torch.Tensor, ref: tuple, v: torch.Tensor, k_hat: torch.Tensor | None,
                        v_hat: torch.Tensor | None, scale: float) -> tuple[float, float]:
    """(||O^ - O||^2, ||O||^2) of one KV head's attention outputs when the INT2 positions of
    ``ref`` (attention_reference) read k_hat / v_hat (None: exact): the objective a span is tuned
    on when what counts is the attention output rather than the reconstruction."""
    logits, p, o, int2 = ref
    p_hat = torch.softmax(torch.where(int2, (q @ k_hat.T) * scale, logits), -1) if k_hat is not None else p
    o_hat = p_hat @ v if v_hat is None else p_hat @ v + (p_hat * int2) @ (v_hat - v)
    return (o_hat - o).pow(2).sum().item(), o.pow(2).sum().item()
