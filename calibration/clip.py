"""Clip thresholds for the rotated K/V, searched under the exact INT2 quantiser.

Given a sample of rotated activations ``x`` [N, H, D] (N tokens, H KV heads), a clip is a
per-channel interval ``[mean - m * std, mean + m * std]`` where mean / std are pooled over
the *granularity*:

- ``layer``:   one mean/std over all heads and channels of the layer, one multiple m per layer;
- ``head``:    one mean/std per KV head (over its tokens and channels), one m per head;
- ``channel``: one mean/std per (head, channel), one m per head shared by its channels;
- ``none``:    no clip (-inf, +inf).

The multiple ``m`` is chosen by a two-level grid search (coarse grid, then a fine grid
around the best coarse value), together with "no clip", to minimise the quantisation
error of :func:`oscar_kernels.int2.fake_quantise` (clip -> per-token per-group INT2 ->
dequantise) measured against the *unclipped* x:

- objective ``mse``:  sum_n ||x_n - Q(x_n)||^2
- objective ``attn``: sum_n (x_n - Q(x_n)) W (x_n - Q(x_n))^T with a per-head weight W [D, D]
  in the rotated space: for keys W = R^T C_Q R (the expected squared logit error q . dk
  over calibration queries), for values W = R^T (sum_j W_O,j^T W_O,j) R (the squared error
  the value error causes after o_proj, j over the query heads of the KV head).

When "no clip" wins for a head (or the layer) its thresholds are stored as -inf/+inf.
"""
from __future__ import annotations

import math

import torch

from oscar_kernels.int2 import fake_quantise

GRANULARITIES = ("none", "layer", "head", "channel")
OBJECTIVES = ("mse", "attn")
COARSE_MULTIPLES = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)  # in std units
FINE_STEPS = (-0.375, -0.25, -0.125, 0.125, 0.25, 0.375)
NO_CLIP = math.inf


def _moments(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) broadcast to [H, D] for the sample x [N, H, D], pooled per granularity."""
    h, d = x.shape[1:]
    dims = {"layer": (0, 1, 2), "head": (0, 2), "channel": (0,)}.get(granularity)
    if dims is None:
        raise ValueError(f"unknown clip granularity {granularity!r} (choose from {', '.join(GRANULARITIES)})")
    std, mean = torch.std_mean(x.double(), dim=dims, keepdim=True)
    shape = (1, 1, 1) if granularity == "layer" else (1, h, 1) if granularity == "head" else (1, h, d)
    return mean.reshape(shape)[0].expand(h, d).float(), std.reshape(shape)[0].expand(h, d).float()


def quant_error(x: torch.Tensor, clip_min, clip_max, group_size: int, scale_dtype: torch.dtype,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head summed error [H] of fake-quantising x [N, H, D] with the given clip."""
    err = (fake_quantise(x, group_size, clip_min, clip_max, scale_dtype) - x).transpose(0, 1)  # [H, N, D]
    if weight is None:
        return err.pow(2).sum(dim=(1, 2), dtype=torch.float64)
    return (torch.bmm(err, weight.float()) * err).sum(dim=(1, 2), dtype=torch.float64)


def search_clip(x: torch.Tensor, granularity: str, group_size: int, scale_dtype: torch.dtype,
                weight: torch.Tensor | None = None):
    """-> (clip_min [H, D], clip_max [H, D], detail dict). x is the rotated sample [N, H, D]."""
    h, d = x.shape[1:]
    if granularity == "none":
        return (torch.full((h, d), -math.inf), torch.full((h, d), math.inf), {"granularity": "none"})
    if x.shape[0] < 2:
        raise ValueError("the clip search needs a sample of at least 2 tokens")
    x = x.float()
    mean, std = _moments(x, granularity)
    errs: dict[float, torch.Tensor] = {}  # multiple -> per-head error [H]

    def evaluate(candidates):
        for m in candidates:
            m = round(float(m), 4)
            if m > 0 and m not in errs:
                lo, hi = (None, None) if m == NO_CLIP else (mean - m * std, mean + m * std)
                errs[m] = quant_error(x, lo, hi, group_size, scale_dtype, weight)

    def best_per_head() -> list[float]:
        grid = sorted(errs)
        table = torch.stack([errs[m] for m in grid])  # [len(grid), H]
        idx = table.sum(1).argmin().expand(h) if granularity == "layer" else table.argmin(0)
        return [grid[i] for i in idx.tolist()]

    evaluate(list(COARSE_MULTIPLES) + [NO_CLIP])
    evaluate({m + s for m in set(best_per_head()) if m != NO_CLIP for s in FINE_STEPS})
    chosen = best_per_head()
    m = torch.tensor(chosen, dtype=torch.float32, device=x.device)[:, None].expand(h, d)
    unclipped = torch.isinf(m)
    finite_m = torch.where(unclipped, torch.zeros_like(m), m)
    clip_min = torch.where(unclipped, -math.inf, mean - finite_m * std)
    clip_max = torch.where(unclipped, math.inf, mean + finite_m * std)
    base = errs[NO_CLIP]
    best = torch.stack([errs[c][i] for i, c in enumerate(chosen)])
    detail = {
        "granularity": granularity,
        "std_multiple": [None if c == NO_CLIP else c for c in chosen],
        "error_gain": [round(float(e / b), 4) if b > 0 else 1.0 for e, b in zip(best, base)],
    }
    return clip_min.contiguous(), clip_max.contiguous(), detail
