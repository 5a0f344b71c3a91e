"""Issue 29 section 1, simulator part: the INT2 quantiser candidates of
calibration.fidelity.quantizers on one model, through oscar-eval's fake-quantisation path.

    python -m benchmarks.quantizer_study --model /work/shared/models/tinylm-A \\
        --rotations tinylm-A.oscar.safetensors --device cuda --batch 8 \\
        --ppl-windows 16 --short-passkey-trials 20 --passkey-trials 100      # the GPU run recorded

1. oscar-eval (``--int2-parts kv-fake``, FakeInt2KVSim with the server's read rule) per
   candidate: passkey at 8k (``--passkey-trials`` per depth) in one pass, then ppl over
   ``--ppl-windows`` windows of 8k and passkey at 2k/4k (``--short-passkey-trials`` per depth)
   in another; bf16 in each pass's first run. The same prompts for every candidate.
2. One JSON (``--out``): per candidate bytes per token and KV head, ppl, passkey, and paired
   comparisons (per-window NLL, per-prompt hits and first-token log-probabilities) against
   minmax (the default) and against bf16; written after every run, ``partial`` naming what is
   still missing. ``conclusion``, ``not_run`` and ``run_history`` notes already in ``--out`` are kept;
   ``--resume`` keeps its runs too and does only the missing ones.

The Lloyd-Max candidates and their span tuning on calibration data lost and were removed after
fd68a90 (git show fd68a90:benchmarks/quantizer_study.py); their rows are in
benchmarks/results/quantizer_study_tinylm-A.json as recorded then.
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
CANDIDATES = quantizers.QUANTIZERS  # minmax first: every candidate is paired against it
SHORT_LENGTHS = "2048,4096"
LONG_LENGTHS = "8192"
DEFAULT_OUT = "benchmarks/results/quantizer_study_tinylm-A.json"


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


def summarise(runs: dict, bytes_table: dict) -> dict:
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
            row["bytes_per_token_per_head"] = bytes_table[name]
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
                if "passkey_first_token_logprobs" in r:  # oscar-eval records them, the server does not
                    row[f"first_token_logprob_paired_vs_{label}"] = {
                        n: _pair(h, other["passkey_first_token_logprobs"][n])
                        for n, h in r["passkey_first_token_logprobs"].items()
                        if n in other["passkey_first_token_logprobs"]}
        out[name] = row
    return out


def server_runs(paths: list[str]) -> dict:
    """benchmarks.server_fidelity outputs as one run in summarise's shape: their methods named
    bf16 or after a candidate (others are left out); a method in several files from the last."""
    methods, sources = {}, {}
    for path in paths:
        try:
            data = json.load(open(path))
        except (OSError, ValueError) as e:
            raise SystemExit(f"quantizer_study: --server {path}: {e}")
        for name, m in data.get("methods", {}).items():
            if name != "bf16" and name not in CANDIDATES:  # e.g. other rotations in the same file
                continue
            row = {"passkey": m["passkey"], "passkey_hits": m["passkey_hits"]}
            if "ppl_8k" in m:
                row |= {"ppl_8k": m["ppl_8k"], "ppl_detail": {"nll_by_window": m.get("nll_by_window")}}
            methods[name], sources[name] = row, {"file": path, "server_cmd": m.get("server_cmd"),
                                                 "key_pages": m.get("key_pages", False)}
    return {"server": {"methods": methods, "sources": sources}}


def add_server_results(out: str, paths: list[str]) -> int:
    """--server: the candidates through the server, paired like the simulator's, into out's
    through_server (bytes per token from out's simulator rows)."""
    try:
        data = json.load(open(out))
    except (OSError, ValueError) as e:
        raise SystemExit(f"quantizer_study: --out {out} holds no study to add server results to: {e}")
    served = server_runs(paths)
    rows = summarise(served, data["bytes_per_token_per_head"])
    data["through_server"] = {
        "path": "SGLang 0.5.17 + oscar-sglang servers (benchmarks.server_fidelity, chunked prefill 1024): the "
                "server's store, decode and extend kernels",
        "candidates": rows, "verdict_vs_minmax": verdict(rows), "sources": served["server"]["sources"]}
    cli._write(out, data)
    print(out)
    return 0


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
    ap.add_argument("--model")
    ap.add_argument("--rotations", help="the model's rotations file (oscar-calibrate)")
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
    ap.add_argument("--server", action="append", default=[], metavar="JSON",
                    help="runs nothing: benchmarks.server_fidelity output(s) with the candidates through the "
                         "server (repeatable) go into --out's through_server, the rest of --out unchanged")
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    if a.server:
        return add_server_results(a.out, a.server)
    if not (a.model and a.rotations):
        raise SystemExit("quantizer_study: --model and --rotations are required (or --server)")
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
    bytes_table = {n: quantizers.bytes_per_token_per_head(n, head_dim, meta.group_size, meta.value_group_size,
                                                          meta.scale_dtype, a.page_size) for n in CANDIDATES}
    old = {}
    if os.path.isfile(a.out):
        try:
            old = json.load(open(a.out))
        except (OSError, ValueError):
            old = {}
    keep = {k: v for k, v in old.items() if k in ("conclusion", "not_run", "run_history")}
    through_server = {"through_server": old["through_server"]} if "through_server" in old else {}
    t0 = time.time()
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
                if name == "bf16" or name in cands:
                    runs.setdefault(p, {"settings": r["settings"], "methods": {}, "per_method_argv": {}})
                    runs[p]["methods"][name] = m
                    runs[p]["per_method_argv"][name] = argv_used
                    done.add((p, name))
    result = {}

    def write(done):
        missing = [f"{p}:{q}" for p, q in todo if (p, q) not in done]
        missing += [f"{p}:bf16" for p in passes if (p, "bf16") not in done]
        cand_rows = summarise(runs, bytes_table)
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
            "candidates": cand_rows,
            "candidate_notes": {
                "minmax": "today's default: per token, keys in groups of the keys, values of the values, "
                          "min and (max - min) / 3 in the scale dtype, nearest code",
                "per-channel-keys": f"keys: one (scale, min) per channel per page of {a.page_size} tokens "
                                    "(sinks out of the range), quantised when the page is complete; values as "
                                    "minmax"},
            "verdict_vs_minmax": verdict(cand_rows),
            **through_server,
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
            out = os.path.join(tmp, f"{p}_{name}.json")
            run_argv = ["--model", a.model, "--method", f"{name}={a.rotations}", "--int2-parts", "kv-fake",
                        "--quantizer", name, "--device", a.device, "--batch", str(a.batch),
                        "--sink", str(a.sink), "--recent", str(a.recent), "--page-size", str(a.page_size),
                        "--ppl-windows", str(windows), "--passkey-trials", str(trials), "--lengths", lengths,
                        "--out", out]
            run_argv += ["--threads", str(a.threads)] if a.threads else []
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
