"""Issue 29 section 1, simulator part: the INT2 quantiser candidates of
calibration.fidelity.quantizers on one model, through oscar-eval's fake-quantisation path.

    python -m benchmarks.quantizer_study --model /work/shared/models/tinylm-A \\
        --rotations /tmp/q29/tinylm-A.oscar.safetensors --device cpu --threads 2 \\
        --ppl-windows 8 --short-passkey-trials 4 --passkey-trials 20      # the CPU run recorded
    python -m benchmarks.quantizer_study ... --device cuda --ppl-windows 16 --passkey-trials 100   # GPU

1. Span of lloyd-max, tuned on calibration data only (rotated, clipped q, K, V of the model on
   stdlib windows: calibration.calibrate's text, file order seed ``--tune-seed``), keys and
   values apart, by two objectives, each a candidate of its own: ``lloyd-max`` minimises the
   mean over layers of the relative reconstruction MSE at the INT2 positions (sinks left out);
   ``lloyd-max-attn`` the mean over layers of the relative attention-output error with the
   serving read rule (sink, ring exact; only the tensor tuned quantised; queries every
   ATTN_QUERY_STRIDE positions of ATTN_WINDOWS windows).
2. oscar-eval (``--int2-parts kv-fake``, FakeInt2KVSim with the server's read rule) per
   candidate: ppl over ``--ppl-windows`` windows of 8k and passkey at 2k/4k
   (``--short-passkey-trials`` per depth) in one pass, passkey at 8k (``--passkey-trials`` per
   depth) in another; bf16 in each pass's first run. The same prompts for every candidate.
3. One JSON (``--out``): per candidate bytes per token and KV head, ppl, passkey, and paired
   comparisons (per-window NLL, per-prompt hits and first-token log-probabilities) against
   minmax (the default) and against bf16; written after every run, ``partial`` naming what is
   still missing. ``conclusion``, ``not_run`` and ``run_history`` notes already in ``--out`` are kept;
   ``--resume`` keeps its runs too and does only the missing ones.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

from benchmarks.targets import paired_gap
from calibration.fidelity import cli, quantizers

DEFAULT = quantizers.DEFAULT_QUANTIZER
# candidate -> (quantizer, lloyd-max span objective); minmax first: every candidate is paired against it
RUNS = {"minmax": ("minmax", None), "lloyd-max": ("lloyd-max", "mse"),
        "lloyd-max-attn": ("lloyd-max", "attention"), "per-channel-keys": ("per-channel-keys", None)}
CANDIDATES = tuple(RUNS)
SPAN_GRID = [round(1.0 + 0.05 * i, 2) for i in range(51)]  # 1.00 .. 3.50 sigma (MSE objective)
ATTN_SPAN_GRID = SPAN_GRID[:31:2]  # 1.0 .. 2.5 step 0.1 (attention objective; it rises past 1.7)
ATTN_WINDOWS = 2
ATTN_QUERY_STRIDE = 16
SHORT_LENGTHS = "2048,4096"
LONG_LENGTHS = "8192"
DEFAULT_OUT = "benchmarks/results/quantizer_study_tinylm-A.json"


def capture_rotated(model_dir: str, rot, device: str, tokens: int, seq_len: int, seed: int):
    """Rotated, clipped K and V [windows, H, T, D] and rotated q [windows, Hq, T, D] per layer on the
    calibration text (float32 model)."""
    from calibration import calibrate
    from calibration.capture import capture_attention
    from oscar_kernels.int2 import clip

    cfg = calibrate.CalibrationConfig(tokens=tokens, seq_len=seq_len, seed=seed, device=device,
                                      dtype="float32").resolved()
    model, tok = calibrate.load_model(model_dir, cfg.device, cfg.dtype)
    layers = [r.to(cfg.device) for r in rot.layers]
    ks, vs, qs = [[] for _ in layers], [[] for _ in layers], [[] for _ in layers]

    def grab(i, q, k, v, o):
        r = layers[i]
        kr = torch.einsum("bhtd,hde->bhte", k.float(), r.k_rot)
        vr = torch.einsum("bhtd,hde->bhte", v.float(), r.v_rot)
        ks[i].append(clip(kr, r.k_clip_min[:, None], r.k_clip_max[:, None]).cpu())
        vs[i].append(clip(vr, r.v_clip_min[:, None], r.v_clip_max[:, None]).cpu())
        rep = q.shape[1] // k.shape[1]
        qs[i].append(torch.einsum("bhtd,hde->bhte", q.float(), r.k_rot.repeat_interleave(rep, 0)).cpu())

    decoder = getattr(model, model.base_model_prefix, model)
    windows = 0
    with torch.no_grad(), capture_attention(model, grab):
        for w in calibrate.calibration_windows(tok, cfg):
            decoder(input_ids=w.unsqueeze(0).to(cfg.device), use_cache=False)
            windows += 1
    del model
    return [torch.cat(x) for x in ks], [torch.cat(x) for x in vs], [torch.cat(x) for x in qs], {
        "text": calibrate.text_sources.describe(None), "tokens": windows * seq_len, "windows": windows,
        "seq_len": seq_len, "file_order_seed": seed, "model_dtype": "float32"}


def per_channel_mse(keys: list[torch.Tensor], sink: int, page: int, scale_dtype) -> float:
    """Mean over layers of per-channel-keys' relative MSE on the INT2 positions of whole pages."""
    errs = []
    for x in keys:
        n, h, t, d = x.shape
        t = t // page * page
        pages = x[:, :, :t].reshape(n, h, t // page, page, d)
        exact = (torch.arange(t) < sink).view(t // page, page)
        out = torch.stack([quantizers.fake_per_channel(pages[:, :, i], scale_dtype, exact[i])
                           for i in range(t // page)], dim=2)
        keep = ~exact.reshape(-1)
        errs.append(quantizers.relative_mse(x[:, :, :t][:, :, keep], out.reshape(n, h, t, d)[:, :, keep]))
    return sum(errs) / len(errs)


def attention_curve(qs, ks, vs, tensor: str, group: int, spans, sink: int, recent: int, sdt) -> dict:
    """Per span (and for minmax), the mean over layers of ||O^ - O||^2 / ||O||^2 with only ``tensor``
    ("keys" or "values") quantised, read as the server reads (quantizers.attention_out_error)."""
    names = [*spans, "minmax"]
    per_layer = {s: [] for s in names}
    for q, k, v in zip(qs, ks, vs):
        n, hq, t, d = q.shape
        hkv, rep = k.shape[1], hq // k.shape[1]
        pos = torch.arange(t - 1, sink + recent, -ATTN_QUERY_STRIDE)
        err, tot = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        for w in range(min(n, ATTN_WINDOWS)):
            x = k[w] if tensor == "keys" else v[w]
            for g in range(hkv):
                qq = q[w, g * rep:(g + 1) * rep][:, pos].reshape(-1, d)
                ref = quantizers.attention_reference(qq, pos.repeat(rep), k[w, g], v[w, g], sink, recent, d ** -0.5)
                for s in names:
                    x_hat = (quantizers.fake_tokens(x[g], "minmax", group, sdt) if s == "minmax"
                             else quantizers.fake_lloyd_max(x[g], group, s, sdt))
                    e, r = quantizers.attention_out_error(qq, ref, v[w, g], x_hat if tensor == "keys" else None,
                                                          x_hat if tensor == "values" else None, d ** -0.5)
                    err[s] += e
                    tot[s] += r
        for s in names:
            per_layer[s].append(err[s] / tot[s])
    mean = {s: sum(v) / len(v) for s, v in per_layer.items()}
    return {"curve": [round(mean[s], 6) for s in spans], "minmax": round(mean["minmax"], 6)}


def tune_spans(a, rot) -> dict:
    """The lloyd-max spans (keys, values) of each objective on calibration data."""
    t0 = time.time()
    meta = rot.meta
    sdt = getattr(torch, meta.scale_dtype)
    ks, vs, qs, text = capture_rotated(a.model, rot, a.device, a.tune_tokens, a.tune_seq_len, a.tune_seed)
    ks_i, vs_i = [x[:, :, a.sink:] for x in ks], [x[:, :, a.sink:] for x in vs]
    curve_k = quantizers.span_curve(ks_i, meta.group_size, SPAN_GRID, sdt)
    curve_v = quantizers.span_curve(vs_i, meta.value_group_size, SPAN_GRID, sdt)
    best_k = SPAN_GRID[min(range(len(SPAN_GRID)), key=curve_k.__getitem__)]
    best_v = SPAN_GRID[min(range(len(SPAN_GRID)), key=curve_v.__getitem__)]
    mm = lambda xs, g: sum(quantizers.relative_mse(x, quantizers.fake_tokens(x, "minmax", g, sdt)) for x in xs) / len(xs)
    at = lambda curve, s: round(quantizers.span_curve(*curve, [s], sdt)[0], 6)
    argmin = lambda grid, c: grid[min(range(len(grid)), key=c.__getitem__)]
    attn = {}
    for tensor, group in (("keys", meta.group_size), ("values", meta.value_group_size)):
        c = attention_curve(qs, ks, vs, tensor, group, ATTN_SPAN_GRID, a.sink, a.recent, sdt)
        attn[tensor] = {"span": argmin(ATTN_SPAN_GRID, c["curve"]), **c}
    return {
        "objective": "mean over layers of ||x_hat - x||^2 / ||x||^2, x = the model's rotated, clipped K "
                     "(groups of the keys) or V (groups of the values) at every INT2 position (sink "
                     "positions left out) of calibration windows; span = argmin over the grid, keys and "
                     "values apart. Calibration text only: never the evaluation text. Used by lloyd-max",
        "data": text, "grid": SPAN_GRID,
        "keys": {"group_size": meta.group_size, "span": best_k, "curve": [round(x, 6) for x in curve_k],
                 "minmax": round(mm(ks_i, meta.group_size), 6),
                 "lloyd_max_outer_level": at((ks_i, meta.group_size), quantizers.LLOYD_MAX_LEVELS[1]),
                 "upstream_span": at((ks_i, meta.group_size), quantizers.UPSTREAM_SPAN),
                 "per_channel_keys": round(per_channel_mse(ks, a.sink, a.page_size, sdt), 6)},
        "values": {"group_size": meta.value_group_size, "span": best_v, "curve": [round(x, 6) for x in curve_v],
                   "minmax": round(mm(vs_i, meta.value_group_size), 6),
                   "lloyd_max_outer_level": at((vs_i, meta.value_group_size), quantizers.LLOYD_MAX_LEVELS[1]),
                   "upstream_span": at((vs_i, meta.value_group_size), quantizers.UPSTREAM_SPAN)},
        "span_in_units_of_lloyd_max_outer_level": {"keys": round(best_k / quantizers.LLOYD_MAX_LEVELS[1], 3),
                                                   "values": round(best_v / quantizers.LLOYD_MAX_LEVELS[1], 3)},
        "attention": {
            "objective": "mean over layers of ||O^ - O||^2 / ||O||^2, O = softmax(q k^T / sqrt(D)) v per KV "
                         "head and query head on calibration windows, only the tuned tensor quantised "
                         f"(lloyd-max), the serving read rule (sink {a.sink}, ring {a.recent} exact); queries "
                         f"every {ATTN_QUERY_STRIDE} positions of the first {ATTN_WINDOWS} windows. Used by "
                         "lloyd-max-attn",
            "grid": ATTN_SPAN_GRID, **attn,
            "span_in_units_of_lloyd_max_outer_level": {
                t: round(attn[t]["span"] / quantizers.LLOYD_MAX_LEVELS[1], 3) for t in attn}},
        "wall_s": round(time.time() - t0, 1),
    }


def run_spans(spans: dict, objective: str) -> tuple[float, float]:
    """(keys, values) span of a lloyd-max objective ("mse" or "attention")."""
    src = spans if objective == "mse" else spans["attention"]
    return src["keys"]["span"], src["values"]["span"]


def sign_test(x: list, ref: list) -> dict:
    """Windows where x is above / below ref and the exact two-sided sign-test p-value (ties dropped):
    robust to one window dominating the paired interval."""
    up = sum(a > b for a, b in zip(x, ref))
    down = sum(a < b for a, b in zip(x, ref))
    n = up + down
    tail = sum(math.comb(n, i) for i in range(min(up, down) + 1)) / 2 ** n if n else 1.0
    return {"windows_higher": up, "windows_lower": down, "sign_test_p": round(min(1.0, 2 * tail), 4)}


def _pair(x: list, ref: list) -> dict:
    gap, half = paired_gap(x, ref)
    return {"gap": round(gap, 4), "half_width_95": round(half, 4), "n": len(x),
            "significant": abs(gap) > half}


def summarise(runs: dict, spans: dict | None, bytes_table: dict) -> dict:
    """Per candidate: ppl, passkey and the paired comparisons of the runs done so far."""
    methods: dict = {}
    for res in runs.values():
        for name, r in res["methods"].items():
            m = methods.setdefault(name, {})
            for k, v in r.items():  # the passes' per-length dicts (passkey, hits, ...) merge
                m[k] = {**m[k], **v} if isinstance(v, dict) and isinstance(m.get(k), dict) else v
    out = {}
    ref, base = methods.get("bf16", {}), methods.get(DEFAULT, {})
    for name in ("bf16", *CANDIDATES):
        r = methods.get(name)
        if r is None:
            continue
        row: dict = {}
        if name != "bf16":
            row["quantizer"] = RUNS[name][0]
            row["bytes_per_token_per_head"] = bytes_table[name]
        if RUNS.get(name, (None, None))[1] and spans:
            row["span_sigma"] = dict(zip(("keys", "values"), run_spans(spans, RUNS[name][1])))
            row["span_objective"] = RUNS[name][1]
        if "ppl_8k" in r:
            row["ppl_8k"] = round(r["ppl_8k"], 5)
            if "ppl_8k" in ref:
                row["ppl_ratio_vs_bf16"] = round(r["ppl_8k"] / ref["ppl_8k"], 5)
            w, bw = r["ppl_detail"].get("nll_by_window"), base.get("ppl_detail", {}).get("nll_by_window")
            if name not in ("bf16", DEFAULT) and w and bw:
                p = _pair(w, bw)
                p["ppl_ratio_vs_minmax"] = round(math.exp(p["gap"]), 5)
                p.update(sign_test(w, bw))
                row["nll_paired_vs_minmax"] = p
        if "passkey" in r:
            row["passkey"] = {k: round(v, 4) for k, v in r["passkey"].items()}
            for label, other in (("bf16", ref), (DEFAULT, base)):
                if name in ("bf16", label) or "passkey_hits" not in other:
                    continue
                row[f"passkey_paired_vs_{label}"] = {n: _pair(h, other["passkey_hits"][n])
                                                     for n, h in r["passkey_hits"].items() if n in other["passkey_hits"]}
                row[f"first_token_logprob_paired_vs_{label}"] = {
                    n: _pair(h, other["passkey_first_token_logprobs"][n])
                    for n, h in r["passkey_first_token_logprobs"].items() if n in other["passkey_first_token_logprobs"]}
        out[name] = row
    return out


def verdict(cands: dict) -> dict:
    """Which candidates differ from minmax at paired 95% significance, and in which direction."""
    v = {}
    for name in CANDIDATES:
        row = cands.get(name)
        if name == DEFAULT or not row:
            continue
        notes = []
        p = row.get("nll_paired_vs_minmax")
        if p and p["significant"]:
            notes.append(f"ppl {'better' if p['gap'] < 0 else 'worse'} (NLL {p['gap']:+.4f} +- {p['half_width_95']})")
        elif p and p.get("sign_test_p", 1.0) < 0.05:
            notes.append(f"ppl {'better' if p['gap'] < 0 else 'worse'} by the sign test ({p['windows_higher']} of "
                         f"{p['windows_higher'] + p['windows_lower']} windows higher NLL, p = {p['sign_test_p']}; "
                         f"paired interval NLL {p['gap']:+.4f} +- {p['half_width_95']})")
        for n, q in row.get("passkey_paired_vs_minmax", {}).items():
            if q["significant"]:
                notes.append(f"passkey {n} {'better' if q['gap'] > 0 else 'worse'} ({q['gap']:+.3f} +- {q['half_width_95']})")
        v[name] = notes or ["no paired-significant difference from minmax"]
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rotations", required=True, help="the model's rotations file (oscar-calibrate)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    ap.add_argument("--batch", type=int, default=1, help="oscar-eval --batch")
    ap.add_argument("--sink", type=int, default=cli.DEFAULT_SINK_TOKENS)
    ap.add_argument("--recent", type=int, default=cli.DEFAULT_RECENT_WINDOW)
    ap.add_argument("--page-size", type=int, default=cli.DEFAULT_PAGE_SIZE, help="per-channel-keys' page")
    ap.add_argument("--ppl-windows", type=int, default=16)
    ap.add_argument("--passkey-trials", type=int, default=100, help="prompts per depth at 8k")
    ap.add_argument("--short-passkey-trials", type=int, default=None,
                    help="prompts per depth at 2k and 4k (default: --passkey-trials)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated subset")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --out (same settings assumed) and do only the missing ones")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="with --resume: also keep the runs of this earlier output of the same study "
                         "(repeatable; a study split over several invocations)")
    ap.add_argument("--summarise-only", action="store_true",
                    help="with --resume: run nothing, rewrite --out from the stored runs")
    ap.add_argument("--tune", action="store_true",
                    help="with --resume: tune the spans again even when every lloyd-max run is in --out")
    ap.add_argument("--tune-tokens", type=int, default=16384, help="calibration tokens for the span tuning")
    ap.add_argument("--tune-seq-len", type=int, default=2048)
    ap.add_argument("--tune-seed", type=int, default=1, help="calibration file order (the rotations: seed 0)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    cands = [c.strip() for c in a.candidates.split(",") if c.strip()]
    bad = [c for c in cands if c not in CANDIDATES]
    if bad or DEFAULT not in cands:
        raise SystemExit(f"quantizer_study: --candidates must be among {', '.join(CANDIDATES)} and include {DEFAULT}")
    if a.threads:
        torch.set_num_threads(a.threads)
    from oscar_kernels.contract.rotations_file import RotationsFileError, load_rotations
    try:
        rot = load_rotations(a.rotations)
    except (RotationsFileError, OSError) as e:
        raise SystemExit(f"quantizer_study: {e}")
    meta = rot.meta
    head_dim = rot.layers[0].k_rot.shape[-1]
    bytes_table = {n: quantizers.bytes_per_token_per_head(q, head_dim, meta.group_size, meta.value_group_size,
                                                          meta.scale_dtype, a.page_size) for n, (q, _) in RUNS.items()}
    old = {}
    if os.path.isfile(a.out):
        try:
            old = json.load(open(a.out))
        except (OSError, ValueError):
            old = {}
    keep = {k: v for k, v in old.items() if k in ("conclusion", "not_run", "run_history")}
    t0 = time.time()
    # on --resume the stored tuning stands when every lloyd-max run is stored in both passes
    spans = old.get("span_tuning") if a.resume else None
    lloyd = [c for c in cands if RUNS[c][1]]
    stored = [set(r["methods"]) for r in old.get("runs", {}).values()] if a.resume else []
    reuse = (spans is not None and len(stored) == 2 and all(c in m for c in lloyd for m in stored)
             and ("attention" in spans or "lloyd-max-attn" not in lloyd))
    if lloyd and (a.tune or not (reuse or (a.summarise_only and spans is not None))):
        spans = tune_spans(a, rot)
        print(f"quantizer_study: lloyd-max spans (keys, values): mse {run_spans(spans, 'mse')}, attention "
              f"{run_spans(spans, 'attention')} ({spans['wall_s']} s)", file=sys.stderr, flush=True)
    short = a.passkey_trials if a.short_passkey_trials is None else a.short_passkey_trials
    # the 8k pass first: it decides, and a run cut by its time limit keeps it
    passes = {"long": (0, a.passkey_trials, LONG_LENGTHS), "ppl_and_short": (a.ppl_windows, short, SHORT_LENGTHS)}
    todo = [(p, q) for p in passes for q in cands]
    runs: dict = {}
    done = set()
    if (a.merge or a.summarise_only) and not a.resume:
        raise SystemExit("quantizer_study: --merge and --summarise-only need --resume")
    stored_runs = [old.get("runs", {})]
    for path in a.merge:
        try:
            stored_runs.append(json.load(open(path)).get("runs", {}))
        except (OSError, ValueError) as e:
            raise SystemExit(f"quantizer_study: --merge {path}: {e}")
    for path_runs in stored_runs if a.resume else []:
        for p, r in path_runs.items():
            for name, m in r["methods"].items():
                argv_used = r.get("per_method_argv", {}).get(name)
                if name in RUNS and RUNS[name][1]:
                    want = ",".join(str(x) for x in run_spans(spans, RUNS[name][1]))
                    if argv_used:
                        used = argv_used[argv_used.index("--lloyd-max-span") + 1]
                    else:  # a run written before per_method_argv: its spans are the file's MSE tuning
                        used = ",".join(str(x) for x in run_spans(old["span_tuning"], "mse"))
                    if used != want:
                        raise SystemExit(f"quantizer_study: --resume: {name}'s stored run used spans other than "
                                         f"today's tuning ({want}); rerun without --resume")
                if name == "bf16" or name in cands:
                    runs.setdefault(p, {"settings": r["settings"], "methods": {}, "per_method_argv": {}})
                    runs[p]["methods"][name] = m
                    runs[p]["per_method_argv"][name] = argv_used
                    done.add((p, name))
    result = {}

    def write(done):
        missing = [f"{p}:{q}" for p, q in todo if (p, q) not in done]
        missing += [f"{p}:bf16" for p in passes if (p, "bf16") not in done]
        cand_rows = summarise(runs, spans, bytes_table)
        result.update({
            "study": "issue 29 section 1 (simulator): INT2 quantiser candidates at <= the default's bytes per "
                     "token and KV head",
            "path": "fake quantisation (calibration.fidelity.sim_cache.FakeInt2KVSim via oscar-eval --int2-parts "
                    "kv-fake --quantizer Q, the server's read rule: BF16 sink and ring, INT2 history), not the "
                    "server's kernels",
            "model": os.path.basename(os.path.normpath(a.model)),
            "settings": {"rotations": os.path.abspath(a.rotations), "recipe": meta.recipe,
                         "calib_data": meta.calib_data, "key_group_size": meta.group_size,
                         "value_group_size": meta.value_group_size, "scale_dtype": meta.scale_dtype,
                         "sink": a.sink, "recent": a.recent, "page_size": a.page_size, "device": a.device,
                         "threads": torch.get_num_threads(), "batch": a.batch,
                         "ppl": f"{a.ppl_windows} windows of 8192 tokens (held-out sympy/networkx)",
                         "passkey_prompts_per_length": {L: short * 3 for L in SHORT_LENGTHS.split(",")}
                         | {LONG_LENGTHS: a.passkey_trials * 3},
                         "passkey_trials_per_depth": {"2048,4096": short, "8192": a.passkey_trials},
                         "passkey_prompts_note": "2k/4k prompts and 8k prompts come from two oscar-eval passes "
                                                 "(each its own seeded prompt draw), identical for every candidate",
                         "paired_interval": "mean difference over the same prompts (or ppl windows) +- 1.96 "
                                            "sample sd / sqrt(n) (benchmarks.targets.paired_gap)",
                         "argv": sys.argv[1:] if argv is None else list(argv)},
            "bytes_per_token_per_head": bytes_table,
            "span_tuning": spans,
            "candidates": cand_rows,
            "candidate_notes": {
                "minmax": "today's default: per token, keys in groups of the keys, values of the values, "
                          "min and (max - min) / 3 in the scale dtype, nearest code",
                "lloyd-max": "per token and group: Gaussian Lloyd-Max codes (thresholds 0, +-0.9816 sigma) on "
                             "the stored uniform grid of outer levels +-span sigma (span: the reconstruction-"
                             "MSE objective on calibration data)",
                "lloyd-max-attn": "lloyd-max with the span of the attention-output objective on calibration data",
                "per-channel-keys": f"keys: one (scale, min) per channel per page of {a.page_size} tokens "
                                    "(sinks out of the range), quantised when the page is complete; values as "
                                    "minmax"},
            "verdict_vs_minmax": verdict(cand_rows),
            "partial": missing,
            "wall_s_this_invocation": round(time.time() - t0, 1),
            **keep,
            "runs": runs,
        })
        cli._write(a.out, result)

    with tempfile.TemporaryDirectory() as tmp:
        for p, name in todo:
            if (p, name) in done or a.summarise_only:
                continue
            windows, trials, lengths = passes[p]
            q, objective = RUNS[name]
            out = os.path.join(tmp, f"{p}_{name}.json")
            run_argv = ["--model", a.model, "--method", f"{name}={a.rotations}", "--int2-parts", "kv-fake",
                        "--quantizer", q, "--device", a.device, "--batch", str(a.batch),
                        "--sink", str(a.sink), "--recent", str(a.recent), "--page-size", str(a.page_size),
                        "--ppl-windows", str(windows), "--passkey-trials", str(trials), "--lengths", lengths,
                        "--out", out]
            run_argv += ["--threads", str(a.threads)] if a.threads else []
            if objective:
                run_argv += ["--lloyd-max-span", ",".join(str(x) for x in run_spans(spans, objective))]
            if (p, "bf16") in done:
                run_argv += ["--no-bf16"]
            if cli.main(run_argv) != 0:
                raise SystemExit(f"quantizer_study: oscar-eval failed: {' '.join(run_argv)}")
            res = json.load(open(out))
            r = runs.setdefault(p, {"settings": res["settings"], "methods": {}, "per_method_argv": {}})
            r["methods"].update(res["methods"])
            for m in res["methods"]:
                r["per_method_argv"][m] = run_argv
                done.add((p, m))
            write(done)
    write(done)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
