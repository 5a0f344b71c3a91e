"""INT2 quantiser candidates for the fake-quantisation simulator (issue 29, section 1).

Every candidate stores 2-bit codes and a uniform (scale, min), dequantised as
``min + code * scale``; ``per-channel-keys`` moves the keys' (scale, min) from per token to per
page.

- ``minmax`` (the server's default, :func:`oscar_kernels.int2.fake_quantise`): per token and
  group, ``min`` = the group's minimum, ``scale`` = (max - min) / 3, nearest code.
- ``per-channel-keys``: keys quantised per channel over a page of ``PAGE_TOKENS`` tokens
  (KIVI's choice): one (scale, min) per channel per page from the page's INT2 tokens (its
  sink positions are BF16 and left out), nearest code; values as ``minmax``. A page is
  quantised once complete, so the decode loop carries no per-token key scale.

All functions work in the rotated space (after clip) on float32 and return float32.
"""
from __future__ import annotations

import torch

from oscar_kernels.contract.layout import SCALE_DTYPE_BYTES, packed_dim
from oscar_kernels.int2 import LEVELS

QUANTIZERS = ("minmax", "per-channel-keys")
DEFAULT_QUANTIZER = "minmax"
PAGE_TOKENS = 64  # per-channel-keys: tokens sharing one (scale, min) per channel (the pool's page)


def check_quantizer(name: str) -> str:
    if name not in QUANTIZERS:
        raise ValueError(f"unknown quantizer {name!r} (choose from {', '.join(QUANTIZERS)})")
    return name


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
