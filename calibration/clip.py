"""Clip thresholds for the rotated K/V, searched under the exact INT2 quantiser.

Given a sample of rotated activations ``x`` [N, H, D] (N tokens, H KV heads), a clip is a
per-channel interval ``[center - a * half, center + a * half]`` where (center, half) is the
midpoint / half-width of the sample's range over the *granularity*:

- ``layer``:   one range over all heads and channels of the layer, one ratio ``a`` per layer;
- ``head``:    one range per KV head (over its channels), one ratio per head;
- ``channel``: one range per (head, channel), one ratio per head shared by its channels;
- ``none``:    no clip (-inf, +inf).

The ratio ``a`` is chosen by a two-level grid search (coarse grid, then a fine grid around
the best coarse ratio) to minimise the quantisation error of
:func:`oscar_kernels.int2.fake_quantise` (clip -> per-token per-group INT2 -> dequantise)
measured against the *unclipped* x:

- objective ``mse``:  sum_n ||x_n - Q(x_n)||^2
- objective ``attn``: sum_n (x_n - Q(x_n)) W (x_n - Q(x_n))^T with a per-head weight W [D, D]
  in the rotated space: for keys W = R^T C_Q R (the expected squared logit error q . dk
  over calibration queries), for values W = R^T (sum_j W_O,j^T W_O,j) R (the squared error
  the value error causes after o_proj, j over the query heads of the KV head).

If the best ratio is 1 (the full sample range) nothing is clipped for that head/layer and
the thresholds are stored as -inf/+inf, so values beyond the calibration range still widen
the quantisation range instead of being cut.
"""
from __future__ import annotations

import math

import torch

from oscar_kernels.int2 import fake_quantise

GRANULARITIES = ("none", "layer", "head", "channel")
OBJECTIVES = ("mse", "attn")
COARSE_RATIOS = tuple(round(0.30 + 0.1 * i, 2) for i in range(8))  # 0.3 .. 1.0
FINE_STEPS = (-0.075, -0.05, -0.025, 0.025, 0.05, 0.075)


def _ranges(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(center, half) broadcastable to [H, D] for the sample x [N, H, D]."""
    h, d = x.shape[1:]
    if granularity == "layer":
        lo, hi = x.amin(), x.amax()
    elif granularity == "head":
        lo, hi = x.amin(dim=(0, 2)).unsqueeze(-1), x.amax(dim=(0, 2)).unsqueeze(-1)
    elif granularity == "channel":
        lo, hi = x.amin(dim=0), x.amax(dim=0)
    else:
        raise ValueError(f"unknown clip granularity {granularity!r} (choose from {', '.join(GRANULARITIES)})")
    center, half = ((hi + lo) / 2).expand(h, d), ((hi - lo) / 2).expand(h, d)
    return center, half


def quant_error(x: torch.Tensor, clip_min, clip_max, group_size: int, scale_dtype: torch.dtype,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head summed error [H] of fake-quantising x [N, H, D] with the given clip."""
    err = (fake_quantise(x, group_size, clip_min, clip_max, scale_dtype) - x).transpose(0, 1)  # [H, N, D]
    if weight is None:
        return err.pow(2).sum(dim=(1, 2), dtype=torch.float64)
    return (torch.bmm(err, weight.float()) * err).sum(dim=(1, 2), dtype=torch.float64)


def search_clip(x: torch.Tensor, granularity: str, group_size: int, scale_dtype: torch.dtype,
                weight: torch.Tensor | None = None, ratios=COARSE_RATIOS, fine_steps=FINE_STEPS):
    """-> (clip_min [H, D], clip_max [H, D], detail dict). x is the rotated sample [N, H, D]."""
    h, d = x.shape[1:]
    if granularity == "none":
        return (torch.full((h, d), -math.inf), torch.full((h, d), math.inf), {"granularity": "none"})
    x = x.float()
    center, half = _ranges(x, granularity)
    errs: dict[float, torch.Tensor] = {}  # ratio -> per-head error [H]

    def evaluate(candidates):
        for a in candidates:
            a = round(float(a), 4)
            if 0 < a <= 1 and a not in errs:
                errs[a] = quant_error(x, center - a * half, center + a * half, group_size, scale_dtype, weight)

    def best_per_head() -> list[float]:
        grid = sorted(errs)
        table = torch.stack([errs[a] for a in grid])  # [len(grid), H]
        idx = table.sum(1).argmin().expand(h) if granularity == "layer" else table.argmin(0)
        return [grid[i] for i in idx.tolist()]

    evaluate(list(ratios) + [1.0])
    evaluate({a + s for a in set(best_per_head()) for s in fine_steps})
    chosen_ratios = best_per_head()
    base = errs[1.0]
    alpha = torch.tensor(chosen_ratios, dtype=torch.float32)
    clip_min = (center - alpha[:, None] * half).float()
    clip_max = (center + alpha[:, None] * half).float()
    noclip = alpha >= 1.0
    clip_min[noclip] = -math.inf
    clip_max[noclip] = math.inf
    chosen = torch.stack([errs[a][i] for i, a in enumerate(chosen_ratios)])
    detail = {
        "granularity": granularity,
        "ratio": [round(float(a), 4) for a in alpha],
        "error_gain": [round(float(c / b), 4) if b > 0 else 1.0 for c, b in zip(chosen, base)],
    }
    return clip_min, clip_max, detail
