"""A fast proxy for choosing rotations: per-layer attention error with fake-INT2 K/V.

On held-out text, for every attention layer and every rotations file, with the model's own
post-RoPE q, k, v (captured, see :mod:`calibration.capture`) and everything in the rotated
space (q' = q R_K, k' = k R_K, v' = v R_V; R per KV head, shared by its query heads):

    L   = q' k'^T / sqrt(D)             exact logits (causal entries i >= j)
    L^  = q' Q(k')^T / sqrt(D)          Q = oscar_kernels.int2.fake_quantise with the file's
                                        clip, group size (keys: the layer's own,
                                        key_group_sizes[layer], values: value_group_size)
                                        and scale dtype
    O   = softmax(L) v'                 exact per-head attention output
    O^  = softmax(L^) Q(v')             with both K and V quantised

and reports, accumulated over all heads and tokens of the layer,

    logit_rel = ||L^ - L||_F / ||L||_F          over causal entries
    attn_kl   = mean over queries of KL(softmax(L) || softmax(L^))   (nats)
    out_rel   = ||O^ - O||_F / ||O||_F

Queries are subsampled (``query_stride``: positions i = T-1, T-1-stride, ...) to keep it
cheap; every sampled query still attends to all its causal keys. Optional ``sink`` / ``recent`` mimic the serving layout: key j of query i stays exact
(BF16) when ``j < sink`` or ``j > i - recent``. Each layer sees the exact activations of the
unquantised model (errors do not propagate between layers): a per-layer proxy, not
perplexity.
"""
from __future__ import annotations

import math

import torch

from oscar_kernels.contract.layout import torch_scale_dtype
from oscar_kernels.contract.rotations_file import Rotations
from oscar_kernels.int2 import fake_quantise

METRICS = ("logit_rel", "attn_kl", "out_rel")


class ProxyErrors:
    """Capture callback accumulating the proxy metrics of several rotations at once.

    ``metrics``: the ones to compute (default all); ``("attn_kl",)`` skips the values and the
    logit norms (what the key-groups choice of oscar-calibrate needs). Files whose layer has the
    same key rotation share that layer's exact side (rotated q, k, exact softmax)."""

    def __init__(self, rotations: dict[str, Rotations], sink: int = 0, recent: int = 0, query_stride: int = 1,
                 metrics=METRICS):
        if query_stride < 1:
            raise ValueError("query_stride must be >= 1")
        unknown = [m for m in metrics if m not in METRICS]
        if unknown or not metrics:
            raise ValueError(f"unknown proxy metrics {unknown} (choose from {', '.join(METRICS)})")
        self.metrics = tuple(m for m in METRICS if m in metrics)
        self.rotations = rotations
        self.sink, self.recent = sink, recent
        self.query_stride = query_stride
        covered = {(r.meta.num_layers, tuple(r.meta.layer_ids)) for r in rotations.values()}
        if len(covered) != 1:
            raise ValueError("all rotations files must be for the same model and cover the same layers")
        # the capture callback names model layers; rotations and sums are per covered layer
        self.layer_ids = covered.pop()[1]
        self._row = {l: i for i, l in enumerate(self.layer_ids)}
        self.num_layers = len(self.layer_ids)
        zeros = lambda: [dict.fromkeys(("dl2", "l2", "kl", "nq", "do2", "o2"), 0.0) for _ in range(self.num_layers)]
        self.sums = {name: zeros() for name in rotations}

    def _fq(self, x, lo, hi, meta, group_size):
        """Fake-quantise x [B, H, T, D] with per-head clips [H, D] in groups of ``group_size``."""
        y = fake_quantise(x.transpose(1, 2), group_size, lo.to(x.device), hi.to(x.device),
                          torch_scale_dtype(meta.scale_dtype))
        return y.transpose(1, 2)

    @torch.no_grad()
    def __call__(self, model_layer: int, q, k, v, o) -> None:
        layer = self._row[model_layer]
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        rep = hq // hkv
        rows = torch.arange(t - 1, -1, -self.query_stride, device=q.device).flip(0)  # query positions
        q, k, v = q[:, :, rows].float(), k.float(), v.float()
        j = torch.arange(t, device=q.device)
        causal = j[None, :] <= rows[:, None]  # [Tq, T]
        exact = None
        if self.sink or self.recent:
            exact = (j[None, :] < self.sink) | (j[None, :] > rows[:, None] - self.recent)
        scale = 1 / math.sqrt(d)
        want_logits, want_out = "logit_rel" in self.metrics, "out_rel" in self.metrics
        seen = None  # (R_K, its exact side) of the previous file
        for name, rot in self.rotations.items():
            lr = rot.layers[layer].to(q.device)
            r_k, r_v = lr.k_rot, lr.v_rot  # [Hkv, D, D]
            if seen is None or not torch.equal(seen[0], r_k):
                qr = torch.einsum("bhtd,hde->bhte", q, r_k.repeat_interleave(rep, 0))
                kr = torch.einsum("bhtd,hde->bhte", k, r_k)
                logits = (qr @ kr.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
                logp = torch.log_softmax(logits.masked_fill(~causal, -math.inf), -1)
                l2 = float(logits.masked_fill(~causal, 0).double().pow(2).sum()) if want_logits else 0.0
                seen = (r_k, (qr, kr, logits, logp, logp.exp(), l2))
            qr, kr, logits, logp, p, l2 = seen[1]
            shift = lr.k_shift[None, :, None, :]  # stored keys are k' - shift; logits compare unshifted
            kq = (self._fq(kr - shift, lr.k_clip_min, lr.k_clip_max, rot.meta, rot.meta.key_group_sizes[layer])
                  + shift).repeat_interleave(rep, 1)
            logits_q = (qr @ kq.transpose(-1, -2)) * scale
            if exact is not None:
                logits_q = torch.where(exact, logits, logits_q)
            s = self.sums[name][layer]
            if want_logits:
                s["dl2"] += float((logits_q - logits).masked_fill(~causal, 0).double().pow(2).sum())
                s["l2"] += l2
            logp_q = torch.log_softmax(logits_q.masked_fill(~causal, -math.inf), -1)
            s["kl"] += float((p * (logp - logp_q)).masked_fill(~causal, 0).double().sum())
            s["nq"] += b * hq * rows.numel()
            if want_out:
                p_q = logp_q.exp()
                vr = torch.einsum("bhtd,hde->bhte", v, r_v)
                vq = self._fq(vr, lr.v_clip_min, lr.v_clip_max, rot.meta,
                              rot.meta.value_group_size).repeat_interleave(rep, 1)
                vr = vr.repeat_interleave(rep, 1)
                out = p @ vr
                out_q = p_q @ vq if exact is None else (p_q * exact) @ vr + (p_q * ~exact) @ vq
                s["do2"] += float((out_q - out).double().pow(2).sum())
                s["o2"] += float(out.double().pow(2).sum())

    def results(self) -> dict:
        """{name: {"layers": [{metric: value}] (one per covered layer, in ``layer_ids`` order),
    "mean": {metric: mean over layers}}}, for the metrics computed."""
        out = {}
        for name, per_layer in self.sums.items():
            rows = []
            for s in per_layer:
                if s["nq"] == 0:
                    raise ValueError("the proxy saw no tokens")
                row = {"logit_rel": math.sqrt(s["dl2"] / s["l2"]) if "logit_rel" in self.metrics else None,
                       "attn_kl": s["kl"] / s["nq"],
                       "out_rel": math.sqrt(s["do2"] / s["o2"]) if "out_rel" in self.metrics else None}
                rows.append({m: row[m] for m in self.metrics})
            out[name] = {"layers": rows,
                         "mean": {m: sum(r[m] for r in rows) / len(rows) for m in self.metrics}}
        return out


@torch.no_grad()
def run_proxy(model, windows, rotations: dict[str, Rotations], sink: int = 0, recent: int = 0,
              device: str = "cpu", progress: bool = True, query_stride: int = 8, metrics=METRICS) -> dict:
    """Proxy metrics of each rotations file on the given token windows ([T] int64 each)."""
    from tqdm import tqdm

    from .capture import capture_attention

    acc = ProxyErrors(rotations, sink=sink, recent=recent, query_stride=query_stride, metrics=metrics)
    decoder = getattr(model, model.base_model_prefix, model)
    with capture_attention(model, acc, layers=acc.layer_ids):
        for w in tqdm(list(windows), desc="proxy", unit="window", disable=not progress):
            decoder(input_ids=w[None].to(device), use_cache=False)
    return acc.results()


def format_table(results: dict) -> str:
    """A plain-text table: one row per rotations file, mean over layers, then per layer out_rel."""
    lines = [f"{'rotations':<28} {'logit_rel':>9} {'attn_kl':>9} {'out_rel':>8}   out_rel per layer"]
    for name, r in results.items():
        m = r["mean"]
        per = " ".join(f"{x['out_rel']:.3f}" for x in r["layers"])
        lines.append(f"{name:<28} {m['logit_rel']:>9.4f} {m['attn_kl']:>9.4f} {m['out_rel']:>8.4f}   {per}")
    return "\n".join(lines)
