"""Streaming statistics of attention activations, bounded memory whatever the token budget.

:class:`AttentionStats` is a capture callback (see :mod:`calibration.capture`). Per layer l
and KV head h it accumulates, in float64,

    C_Q[l, h] = (1/N) sum_{tokens n} sum_{query heads j of h} q_{n,j}^T q_{n,j}    [D, D]
    C_S[l, h] = (1/N) sum_{tokens n} sum_{query heads j of h} o_{n,j}^T o_{n,j}    [D, D]

(q post-RoPE query rows, o per-head attention output rows before o_proj, N tokens seen),
the mean post-RoPE key of each KV head over positions >= ``skip_first`` (the key shift), and keeps a :class:`Reservoir` - a fixed-size uniform random sample of token positions with
their keys and values - for the clip search. Memory: 2 L H D^2 float64 + the reservoirs.
"""
from __future__ import annotations

import torch

from .capture import group_by_kv_head


class Reservoir:
    """Uniform sample of at most ``capacity`` rows from a stream (Vitter's algorithm R),
    deterministic for a given seed and stream. Rows are ``[H, D]`` tensors (one token of one
    layer, all KV heads); ``add`` takes a batch ``[n, ...]``."""

    def __init__(self, capacity: int, seed: int = 0):
        self.capacity = capacity
        self.seen = 0
        self.rows: torch.Tensor | None = None  # [<=capacity, ...] float32, CPU
        self.filled = 0
        self._gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        if self.capacity <= 0 or x.shape[0] == 0:
            return
        x = x.detach().to("cpu", torch.float32)
        if self.rows is None:
            self.rows = torch.empty(self.capacity, *x.shape[1:], dtype=torch.float32)
        n = x.shape[0]
        take = min(self.capacity - self.filled, n)
        if take:
            self.rows[self.filled:self.filled + take] = x[:take]
            self.filled += take
        rest = x[take:]
        if rest.shape[0]:
            # item i of the stream (0-based) replaces a uniform slot j in [0, i] if j < capacity
            idx = torch.arange(self.seen + take, self.seen + n, dtype=torch.float64)
            j = (torch.rand(rest.shape[0], generator=self._gen, dtype=torch.float64) * (idx + 1)).long()
            keep = j < self.capacity
            slots, src = j[keep], torch.nonzero(keep).squeeze(1)
            if slots.numel():
                # sequential semantics: the last item aimed at a slot wins
                order = torch.argsort(slots, stable=True)
                slots, src = slots[order], src[order]
                last = torch.ones_like(slots, dtype=torch.bool)
                last[:-1] = slots[1:] != slots[:-1]
                self.rows[slots[last]] = rest[src[last]]
        self.seen += n

    def sample(self) -> torch.Tensor:
        if self.rows is None:
            raise ValueError("reservoir is empty: no calibration tokens were seen")
        return self.rows[:self.filled]


class AttentionStats:
    """Capture callback accumulating C_Q, C_S and K/V reservoirs for ``num_layers`` layers:
    the model layers ``layers`` (default 0 .. num_layers - 1; a hybrid model's full-attention
    layers, :attr:`ModelShape.attention_layers`). Row i of every statistic (``tokens[i]``,
    ``c_q()[i]``, ``k_res[i]``, ...) belongs to model layer ``layers[i]``; the callback takes
    model layer indices and refuses any other layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device="cpu",
                 reservoir_tokens: int = 0, skip_first: int = 0, seed: int = 0, layers=None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layers = tuple(range(num_layers)) if layers is None else tuple(int(l) for l in layers)
        if len(self.layers) != num_layers or len(set(self.layers)) != num_layers:
            raise ValueError(f"AttentionStats: layers {self.layers} are not {num_layers} distinct model layers")
        self._row = {l: i for i, l in enumerate(self.layers)}
        shape = (num_layers, num_kv_heads, head_dim, head_dim)
        self.sum_qq = torch.zeros(shape, dtype=torch.float64, device=device)
        self.sum_oo = torch.zeros(shape, dtype=torch.float64, device=device)
        self.tokens = [0] * num_layers
        self.sum_k = torch.zeros(num_layers, num_kv_heads, head_dim, dtype=torch.float64, device=device)
        self.k_tokens = [0] * num_layers  # keys in sum_k (positions >= skip_first)
        self.skip_first = skip_first
        self.k_res = [Reservoir(reservoir_tokens, seed + 2 * l) for l in range(num_layers)]
        self.v_res = [Reservoir(reservoir_tokens, seed + 2 * l) for l in range(num_layers)]

    def __call__(self, model_layer: int, q, k, v, o) -> None:
        b, hkv, t, d = k.shape
        layer = self._row.get(model_layer)
        if layer is None:
            raise ValueError(f"layer {model_layer} captured, but the statistics are for model layers "
                             f"{', '.join(map(str, self.layers))}")
        if hkv != self.num_kv_heads or d != self.head_dim:
            raise ValueError(f"layer {model_layer}: captured K/V of shape {tuple(k.shape)}, expected "
                             f"{self.num_kv_heads} KV heads of head_dim {self.head_dim}")
        for acc, x in ((self.sum_qq, q), (self.sum_oo, o)):
            rows = group_by_kv_head(x.detach(), hkv).to(acc.device, torch.float64)
            acc[layer] += rows.transpose(1, 2) @ rows
        self.tokens[layer] += b * t
        if t > self.skip_first:
            self.sum_k[layer] += k.detach()[:, :, self.skip_first:].to(self.sum_k.device, torch.float64).sum((0, 2))
            self.k_tokens[layer] += b * (t - self.skip_first)
        if self.k_res[layer].capacity and t > self.skip_first:
            # [B, H, T, D] -> token rows [B * (T - skip), H, D]; both reservoirs draw the same slots
            kk = k.detach()[:, :, self.skip_first:].permute(0, 2, 1, 3).reshape(-1, hkv, d)
            vv = v.detach()[:, :, self.skip_first:].permute(0, 2, 1, 3).reshape(-1, hkv, d)
            self.k_res[layer].add(kk)
            self.v_res[layer].add(vv)

    def c_q(self) -> torch.Tensor:
        """[L, Hkv, D, D] float64 second moment of the queries of each KV head."""
        return self._normalised(self.sum_qq)

    def key_mean(self) -> torch.Tensor:
        """[L, Hkv, D] float64 mean post-RoPE key of each KV head (positions >= skip_first)."""
        n = torch.tensor(self.k_tokens, dtype=torch.float64, device=self.sum_k.device)
        if (n == 0).any():
            raise ValueError(f"some layers saw no key past the first {self.skip_first} positions")
        return (self.sum_k / n.view(-1, 1, 1)).cpu()

    def c_s(self) -> torch.Tensor:
        """[L, Hkv, D, D] float64 Gram matrix of the attention outputs of each KV head."""
        return self._normalised(self.sum_oo)

    def _normalised(self, acc):
        n = torch.tensor(self.tokens, dtype=torch.float64, device=acc.device)
        if (n == 0).any():
            raise ValueError("some layers saw no calibration tokens")
        return (acc / n.view(-1, 1, 1, 1)).cpu()
