"""Where a model's attention goes, seen from the hybrid cache: the BF16 sinks, the INT2 history, the
BF16 ring and prefill chunk; which history tokens take the most; and how much of the keys' INT2
attention-output error keeping those few tokens in BF16 would remove.

One held-out window of ``--len`` tokens (calibration.fidelity.tasks' stream) runs through the BF16
model once (calibration.capture). For the queries of the second prefill chunk (positions
``chunk .. len``) and every layer, the keys they read are: sinks ``[0, S)`` and the ring and chunk
``[chunk - W, len)`` in BF16, the history ``[S, chunk - W)`` in INT2. The script reports the mean
attention probability each region receives (over layers, query heads and queries), the history
tokens that receive the most, and the summed relative attention-output error with INT2 keys
(fake quantisation with the rotations file's key layout and shift) when the ``k`` history tokens
with the most attention in that layer stay BF16, for each ``--keep`` k.

    python -m benchmarks.attention_mass --model DIR --rotations FILE --out benchmarks/results/attention_mass_M.json
"""
from __future__ import annotations

import argparse
import os

import torch

from benchmarks.server_harness import ROOT, save_json
from calibration.capture import attention_modules, capture_attention
from calibration.fidelity import tasks
from oscar_kernels.contract.layout import torch_scale_dtype
from oscar_kernels.contract.model_shape import ModelShape, format_layers
from oscar_kernels.contract.rotations_file import load_rotations
from oscar_kernels.int2 import fake_quantise


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_from: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of queries ``q_from ..`` (q [Hq, T, D], k/v [H, T, D]):
    probabilities [Hq, T - q_from, T] and outputs [Hq, T - q_from, D], float32."""
    hq, t, d = q.shape
    rep = hq // k.shape[0]
    s = (q[:, q_from:] @ k.repeat_interleave(rep, 0).transpose(-1, -2)) * d ** -0.5
    pos = torch.arange(t)
    s = s.masked_fill(pos[None, :] > pos[q_from:, None], float("-inf"))
    p = torch.softmax(s, -1)
    return p, p @ v.repeat_interleave(rep, 0)


def run(model, window: torch.Tensor, rot, sink: int, recent: int, chunk: int, keep: list[int], top: int,
        tokenizer) -> dict:
    layers = {}
    decoder = getattr(model, model.base_model_prefix, model)
    by_layer = rot.by_model_layer()  # the captured layer index is the model's, not the file's position
    with torch.no_grad(), capture_attention(model, lambda l, q, k, v, o: layers.__setitem__(
            l, (q[0].float(), k[0].float(), v[0].float())), layers=rot.meta.layer_ids):
        decoder(input_ids=window.view(1, -1), use_cache=False)
    hist_lo, hist_hi = sink, chunk - recent
    sdt, g = torch_scale_dtype(rot.meta.scale_dtype), rot.meta.group_size
    mass = torch.zeros(window.numel())
    errors = dict.fromkeys(keep, 0.0)
    for l in sorted(layers):
        q, k, v = layers[l]
        lr = by_layer[l]
        p, o_ref = attention(q, k, v, chunk)
        got = p.mean((0, 1))  # [T] attention each key receives in this layer
        mass += got
        k_rot = torch.einsum("htd,hde->hte", k, lr.k_rot) - lr.k_shift[:, None, :]
        k_int2 = fake_quantise(k_rot, g, lr.k_clip_min[:, None, :], lr.k_clip_max[:, None, :], sdt)
        hist_mass = got[hist_lo:hist_hi]
        for n in keep:
            mixed = k_int2.clone()
            if n:
                best = hist_lo + hist_mass.topk(min(n, hist_mass.numel())).indices
                mixed[:, best] = k_rot[:, best]
            k_read = k.clone()
            k_read[:, hist_lo:hist_hi] = torch.einsum("hte,hde->htd", mixed + lr.k_shift[:, None, :],
                                                      lr.k_rot)[:, hist_lo:hist_hi]
            _, o = attention(q, k_read, v, chunk)
            errors[n] += float((o - o_ref).pow(2).sum() / o_ref.pow(2).sum())
    mass /= len(layers)
    hist = mass[hist_lo:hist_hi]
    order = hist.topk(min(top, hist.numel()))
    ids = window.tolist()
    return {
        "mass": {"sinks": round(float(mass[:sink].sum()), 4), "int2_history": round(float(hist.sum()), 4),
                 "bf16_ring_and_chunk": round(float(mass[hist_hi:].sum()), 4)},
        "top_history_tokens": [{"position": hist_lo + int(i), "mass": round(float(m), 5),
                                "token": tasks.decode(tokenizer, [ids[hist_lo + int(i)]], skip_special_tokens=False)}
                               for m, i in zip(order.values, order.indices)],
        "output_error_by_kept": {str(n): float(f"{e:.4g}") for n, e in errors.items()},
    }


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rotations", required=True)
    ap.add_argument("--len", type=int, default=2048, help="window length (two prefill chunks by default)")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--start", type=int, default=200_000, help="window start in the held-out stream")
    ap.add_argument("--keep", default="0,8,32", help="history tokens kept in BF16 per layer")
    ap.add_argument("--top", type=int, default=20, help="history tokens listed")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not a.sink <= a.chunk - a.recent < a.chunk < a.len:
        raise SystemExit("attention_mass: needs sink <= chunk - recent < chunk < len")
    rot = load_rotations(a.rotations)
    tok = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, local_files_only=True).eval()
    full = ModelShape.from_hf_config(model.config).attention_layers
    if len(attention_modules(model)) != rot.meta.num_layers or tuple(rot.meta.layer_ids) != full:
        raise SystemExit(f"attention_mass: {a.rotations} is for layers {format_layers(rot.meta.layer_ids)} of "
                         f"{rot.meta.num_layers}, the model's full-attention layers are {format_layers(full)} of "
                         f"{len(attention_modules(model))}")
    stream = tasks.load_heldout_stream(tok, corpus_mb=max(1.0, (a.start + a.len) * 4 / 1e6))
    window = torch.from_numpy(stream.tokens[a.start:a.start + a.len]).long()
    res = run(model, window, rot, a.sink, a.recent, a.chunk, [int(x) for x in a.keep.split(",")], a.top, tok)
    name = os.path.basename(os.path.normpath(a.model))
    out = a.out or os.path.join(ROOT, "benchmarks", "results", f"attention_mass_{name}.json")
    save_json(out, {"model": name, "rotations": os.path.basename(a.rotations),
                    "settings": {"len": a.len, "chunk": a.chunk, "sink": a.sink, "recent": a.recent,
                                 "start": a.start, "text": stream.description},
                    **res})
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
