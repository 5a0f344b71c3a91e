"""INT2 numerics of the KV cache: the exact reference every kernel reproduces.

Per token and per KV head, a rotated vector x' (head_dim D) is
  1. clipped per channel:   x_c = clamp(x', clip_min[c], clip_max[c])
  2. split into D/G channel groups of G consecutive channels (group g = channels
     [g*G, (g+1)*G)) and quantised asymmetrically, 4 levels per group:
        lo    = cast(min_g x_c)                 (stored as "min", scale dtype)
        scale = cast((max_g x_c - min_g x_c) / 3)  (stored as "scale")
        code  = clamp(floor((x_c - lo) / scale + 1/2), 0, 3)   (code = 0 if scale == 0)
     dequantised value:  x^ = lo + code * scale  (float32 arithmetic)
  3. packed four codes per byte, **plane-major** (the layout the kernels depend on):
        byte[j] bits 2i..2i+1  =  code of channel  i * D/4 + j     (i = 0..3, j < D/4)
     so unpacking a [.., D/4] byte tile with shift 2i yields channels [i*D/4, (i+1)*D/4)
     as one contiguous "plane": kernels compute q.k as a sum of four D/4-wide dot
     products and P@V as four D/4-wide outputs, with no interleaving in registers.

Scales are stored as ``[..., D/G, 2]`` in the scale dtype (the layout's, see
:mod:`oscar_kernels.contract.layout`; float8_e4m3fn by default):
``[..., g, 0] = scale``, ``[..., g, 1] = min``. scale and min are cast to the scale
dtype *before* codes are computed, so stored (scale, min) and codes agree exactly.
"""
from __future__ import annotations

import torch

from .contract.layout import (CODES_PER_BYTE, DEFAULT_SCALE_DTYPE, check_group_size, packed_dim,
                              torch_scale_dtype)

LEVELS = 4  # 2 bits
DEFAULT_TORCH_SCALE_DTYPE = torch_scale_dtype(DEFAULT_SCALE_DTYPE)  # the layout's default, as a torch dtype


def clip(x: torch.Tensor, clip_min: torch.Tensor | None, clip_max: torch.Tensor | None) -> torch.Tensor:
    """Per-channel clamp; ``clip_*`` broadcast against x (e.g. [H, D] for x [T, H, D])."""
    if clip_min is not None:
        x = torch.maximum(x, clip_min.to(x.dtype))
    if clip_max is not None:
        x = torch.minimum(x, clip_max.to(x.dtype))
    return x


def quantise(x: torch.Tensor, group_size: int, scale_dtype: torch.dtype = DEFAULT_TORCH_SCALE_DTYPE):
    """x [..., D] -> (codes uint8 [..., D] in 0..3, scales [..., D/G, 2] scale_dtype)."""
    d = x.shape[-1]
    check_group_size(d, group_size)
    codes, scale_q, lo_q = minmax_codes(x.float().reshape(*x.shape[:-1], d // group_size, group_size), scale_dtype)
    return codes.to(torch.uint8).reshape(x.shape), torch.stack([scale_q, lo_q], dim=-1)


def minmax_codes(xg: torch.Tensor, scale_dtype: torch.dtype):
    """The min/max rule on groups along the last dim of xg [..., G] (float32): scale = (max - min)
    / 3 and min, both cast to ``scale_dtype`` before the codes, code = clamp(floor((x - min) /
    scale + 1/2), 0, 3) (0 where scale = 0) -> (codes float32 [..., G], scale_q [...], lo_q [...])."""
    lo = xg.amin(-1)
    scale_q = ((xg.amax(-1) - lo) / (LEVELS - 1)).to(scale_dtype)
    lo_q = lo.to(scale_dtype)
    scale_f = scale_q.float().unsqueeze(-1)
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    codes = torch.floor((xg - lo_q.float().unsqueeze(-1)) / safe + 0.5).clamp_(0, LEVELS - 1)
    return torch.where(scale_f > 0, codes, torch.zeros_like(codes)), scale_q, lo_q


def dequantise(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., D], scales [..., D/G, 2] -> float32 [..., D] = min + code * scale."""
    d = codes.shape[-1]
    n_groups = scales.shape[-2]
    cg = codes.float().reshape(*codes.shape[:-1], n_groups, d // n_groups)
    scale = scales[..., 0].float().unsqueeze(-1)
    lo = scales[..., 1].float().unsqueeze(-1)
    return (lo + cg * scale).reshape(codes.shape)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., D] (0..3) -> uint8 [..., D/4], plane-major (see module doc)."""
    q = packed_dim(codes.shape[-1])
    c = codes.to(torch.uint8)
    out = torch.zeros(*codes.shape[:-1], q, dtype=torch.uint8, device=codes.device)
    for i in range(CODES_PER_BYTE):
        out |= c[..., i * q:(i + 1) * q] << (2 * i)
    return out


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/4] -> uint8 codes [..., D], inverse of :func:`pack`."""
    planes = [(packed >> (2 * i)) & 3 for i in range(CODES_PER_BYTE)]
    return torch.cat(planes, dim=-1)


def quantise_rotated(
    x: torch.Tensor,
    rotation: torch.Tensor,
    clip_min: torch.Tensor | None,
    clip_max: torch.Tensor | None,
    group_size: int,
    scale_dtype: torch.dtype = DEFAULT_TORCH_SCALE_DTYPE,
    shift: torch.Tensor | None = None,
):
    """The whole write path for one of K/V: x [T, H, D] (unrotated), rotation [H, D, D],
    clip_* [H, D], shift [H, D] (subtracted after the rotation; None: none) -> (x_rot float32
    [T, H, D] (shifted, unclipped, for the BF16 side copies), packed uint8 [T, H, D/4], scales
    [T, H, D/G, 2])."""
    x_rot = torch.einsum("thd,hde->the", x.float(), rotation.float())
    if shift is not None:
        x_rot = x_rot - shift.float()
    codes, scales = quantise(clip(x_rot, clip_min, clip_max), group_size, scale_dtype)
    return x_rot, pack(codes), scales


def fake_quantise(x: torch.Tensor, group_size: int, clip_min=None, clip_max=None,
                  scale_dtype: torch.dtype = DEFAULT_TORCH_SCALE_DTYPE) -> torch.Tensor:
    """clip -> quantise -> dequantise, float32, same shape as x (for simulation)."""
    codes, scales = quantise(clip(x.float(), clip_min, clip_max), group_size, scale_dtype)
    return dequantise(codes, scales)
