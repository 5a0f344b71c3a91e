"""KV caches the HF model attends through during the fidelity evaluation.

Both classes serve ``B`` sequences that advance together (same length), one request row
per sequence, and are driven by :mod:`calibration.fidelity.attention` (the attention
function registered in transformers' AttentionInterface):

- :class:`HybridKVSim` stores and reads K/V exactly as the server does: through the
  server's :class:`oscar_kernels.hybrid_attention.HybridAttention` over a hybrid cache,
  one plan per step (a prefill chunk: extend; one token after a prefix: decode), one call
  per layer; so every query of a later chunk and every decoded token reads the INT2
  history (positions S .. n - W), the BF16 sink (< S) and the BF16 ring (last W).
- :class:`Bf16KVSim` is the BF16 reference with the same numerics otherwise: K/V kept in
  BF16, q rounded to BF16, softmax(q k^T * scale) v in float32, output rounded to BF16.
- :class:`FakeInt2KVSim` (ablation): Bf16KVSim with fake-quantised history keys, values or
  both in PyTorch, so the INT2 error can be attributed to K or V (and quantiser candidates tried);
  ``key_channel_page`` P > 0 (simulator only, no kernel stores it) quantises the keys KIVI-style:
  after the rotation, one scale and min per channel over a page of P tokens
  (:func:`fake_quantise_channels`), computed once the page is complete.
- :class:`LayerSplitKVSim` (attribution): chosen layers through a BF16 cache, the others through
  an INT2 simulator, so the INT2 loss can be charged to layers.

:class:`HybridKVSim` also takes a group size per layer (a layout that spends its bytes unevenly
over the layers; the reference path stores and reads every layer with its own groups).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from oscar_kernels.hybrid_attention import HybridAttention
from oscar_kernels.hybrid_cache import HybridCache, LayerRotation, allocate_index, allocate_layer
from oscar_kernels.contract.layout import check_group_sizes, torch_scale_dtype
from oscar_kernels.int2 import clip, dequantise, fake_quantise, minmax_codes, quantise
from oscar_kernels.reference import expand_gqa, key_noise_bias, rotate


CACHE_DTYPE = torch.bfloat16  # the server's model and KV dtype


def fake_quantise_channels(x: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """KIVI-style INT2 over tokens: x [B, T, H, D] float -> dequantised float32, same shape, with
    one (scale, min) per (row, head, channel) over the T tokens: the min/max rule of
    :func:`oscar_kernels.int2.quantise` (:func:`minmax_codes`), grouped over tokens instead of channels."""
    codes, scale_q, lo_q = minmax_codes(x.float().movedim(1, -1), scale_dtype)  # [B, H, D, T]: a group per channel
    return (lo_q.float().unsqueeze(-1) + codes * scale_q.float().unsqueeze(-1)).movedim(-1, 1)


class _KVSim:
    """Bookkeeping shared by the simulators: ``batch`` rows at a common length."""

    def __init__(self, num_layers: int, max_batch: int, max_len: int, device):
        self.num_layers, self.max_batch, self.max_len = num_layers, max_batch, max_len
        self.device = torch.device(device)
        self.batch = 0
        self.length = 0

    def begin(self, batch: int) -> None:
        """Start ``batch`` new sequences at position 0."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside 1..{self.max_batch} of this simulator")
        self.batch, self.length = batch, 0

    def check_step(self, tokens: int) -> None:
        if self.batch == 0:
            raise RuntimeError("call begin(batch) before running the model")
        if self.length + tokens > self.max_len:
            raise ValueError(f"sequence length {self.length + tokens} exceeds the simulator's "
                             f"max_len {self.max_len}")

    def advance(self, tokens: int) -> None:
        """All layers have attended over this step's tokens: they are now history."""
        self.length += tokens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scaling: float) -> torch.Tensor:
        raise NotImplementedError


class Bf16KVSim(_KVSim):
    """Plain BF16 KV cache (the `bf16` method)."""

    name = "bf16"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_batch: int,
                 max_len: int, device="cpu"):
        super().__init__(num_layers, max_batch, max_len, device)
        shape = (max_batch, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=CACHE_DTYPE, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=CACHE_DTYPE, device=self.device) for _ in range(num_layers)]

    def attend(self, layer_idx, q, k, v, scaling):
        """q [B, Hq, T, D], k/v [B, H, T, D] (post-RoPE) -> o [B, T, Hq, D]."""
        b, _, t, _ = q.shape
        n0, n = self.length, self.length + t
        self._store(layer_idx, b, n0, n, k.transpose(1, 2), v.transpose(1, 2))
        kk, vv = self._read(layer_idx, b, n0, n, t)
        kk, vv = kk.transpose(1, 2).float(), vv.transpose(1, 2).float()
        qi = torch.arange(t, device=q.device).unsqueeze(1)
        kj = torch.arange(n, device=q.device).unsqueeze(0)
        mask = kj <= qi + n0
        qf = q.to(CACHE_DTYPE).float()
        bias = self._logit_bias(layer_idx, qf, n0, n, t, scaling)
        if bias is not None:  # a float mask: -inf where masked, minus the bias elsewhere
            mask = torch.where(mask, 0.0, float("-inf")) - bias
        o = F.scaled_dot_product_attention(qf, kk, vv, attn_mask=mask, scale=scaling, enable_gqa=True)
        return o.transpose(1, 2).to(CACHE_DTYPE).to(q.dtype)

    def _logit_bias(self, layer_idx, q, n0, n, t, scaling):
        """[B, Hq, T, n] to subtract from the step's logits (q [B, Hq, T, D]), or None: none."""
        return None

    def _store(self, layer_idx, b, n0, n, k, v):
        """k/v [B, T, H, D] of positions n0..n."""
        self.k[layer_idx][:b, n0:n] = k.to(CACHE_DTYPE)
        self.v[layer_idx][:b, n0:n] = v.to(CACHE_DTYPE)

    def _read(self, layer_idx, b, n0, n, t):
        """K/V [B, n, H, D] the step's queries attend to."""
        return self.k[layer_idx][:b, :n], self.v[layer_idx][:b, :n]


class FakeInt2KVSim(Bf16KVSim):
    """Ablation: Bf16KVSim whose INT2 positions take fake-quantised keys (``parts`` "k"),
    values ("v") or both ("kv"): x_hat = dequant(quant(clip(x R))) R^T per KV head, with the
    server's read rule -- sink [0, S) and ring exact; history [S, ring_lo) quantised, where
    ring_lo = max(n - W, S) when decoding (the new token is in the ring) and max(n0 - W, S)
    for a prefill chunk after n0 tokens (the chunk itself is read fresh, as in extend).
    ``value_group_size`` / ``value_scale_dtype``: the values' own INT2 groups (default: the
    keys'), to try layouts with a group size per tensor.
    ``key_channel_page`` P > 0: keys quantised per channel over pages of P positions (page p =
    positions [p P, (p+1) P), the sinks left out of the first), after the rotation, shift and clip,
    with ``key_page_scale_dtype`` (default the keys' scale dtype) -- KIVI's key layout; a page is
    quantised when its last position is stored, which the ring makes possible when W >= P (every
    position of an incomplete page is still in the ring, so it is never read from INT2).
    ``key_debias`` C: history logits subtract C x the kernels' key debias (1: what they apply;
    per-token key groups only, 0 with key pages)."""

    name = "fake-int2"

    def __init__(self, rotations: list[LayerRotation], group_size: int, sink_tokens: int,
                 recent_window: int, max_batch: int, max_len: int, device="cpu",
                 scale_dtype: str = "float16", parts: str = "kv", value_group_size: int | None = None,
                 value_scale_dtype: str | None = None, key_channel_page: int = 0,
                 key_page_scale_dtype: str | None = None, key_debias: float = 0.0):
        if parts not in ("k", "v", "kv"):
            raise ValueError(f"parts must be 'k', 'v' or 'kv', not {parts!r}")
        if sink_tokens < 0 or recent_window < 0:
            raise ValueError("sink tokens and recent window must be >= 0")
        if key_channel_page < 0 or (key_channel_page and recent_window < key_channel_page):
            raise ValueError(f"key channel page {key_channel_page} needs a recent window W >= the page "
                             f"(W = {recent_window}): an incomplete page must stay in the BF16 ring")
        h, d = rotations[0].k_rot.shape[0], rotations[0].k_rot.shape[-1]
        super().__init__(len(rotations), h, d, max_batch, max_len, device)
        self.rotations = [r.to(self.device) for r in rotations]
        self.group_size, self.value_group_size = check_group_sizes(d, group_size, value_group_size)
        self.scale_dtype = torch_scale_dtype(scale_dtype)
        self.value_scale_dtype = torch_scale_dtype(value_scale_dtype or scale_dtype)
        self.sink_tokens, self.recent_window, self.parts = sink_tokens, recent_window, parts
        self.key_channel_page = key_channel_page
        self.key_page_scale_dtype = torch_scale_dtype(key_page_scale_dtype or scale_dtype)
        self.kq = [torch.zeros_like(x) for x in self.k] if "k" in parts else None
        self.key_debias = key_debias if self.kq is not None and not key_channel_page else 0.0
        # per stored position and key group: its scale^2 (key_debias), written by the key quantiser
        self.kvar = ([torch.zeros(*x.shape[:-1], d // self.group_size, device=self.device) for x in self.k]
                     if self.key_debias else None)
        self.vq = [torch.zeros_like(x) for x in self.v] if "v" in parts else None

    @staticmethod
    def _fake(x, rot, clip_min, clip_max, quantise, shift=0.0):
        """x [B, T, H, D]: rotate, shift, clip, ``quantise`` (rotated float32 -> dequantised),
        unshift, rotate back."""
        x_rot = clip(torch.einsum("bthd,hde->bthe", x.float(), rot) - shift, clip_min, clip_max)
        return torch.einsum("bthe,hde->bthd", quantise(x_rot) + shift, rot).to(CACHE_DTYPE)

    def _store(self, layer_idx, b, n0, n, k, v):
        super()._store(layer_idx, b, n0, n, k, v)
        r = self.rotations[layer_idx]
        if self.kq is not None and self.key_channel_page:
            self._store_key_pages(layer_idx, b, n0, n, r)
        elif self.kq is not None:
            def quantise_keys(x):  # fake INT2 of the rotated keys, keeping their scale^2 for the debias
                codes, scales = quantise(x, self.group_size, self.scale_dtype)
                if self.kvar is not None:
                    self.kvar[layer_idx][:b, n0:n] = scales[..., 0].float().pow(2)
                return dequantise(codes, scales)
            self.kq[layer_idx][:b, n0:n] = self._fake(k.to(CACHE_DTYPE), r.k_rot, r.k_clip_min, r.k_clip_max,
                                                      quantise_keys, r.k_shift)
        if self.vq is not None:
            self.vq[layer_idx][:b, n0:n] = self._fake(
                v.to(CACHE_DTYPE), r.v_rot, r.v_clip_min, r.v_clip_max,
                lambda x: fake_quantise(x, self.value_group_size, None, None, self.value_scale_dtype))

    def _logit_bias(self, layer_idx, q, n0, n, t, scaling):
        """The kernels' key debias (reference.key_noise_bias) at the INT2 history, times key_debias."""
        s, hi = self._history(n0, n, t)
        if self.kvar is None or hi <= s:
            return None
        r, (b, hq) = self.rotations[layer_idx], q.shape[:2]
        kvar = torch.zeros(n, *self.kvar[layer_idx].shape[2:], device=q.device)
        bias = []
        for row in range(b):
            kvar[s:hi] = self.kvar[layer_idx][row, s:hi]
            q_rot = rotate(q[row].transpose(0, 1), expand_gqa(r.k_rot, hq))  # [T, Hq, D]
            bias.append(key_noise_bias(q_rot, kvar, scaling))
        return self.key_debias * torch.stack(bias)

    def _history(self, n0, n, t):
        """The INT2-read positions [s, hi) of a step of t tokens after n0."""
        s = min(self.sink_tokens, n)
        decode = t == 1 and n0 > 0
        hi = max(n - self.recent_window, s) if decode else min(max(n0 - self.recent_window, s), n0)
        return s, hi

    def _store_key_pages(self, layer_idx, b, n0, n, r):
        """Quantise the key pages whose last position is among n0..n (KIVI: per channel over the page)."""
        p = self.key_channel_page
        for end in range((n0 // p + 1) * p, n + 1, p):
            lo = max(end - p, self.sink_tokens)
            if lo >= end:
                continue
            self.kq[layer_idx][:b, lo:end] = self._fake(
                self.k[layer_idx][:b, lo:end], r.k_rot, r.k_clip_min, r.k_clip_max,
                lambda x: fake_quantise_channels(x, self.key_page_scale_dtype), r.k_shift)

    def _read(self, layer_idx, b, n0, n, t):
        kk, vv = super()._read(layer_idx, b, n0, n, t)
        s, hi = self._history(n0, n, t)
        if hi > s:
            if self.kq is not None:
                kk = kk.clone()
                kk[:, s:hi] = self.kq[layer_idx][:b, s:hi]
            if self.vq is not None:
                vv = vv.clone()
                vv[:, s:hi] = self.vq[layer_idx][:b, s:hi]
        return kk, vv


def per_layer_groups(num_layers: int, group_size, value_group_size=None) -> list[tuple[int, int]]:
    """(keys' group, values' group) of each layer, from one size or one per layer for each
    (the values default to the keys')."""
    def each(x, what):
        xs = list(x) if isinstance(x, (list, tuple)) else [x] * num_layers
        if len(xs) != num_layers:
            raise ValueError(f"{len(xs)} {what} group sizes for {num_layers} layers")
        return xs
    keys = each(group_size, "key")
    values = keys if value_group_size is None else each(value_group_size, "value")
    return list(zip(keys, values))


class HybridKVSim(_KVSim):
    """The server's hybrid INT2 + BF16 sink/ring cache, through the server's HybridAttention.
    ``group_size``: the keys' INT2 group; ``value_group_size``: the values' (default: the keys');
    either may be a list with one size per layer (as a version-4 rotations file serves them);
    ``key_debias``: HybridAttention's."""

    name = "hybrid"

    def __init__(self, rotations: list[LayerRotation], group_size: int, sink_tokens: int,
                 recent_window: int, max_batch: int, max_len: int, device="cpu",
                 scale_dtype: str = "float16", page_size: int | None = None,
                 value_group_size: int | None = None, key_debias: bool = False):
        num_layers = len(rotations)
        super().__init__(num_layers, max_batch, max_len, device)
        if sink_tokens < 0 or recent_window < 0:
            raise ValueError("sink tokens and recent window must be >= 0")
        h, d = rotations[0].k_rot.shape[0], rotations[0].k_rot.shape[-1]
        self.page_size = page_size or max(64, sink_tokens)
        if sink_tokens > self.page_size:
            raise ValueError(f"sink tokens {sink_tokens} exceed the page size {self.page_size} "
                             "(sinks live on a sequence's first page)")
        self.row_len = -(-max_len // self.page_size) * self.page_size  # rows start on a page
        num_slots = max_batch * self.row_len
        sdt = torch_scale_dtype(scale_dtype)
        groups = per_layer_groups(num_layers, group_size, value_group_size)
        layers = [allocate_layer(num_slots, h, d, gk, sink_tokens, recent_window,
                                 num_sink_slots=max_batch, num_rows=max_batch,
                                 scale_dtype=sdt, device=self.device, value_group_size=gv)
                  for gk, gv in groups]
        req_to_token = torch.arange(num_slots, dtype=torch.int32, device=self.device).view(max_batch, self.row_len)
        self.cache = HybridCache(layers, [r.to(self.device) for r in rotations],
                                 allocate_index(num_slots, self.page_size, max_batch, max_batch, device=self.device),
                                 req_to_token)
        self.sink_tokens, self.recent_window = sink_tokens, recent_window
        self.key_debias = key_debias
        self.attention: HybridAttention | None = None  # built on the first step (the model's head count, scale)
        self._planned = None  # (batch, length, tokens) of the planned step
        self._generation = 0  # the ring owner of the sequences begun last

    @property
    def value_group_size(self) -> int:
        """Layer 0's values' group (see :attr:`layer_groups` for every layer's)."""
        return self.cache.layers[0].value_group_size

    @property
    def layer_groups(self) -> list[tuple[int, int]]:
        """(keys' group, values' group) of every layer as stored."""
        return [(lc.key_group_size, lc.value_group_size) for lc in self.cache.layers]

    def begin(self, batch: int) -> None:
        """Start ``batch`` new sequences: sink slots handed out afresh, every ring restarts."""
        super().begin(batch)
        ix = self.cache.index
        ix.sink_slot_of_page.fill_(-1)
        ix.page_of_sink_slot.fill_(-1)
        ix.sink_cursor = 0
        self._generation += 1
        self._planned = None

    def _plan(self, num_q_heads: int, t: int, scaling: float) -> bool:
        """Plan this step once (its first layer); True for a decode step."""
        if self.attention is None:
            self.attention = HybridAttention(self.cache, num_q_heads, scaling, max_batch=self.max_batch,
                                             key_debias=self.key_debias)
        elif scaling != self.attention.sm_scale:
            raise ValueError(f"attention scale {scaling} differs from the {self.attention.sm_scale} of the "
                             "first layer (one scale for every layer, as the server)")
        b, n0, dev = self.batch, self.length, self.device
        decode = t == 1 and n0 > 0
        if self._planned != (b, n0, t):
            rows = torch.arange(b, device=dev)
            positions = (n0 + torch.arange(t, device=dev)).repeat(b)
            slots = self.cache.req_to_token[rows.repeat_interleave(t), positions]
            if decode:
                self.attention.plan_decode(rows, torch.full((b,), n0 + 1, device=dev), positions, slots)
            else:
                self.attention.plan_extend(rows, torch.full((b,), n0, device=dev), torch.full((b,), t, device=dev),
                                           positions, slots, prefix_lens_host=[n0] * b, extend_lens_host=[t] * b,
                                           owners=torch.full((b,), self._generation, device=dev))
            self._planned = (b, n0, t)
        return decode

    def attend(self, layer_idx, q, k, v, scaling):
        """q [B, Hq, T, D], k/v [B, H, T, D] (post-RoPE, unrotated) -> o [B, T, Hq, D]."""
        b, hq, t, d = q.shape
        run = self.attention.decode if self._plan(hq, t, scaling) else self.attention.extend
        qf = q.transpose(1, 2).reshape(b * t, hq, d).to(CACHE_DTYPE)
        kf = k.transpose(1, 2).reshape(b * t, -1, d).to(CACHE_DTYPE)
        vf = v.transpose(1, 2).reshape(b * t, -1, d).to(CACHE_DTYPE)
        return run(layer_idx, qf, kf, vf).view(b, t, hq, d).to(q.dtype)


class LayerSplitKVSim(_KVSim):
    """Attribution: the layers in ``bf16_layers`` attend through ``bf16`` (a Bf16KVSim), every
    other layer through ``int2`` (an INT2 simulator); both hold every layer and advance together.
    With no BF16 layer it is ``int2``; with all of them, ``bf16``: the INT2 loss of a model can
    so be split over its layers (and the layers' shares compared with their sum). ``bf16_kv_heads``
    splits it over KV heads instead: in every INT2 layer, the query heads of those KV heads take
    ``bf16``'s output (both caches attend; the KV heads' caches are independent, so this is the
    cache with those heads in BF16)."""

    def __init__(self, int2: _KVSim, bf16: Bf16KVSim, bf16_layers=(), bf16_kv_heads=()):
        if (int2.num_layers, int2.max_batch, int2.max_len) != (bf16.num_layers, bf16.max_batch, bf16.max_len):
            raise ValueError("the INT2 and BF16 simulators must have the same layers, batch and length")
        bad = sorted(set(bf16_layers) - set(range(int2.num_layers)))
        if bad:
            raise ValueError(f"BF16 layers {bad} outside the model's {int2.num_layers}")
        heads = bf16.k[0].shape[2]
        bad = sorted(set(bf16_kv_heads) - set(range(heads)))
        if bad:
            raise ValueError(f"BF16 KV heads {bad} outside the model's {heads}")
        super().__init__(int2.num_layers, int2.max_batch, int2.max_len, int2.device)
        self.int2, self.bf16, self.bf16_layers = int2, bf16, frozenset(bf16_layers)
        self.bf16_kv_heads, self.num_kv_heads = sorted(set(bf16_kv_heads)), heads

    def begin(self, batch: int) -> None:
        super().begin(batch)
        self.int2.begin(batch)
        self.bf16.begin(batch)

    def advance(self, tokens: int) -> None:
        super().advance(tokens)
        self.int2.advance(tokens)
        self.bf16.advance(tokens)

    def attend(self, layer_idx, q, k, v, scaling):
        if layer_idx in self.bf16_layers:
            return self.bf16.attend(layer_idx, q, k, v, scaling)
        o = self.int2.attend(layer_idx, q, k, v, scaling)
        if not self.bf16_kv_heads:
            return o
        exact = self.bf16.attend(layer_idx, q, k, v, scaling)  # [B, T, Hq, D]; query head j reads KV head j // rep
        rep = q.shape[1] // self.num_kv_heads
        heads = torch.tensor([j for h in self.bf16_kv_heads for j in range(h * rep, (h + 1) * rep)], device=o.device)
        return o.index_copy(2, heads, exact.index_select(2, heads))
