"""oscar-calibrate on every row of calibration/architectures.py, and the head_dim 96 decision.

Per row (CPU, random weights built from the row's config, nothing downloaded): the model
folder is built, ``oscar-calibrate`` runs (recipes oscar, hadamard, naive; a refusal is kept
as its one line), the file is loaded and validated against the model's config, and the
per-layer proxy (:mod:`calibration.proxy`) compares the three on held-out text (the stdlib
test suite; calibration reads the stdlib source).

head_dim 96 (Phi-3): candidate Hadamard factors for a dimension that is not a power of two,
each composed with the same eigenbases, measured by the same proxy
- on the Phi-3 row's random model (real text, random weights), and
- on real statistics: tinylm-A (a trained Qwen3, head_dim 128) with every head cut to 96
  channels, 48 of its 64 RoPE pairs (pair i = channels i, i + 64, kept when i % 4 != 3, so
  the whole frequency range stays), q, k, v and o sliced alike; with the same candidates at
  the native 128 as a reference.

    python -m benchmarks.calibration_architectures [--only NAME,...] [--tokens 4096]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import tempfile
import time
from dataclasses import replace

import torch

from calibration import architectures as archs
from calibration import text_sources
from calibration.calibrate import load_model, model_shape
from calibration.capture import capture_attention
from calibration.cli import main as calibrate_cli
from calibration.compose import compose, sorted_eigh
from calibration.proxy import ProxyErrors, run_proxy
from calibration.statistics import AttentionStats
from calibration.transforms import block_hadamard_matrix, hadamard_any, hadamard_factors
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import (Rotations, load_rotations, make_meta, no_clip,
                                                   orthogonality_error)
from oscar_kernels.hybrid_cache import LayerRotation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("oscar", "hadamard", "naive")
SEQ_LEN = 512


def held_out(tok, tokens: int, seq_len: int = SEQ_LEN):
    files = text_sources.shuffled(text_sources.stdlib_test_files(), 0)
    return list(text_sources.token_stream(tok, text_sources.read_texts(files), seq_len, tokens))


def run_cli(argv: list[str]) -> tuple[int, str]:
    """(exit status, the 'oscar-calibrate: error: ...' line or '') of one in-process CLI run."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = calibrate_cli(argv)
    lines = [l for l in err.getvalue().splitlines() if l.startswith("oscar-calibrate: error: ")]
    return rc, lines[-1] if lines else ""


def row_result(arch, work: str, tokens: int, eval_tokens: int) -> dict:
    rec = {"name": arch.name, "family": arch.family, "source": arch.source, "model_type": arch.model_type,
           "architecture": arch.architecture, "geometry": arch.geometry, "features": list(arch.features),
           "notes": arch.notes, "config": arch.config}
    t = time.time()
    model_dir = archs.build_model_dir(arch, os.path.join(work, arch.name), seed=0)
    rec["build_seconds"] = round(time.time() - t, 1)
    files, rec["calibrate"] = {}, {}
    for recipe in RECIPES:
        out = os.path.join(work, f"{arch.name}-{recipe}.safetensors")
        t = time.time()
        rc, why = run_cli(["--model", model_dir, "--out", out, "--recipe", recipe, "--tokens", str(tokens),
                           "--seq-len", str(SEQ_LEN), "--device", "cpu", "--quiet"])
        rec["calibrate"][recipe] = {"ok": rc == 0, "seconds": round(time.time() - t, 1),
                                    **({"refused": why} if rc else {})}
        if rc == 0:
            files[recipe] = out
    rec["calibrate_ok"] = "oscar" in files
    rots, rec["validation"] = {}, {}
    shape = model_shape(model_dir)
    for recipe, f in files.items():
        try:
            rots[recipe] = load_rotations(f, expect=shape)
            m = rots[recipe].meta
            rec["validation"][recipe] = {
                "ok": True, "group_size": m.group_size, "value_group_size": m.value_group_size,
                "scale_dtype": m.scale_dtype, "calib_tokens": m.calib_tokens,
                "max_orthogonality_error": max(orthogonality_error(getattr(lr, k)) for lr in rots[recipe].layers
                                               for k in ("k_rot", "v_rot"))}
        except ValueError as e:
            rec["validation"][recipe] = {"ok": False, "error": str(e)}
    rec["file_ok"] = bool(rec["validation"].get("oscar", {}).get("ok"))
    if rots:
        model, tok = load_model(model_dir, "cpu", "float32")
        windows = held_out(tok, eval_tokens)
        res = run_proxy(model, windows, rots, progress=False)
        rec["proxy"] = {"tokens": sum(w.numel() for w in windows), "seq_len": SEQ_LEN,
                        "mean": {r: res[r]["mean"] for r in res},
                        "out_rel_per_layer": {r: [x["out_rel"] for x in res[r]["layers"]] for r in res}}
        del model
    return rec


# ---------------------------------------------------------------- head_dim 96 candidates

def candidates(u: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """Rotations [H, D, D] for one tensor (keys or values) from its eigenvectors u [H, D, D]."""
    d = u.shape[-1]
    out = {"naive (R = I)": torch.eye(d, dtype=torch.float64).expand_as(u),
           "hadamard (R = H_D, data-free)": hadamard_any(d).expand_as(u),
           "U (eigenbasis alone)": u}
    for v in ("U-H-P", "U-H", "U-P-Hblock", "U-Hblock-P"):
        out[v] = compose(u, v, group)
    for blocks in (2, 3):  # Hadamards of whole blocks, not of quantisation groups
        if d % blocks == 0:
            try:
                out[f"U-blocks({blocks}x{d // blocks})"] = u @ block_hadamard_matrix(d, d // blocks)
            except ValueError:
                pass
    return out


def sliced(callback, idx):
    if idx is None:
        return callback
    return lambda l, q, k, v, o: callback(l, q[..., idx], k[..., idx], v[..., idx], o[..., idx])


@torch.no_grad()
def forward_all(model, windows, callback) -> None:
    decoder = getattr(model, model.base_model_prefix, model)
    with capture_attention(model, callback):
        for w in windows:
            decoder(input_ids=w[None], use_cache=False)


def compare_candidates(model, tok, shape: ModelShape, idx, tokens: int, eval_tokens: int, seq_len: int) -> dict:
    """Proxy means of every candidate, statistics from the stdlib source, proxy on its tests."""
    t = time.time()
    stats = AttentionStats(shape.num_layers, shape.num_kv_heads, shape.head_dim)
    files = text_sources.shuffled(text_sources.stdlib_files(), 0)
    forward_all(model, text_sources.token_stream(tok, text_sources.read_texts(files), seq_len, tokens),
                sliced(stats, idx))
    layout = KVLayout.resolve(shape.head_dim)
    _, u_k = sorted_eigh(stats.c_q())
    _, u_v = sorted_eigh(stats.c_s())
    per_layer = [(candidates(u_k[l], layout.key_group_size), candidates(u_v[l], layout.value_group_size))
                 for l in range(shape.num_layers)]
    lo, hi = no_clip(shape.num_kv_heads, shape.head_dim)
    meta = make_meta(shape, "candidates", layout, "oscar")
    rots = {n: Rotations(meta, [LayerRotation(k[n].float(), v[n].float(), lo, hi, lo, hi) for k, v in per_layer])
            for n in per_layer[0][0]}
    acc = ProxyErrors(rots, query_stride=8)
    windows = held_out(tok, eval_tokens, seq_len)
    forward_all(model, windows, sliced(acc, idx))
    res = acc.results()
    return {"shape": vars(shape), "layout": vars(layout), "calib_tokens": stats.tokens[0],
            "eval_tokens": sum(w.numel() for w in windows), "seq_len": seq_len,
            "seconds": round(time.time() - t, 1), "mean": {n: r["mean"] for n, r in res.items()}}


def ranking(block: dict, metric: str) -> list[str]:
    return sorted(block["mean"], key=lambda n: block["mean"][n][metric])


def tinylm_dir(given: str | None) -> str | None:
    for p in (given, os.environ.get("OSCAR_TINYLM"), os.path.join(os.path.dirname(ROOT), "shared", "models", "tinylm-A")):
        if p and os.path.isfile(os.path.join(p, "config.json")):
            return p
    return None


def head_dim_96(work: str, tokens: int, eval_tokens: int, real_model: str | None) -> dict:
    two, q = hadamard_factors(96)
    out = {"hadamard_96": f"H_96 = H_{two} (x) Paley_{q + 1} (Sylvester x Paley construction I, q = {q})",
           "permutation_96": "calibration.transforms.dealing_permutation (bit reversal of j // 3, + 32 (j % 3))",
           "evals": {}}
    phi = archs.get("phi-3-mini-4k")
    phi_dir = os.path.join(work, phi.name)
    if not os.path.isfile(os.path.join(phi_dir, "config.json")):
        archs.build_model_dir(phi, phi_dir, seed=0)
    model, tok = load_model(phi_dir, "cpu", "float32")
    out["evals"]["phi-3-mini-4k random weights"] = compare_candidates(
        model, tok, ModelShape.from_hf_config(model.config), None, tokens, eval_tokens, SEQ_LEN)
    real = tinylm_dir(real_model)
    if real:
        model, tok = load_model(real, "cpu", "float32")
        shape = ModelShape.from_hf_config(model.config)
        half = shape.head_dim // 2
        pairs = [i for i in range(half) if i % 4 != 3]
        idx = torch.tensor(pairs + [i + half for i in pairs])
        out["evals"]["tinylm-A cut to 96 channels"] = {
            "channels": f"RoPE pairs i < {half} with i % 4 != 3 (channels i and i + {half})",
            **compare_candidates(model, tok, replace(shape, head_dim=len(idx)), idx, 4 * tokens, 2 * eval_tokens, 1024)}
        out["evals"]["tinylm-A at head_dim 128 (reference)"] = compare_candidates(
            model, tok, shape, None, 4 * tokens, 2 * eval_tokens, 1024)
        out["real_model"] = os.path.abspath(real)
    else:
        out["real_model"] = None  # no trained model here: only the random-weight figures
    for name, block in out["evals"].items():
        block["ranking"] = {m: ranking(block, m) for m in ("logit_rel", "attn_kl", "out_rel")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma-separated row names (default: every row)")
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens per row (CPU)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="held-out proxy tokens per row")
    p.add_argument("--real-model", default=None, help="trained head_dim-128 model for the 96 decision "
                                                      "(default: ../shared/models/tinylm-A or $OSCAR_TINYLM)")
    p.add_argument("--skip-96", action="store_true", help="rows only, no head_dim 96 comparison")
    p.add_argument("--work-dir", default=None, help="where model folders and files go (default: a temp dir)")
    p.add_argument("--json", default=os.path.join("benchmarks", "results", "calibration_architectures.json"))
    a = p.parse_args()
    rows = [archs.get(n) for n in a.only.split(",")] if a.only else list(archs.ARCHITECTURES)
    mixed = [r.name for r in rows if r.full_attention_layers is not None]
    if mixed:  # its statistics and candidates are indexed by model layer, one per layer
        raise SystemExit(f"calibration_architectures: {', '.join(mixed)} have layers other than full attention; "
                         f"this benchmark compares candidates on the all-full-attention rows")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work_dir or tmp
        os.makedirs(work, exist_ok=True)
        report = {"command": "python -m benchmarks.calibration_architectures"
                             + (f" --only {a.only}" if a.only else "") + f" --tokens {a.tokens}",
                  "device": "cpu", "threads": torch.get_num_threads(), "python": platform.python_version(),
                  "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                  "calibration": {"tokens": a.tokens, "seq_len": SEQ_LEN, "data": "python stdlib source",
                                  "variant": "U-H-P (default)", "clip": "none (default)"},
                  "proxy_data": "python stdlib test suite", "rows": []}
        for arch in rows:
            rec = row_result(arch, work, a.tokens, a.eval_tokens)
            report["rows"].append(rec)
            m = rec.get("proxy", {}).get("mean", {})
            print(f"{arch.name:<16} calibrate {'ok' if rec['calibrate_ok'] else 'REFUSED'} "
                  f"{rec['calibrate']['oscar']['seconds']:>5.1f}s file {'ok' if rec['file_ok'] else 'NOT OK'} "
                  + " ".join(f"{r} out_rel {m[r]['out_rel']:.4f}" for r in m), flush=True)
        if not a.skip_96:
            report["head_dim_96"] = head_dim_96(work, a.tokens, a.eval_tokens, a.real_model)
            for name, block in report["head_dim_96"]["evals"].items():
                print(f"== {name}")
                for n, m in block["mean"].items():
                    print(f"  {n:<32} logit_rel {m['logit_rel']:.4f} attn_kl {m['attn_kl']:.4f} "
                          f"out_rel {m['out_rel']:.4f}")
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
