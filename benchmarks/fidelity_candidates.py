"""Issue 46, deliverable 2, in simulation: what closes the real model's fidelity gap at (about) the
same bytes per token. Every candidate is one ``oscar-eval`` run on the same held-out windows, and
its per-window NLL is paired with the default's (S 16, W 128, keys INT2 group 16, values group 64,
fp8 scales and mins: 42 B per token and KV head at head_dim 64, through the kernels' numerics).

    python -m benchmarks.fidelity_candidates --model /tmp/smol --rot-dir /tmp/rot \\
        --ppl-len 2048 --ppl-windows 16 [--only default,g8,...] [--jobs 2] \\
        --model-name SmolLM2-135M-Instruct \\
        --reference benchmarks/results/history/fidelity_smollm2_cpu_2k4k_2026-12-07.json

(the results file's 2k rows: every candidate at 2048 but ``tiny-layers-74``; its 4k rows: ``--ppl-len 4096 --only
g8,kivi16-fp8,clip-layer,W512,g8-clip-layer,g4,debias,layers-42,layers-44,layers-46``, the default at 4k taken from
``--reference``, the same windows; tinylm-A's file, ``study_candidates_tinylm-A.json``: ``--model .../tinylm-A
--rot-prefix tiny_ --ppl-len 8192 --only default,tiny-layers-74 --work /tmp/fidelity_candidates_tiny``).

Runs land in ``--work`` as ``RUN_LEN.json`` and are reused when their oscar-eval arguments match
(so a later call can add a length or a candidate); the study is rebuilt from every run found
there into ``--out``. Candidates (``CANDIDATES``):

- ``default`` (with bf16): today's layout through the kernels (HybridKVSim);
- ``W256`` / ``W512`` / ``S64``: a larger BF16 recent window or more BF16 sinks (flags only);
- ``g8``: key groups of 8 channels (rotations file ``*_oscar_g8``, 50 B);
- ``fake``: today's layout in PyTorch fake quantisation (``--int2-parts kv-fake``), the baseline
  the simulator-only candidates are also paired with;
- ``kivi64-*``: keys KIVI-style (``--key-channel-page 64``: one scale and min per rotated channel
  over each 64-position page), with fp8 or fp16 page scales, and with the bytes saved spent on
  finer value groups; ``kivi64-naive-fp16``: the same keys without the rotation (KIVI as published,
  values per token as the naive file stores them); ``kivi16-fp8`` / ``kivi32-fp16``: shorter pages, the bytes spent on the keys;
- ``clip-layer``: the rotations recalibrated with per-layer clipping (``oscar-calibrate --device cpu
  --group-size 16 --value-group-size 64 --clip layer --clip-objective attn --clip-skip-first 16``,
  otherwise the defaults of ``*_oscar``), stored as ``*_oscar_cliplayer``; ``clip-head`` the same with
  ``--clip head`` (``*_oscar_cliphead``), ``g8-clip-layer`` with ``--group-size 8`` (``*_oscar_g8_cliplayer``);
- ``tok131k``: the default recipe on 131,072 calibration tokens (``--tokens 131072``, ``*_oscar_tok131k``);
- ``bf16-L<a>-<b>``: attribution, layers a..b keep K/V in BF16 (``oscar-eval --bf16-layers``), the rest the default;
- ``bf16-H<h>``: attribution, KV head h keeps K/V in BF16 in every layer (``oscar-eval --bf16-kv-heads``);
- ``layers-42`` / ``-44`` / ``-46``: key groups per layer (``oscar-eval --layer-rotations``: those layers take the
  rotations of ``*_oscar_g8`` or ``*_oscar_g32``, ``oscar-calibrate --group-size 32 --value-group-size 64``),
  chosen by ``benchmarks.layer_layout`` on the calibration text's per-layer attention KL
  (``benchmarks/results/layer_proxy_smollm2.json``: ``oscar-calibrate proxy --calib-text --tokens 16384 --sink 16
  --recent 128`` over the g16, g8, g4 and g32 files) for a mean of 42 B, +5% and +10%; ``layers-42-up`` / ``-down``
  its finer or its coarser layers alone;
- ``tiny-layers-74`` (tinylm-A, ``--rot-prefix tiny_``, files ``tiny_oscar_g16`` / ``_g64`` calibrated with
  ``--group-size 16`` / ``64 --value-group-size 128``): its own proxy's layout at its default's 74 B.

Bytes per token and KV head: codes (D/4 each for K and V) + per-token group scales and mins, or for
per-channel key pages 2 D scale bytes / P amortised over the page's P tokens. BF16 bytes: the ring
(W positions) per running request and the sinks (S) per sequence, K and V, all layers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from benchmarks.server_harness import ROOT, save_json
from benchmarks.targets import bf16_bytes_per_position, window_gap as _gap
from oscar_kernels.contract.layout import SCALE_DTYPE_BYTES, group_bytes

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "study_candidates_smollm2.json")  # not fidelity_*.json: report.render_fidelity takes those
DEFAULT_WORK = "/tmp/fidelity_candidates"
FP8 = "float8_e4m3fn"

# name: (rotations file stem, oscar-eval arguments, what it changes)
CANDIDATES = {
    "default": ("oscar", [], "today's default: S 16, W 128, keys INT2 g{group_size}, values g{value_group_size}, "
                             "fp8 scales (kernels)"),  # the groups: the default run's rotations file's
    "W256": ("oscar", ["--recent", "256"], "BF16 recent window W 256"),
    "W512": ("oscar", ["--recent", "512"], "BF16 recent window W 512"),
    "S64": ("oscar", ["--sink", "64"], "64 BF16 sinks"),
    "g8": ("oscar_g8", [], "key groups of 8 channels (rotations calibrated for g8)"),
    "fake": ("oscar", ["--int2-parts", "kv-fake"], "the default in PyTorch fake quantisation (baseline of the "
                                                  "simulator-only rows)"),
    "kivi64-fp8": ("oscar", ["--int2-parts", "kv-fake", "--key-channel-page", "64"],
                   "keys per channel over 64-position pages (KIVI), fp8 page scales"),
    "kivi64-fp16": ("oscar", ["--int2-parts", "kv-fake", "--key-channel-page", "64", "--key-page-scale-dtype",
                              "float16"], "keys per channel over 64-position pages (KIVI), fp16 page scales"),
    "kivi64-fp16-v32": ("oscar", ["--int2-parts", "kv-fake", "--key-channel-page", "64", "--key-page-scale-dtype",
                                  "float16", "--value-groups", f"32:{FP8}"],
                        "KIVI keys (fp16 page scales) + value groups of 32"),
    "kivi64-fp8-v16": ("oscar", ["--int2-parts", "kv-fake", "--key-channel-page", "64", "--value-groups", f"16:{FP8}"],
                       "KIVI keys (fp8 page scales) + value groups of 16"),
    "kivi64-naive-fp16": ("naive", ["--int2-parts", "kv-fake", "--key-channel-page", "64", "--key-page-scale-dtype",
                                    "float16"], "KIVI as published: no rotation (the naive file), keys per channel "
                                                "over 64-position pages, fp16 page scales"),
    "kivi16-fp16": ("oscar", ["--int2-parts", "kv-fake", "--key-channel-page", "16", "--key-page-scale-dtype",
                              "float16"], "keys per channel over 16-position pages, fp16 page scales (50 B, as g8)"),
    "clip-layer": ("oscar_cliplayer", [], "per-layer clip thresholds chosen on the attention error (oscar-calibrate "
                                         "--clip layer --clip-objective attn --clip-skip-first 16)"),
    "clip-head": ("oscar_cliphead", [], "per-head clip thresholds chosen on the attention error (--clip head)"),
    "g8-clip-layer": ("oscar_g8_cliplayer", [], "key groups of 8 and per-layer clip (--group-size 8 --clip layer)"),
    "tok131k": ("oscar_tok131k", [], "rotations calibrated on 131,072 tokens of the same text (default 32,768)"),
    "kivi16-fp8": ("oscar", ["--int2-parts", "kv-fake", "--key-channel-page", "16"],
                   "keys per channel over 16-position pages, fp8 page scales (the bytes spent on the keys)"),
    "kivi32-fp16": ("oscar", ["--int2-parts", "kv-fake", "--key-channel-page", "32", "--key-page-scale-dtype",
                              "float16"], "keys per channel over 32-position pages, fp16 page scales"),
    "g4": ("oscar_g4", [], "key groups of 4 channels (rotations calibrated for g4): the frontier at +57% bytes"),
    "debias": ("oscar", ["--key-debias", "1"], "the INT2 keys' logit debias (--oscar-key-debias on), kernels"),
    "g8-debias": ("oscar_g8", ["--key-debias", "1"], "key groups of 8 and the key debias"),
}
# attribution: one block of five layers keeps its K/V in BF16, the rest the default; what each block
# gives back of the default's loss is that block's share of it (SmolLM2's 30 layers)
CANDIDATES.update({f"bf16-L{lo}-{lo + 4}": ("oscar", ["--bf16-layers", f"{lo}-{lo + 4}"],
                                            f"attribution: layers {lo}-{lo + 4} keep K/V in BF16")
                   for lo in range(0, 30, 5)})
# ... and per KV head: one KV head keeps its K/V in BF16 in every layer (SmolLM2's 3 KV heads)
CANDIDATES.update({f"bf16-H{h}": ("oscar", ["--bf16-kv-heads", str(h)],
                                  f"attribution: KV head {h} keeps K/V in BF16 in every layer") for h in range(3)})
# key groups per layer (benchmarks.layer_layout over layer_proxy_smollm2.json: the attention KL of each
# layer at key groups 32 / 16 / 8 / 4 on the calibration text, S 16, W 128), values g64 everywhere
_LAYOUTS = {42: ([7, 14, 18, 20], [0, 1, 6, 10, 11, 12, 13, 25]),
            44: ([6, 7, 8, 10, 14, 18, 20, 23], [25]),
            46: ([3, 5, 6, 7, 8, 9, 10, 14, 15, 17, 18, 20, 21, 22, 23, 24], [25])}
CANDIDATES.update({
    f"layers-{b}": ("oscar", ["--layer-rotations", ("oscar_g8", g8), "--layer-rotations", ("oscar_g32", g32)],
                    f"key groups per layer for a mean of {b} B, chosen on the calibration text's per-layer "
                    f"attention KL (benchmarks.layer_layout): g8 at layers {','.join(map(str, g8))}, g32 at "
                    f"{','.join(map(str, g32))}, g16 elsewhere")
    for b, (g8, g32) in _LAYOUTS.items()})
# what carries the same-bytes layout: its finer layers alone (43.1 B), its coarser layers alone (40.9 B)
CANDIDATES.update({
    "layers-42-up": ("oscar", ["--layer-rotations", ("oscar_g8", _LAYOUTS[42][0])],
                     "layers-42's g8 layers alone (g16 elsewhere)"),
    "layers-42-down": ("oscar", ["--layer-rotations", ("oscar_g32", _LAYOUTS[42][1])],
                       "layers-42's g32 layers alone (g16 elsewhere)"),
})
# tinylm-A (--rot-prefix tiny_: default key groups 32, values 128 at head_dim 128, 74 B): the same
# knapsack on its own proxy (layer_proxy_tinylm-A.json) over files calibrated for key groups 16 / 32 / 64
TINY_LAYOUT = {"oscar_g16": [5, 7], "oscar_g64": [1, 2, 4, 6]}
CANDIDATES["tiny-layers-74"] = (
    "oscar", [x for stem, layers in TINY_LAYOUT.items() for x in ("--layer-rotations", (stem, layers))],
    "tinylm-A: key groups per layer for its default's 74 B, chosen on the calibration text's per-layer attention KL: "
    "g16 at layers 5,7, g64 at 1,2,4,6, g32 elsewhere")
FAKE = {"fake"}  # candidates paired also with the fake default: the simulator-only ones


def _csv(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _rot_file(a, stem: str) -> str:
    return f"{os.path.join(a.rot_dir, a.rot_prefix + stem)}.safetensors"


def eval_argv(name: str, a, length: int) -> list[str]:
    """oscar-eval's arguments; a ``(stem, layers)`` in a candidate's arguments names those layers'
    rotations file (``--layer-rotations FILE:LAYERS``)."""
    stem, extra, _ = CANDIDATES[name]
    extra = [f"{_rot_file(a, x[0])}:{','.join(map(str, x[1]))}" if isinstance(x, tuple) else x for x in extra]
    argv = ["--model", a.model, "--method", f"oscar={_rot_file(a, stem)}"]
    if name != "default":
        argv.append("--no-bf16")
    return argv + extra + ["--ppl-len", str(length), "--ppl-windows", str(a.ppl_windows), "--passkey-trials", "0",
                           "--threads", str(a.threads)] + (["--device", a.device] if getattr(a, "device", None) else [])


def run_path(a, name: str, length: int) -> str:
    return os.path.join(a.work, f"{name}_{length}.json")


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _same_argv(done: dict | None, argv: list[str]) -> bool:
    """A finished run whose oscar-eval arguments (but --out) are ``argv``."""
    if not done or "wall_s" not in done.get("settings", {}):
        return False
    old = done["settings"].get("argv", [])
    if "--out" in old:
        i = old.index("--out")
        old = old[:i] + old[i + 2:]
    return old == argv


def run_one(a, name: str, length: int) -> str:
    argv, path = eval_argv(name, a, length), run_path(a, name, length)
    if _same_argv(_load(path), argv):
        return f"{name} {length}: reused {path}"
    rots = [argv[argv.index("--method") + 1].partition("=")[2]]
    rots += [argv[i + 1].rpartition(":")[0] for i, x in enumerate(argv) if x == "--layer-rotations"]
    for rot in rots:
        if not os.path.isfile(rot):
            return f"{name} {length}: skipped, no rotations file {rot}"
    cmd = [sys.executable, "-m", "calibration.fidelity.cli", *argv, "--out", path]
    with open(path + ".log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if rc:
        raise SystemExit(f"fidelity_candidates: {name} at {length} failed (rc {rc}), see {path}.log")
    return f"{name} {length}: {_load(path)['settings']['wall_s']} s"


def bytes_of(settings: dict, head_dim: int, num_kv_heads: int | None = None) -> dict:
    """Bytes per token and KV head of a run's layout, keys and values apart: its INT2 layout, or the
    mean over the layers where they differ (``layer_groups`` of --layer-rotations; BF16 layers of
    --bf16-layers at 2 x head_dim bytes each for K and V); with --bf16-kv-heads, the mean over the
    ``num_kv_heads`` heads, those at 2 x head_dim bytes each for K and V."""
    heads = settings.get("bf16_kv_heads") or ()
    if heads:
        if not num_kv_heads:
            raise ValueError("BF16 KV heads: need the model's KV head count")
        int2 = bytes_of({k: v for k, v in settings.items() if k != "bf16_kv_heads"}, head_dim)
        share = len(heads) / num_kv_heads
        out = {k: (1 - share) * int2[k] + share * 2 * head_dim for k in ("key_bytes", "value_bytes")}
        return {**int2, **out, "bytes_per_token_head": out["key_bytes"] + out["value_bytes"],
                "bf16_kv_heads": list(heads)}
    rot = next(iter(settings["rotations"].values()))
    groups, bf16 = rot.get("layer_groups"), set(settings.get("bf16_layers", ()))
    if groups or bf16:
        if not groups or settings.get("value_groups") or settings.get("key_channel_page"):
            raise ValueError("per-layer bytes: need the run's layer_groups and per-token groups of the rotations files")
        per = [{"key_bytes": 2 * head_dim, "value_bytes": 2 * head_dim} if i in bf16 else
               bytes_of({"rotations": {"r": {"scale_dtype": rot["scale_dtype"], "group_size": gk,
                                             "value_group_size": gv}}}, head_dim)
               for i, (gk, gv) in enumerate(groups)]
        keys, values = (sum(p[k] for p in per) / len(per) for k in ("key_bytes", "value_bytes"))
        where = {}
        for i, (gk, gv) in enumerate(groups):
            where.setdefault("BF16" if i in bf16 else f"keys g{gk}, values g{gv}", []).append(i)
        desc = "; ".join(f"{k}: layers {','.join(map(str, v))}" for k, v in where.items())
        return {"bytes_per_token_head": keys + values, "key_bytes": keys, "value_bytes": values, "key_layout": f"per layer ({desc}), {rot['scale_dtype']} scale and min",
                "value_layout": "per layer, as the keys", "layers": where}
    dt = rot["scale_dtype"]
    vg = settings.get("value_groups") or {"group_size": rot["value_group_size"], "scale_dtype": dt}
    values = group_bytes(head_dim, vg["group_size"], vg["scale_dtype"])
    page = settings.get("key_channel_page")
    if page:
        keys = head_dim // 4 + 2 * head_dim * SCALE_DTYPE_BYTES[page["scale_dtype"]] / page["page"]
        key_layout = f"per channel over {page['page']}-position pages, {page['scale_dtype']} scale and min"
    else:
        keys = group_bytes(head_dim, rot["group_size"], dt)
        key_layout = f"per token, groups of {rot['group_size']} channels, {dt} scale and min"
    return {"bytes_per_token_head": keys + values, "key_bytes": keys, "value_bytes": values,
            "key_layout": key_layout, "value_layout": f"per token, groups of {vg['group_size']} channels, "
                                                      f"{vg['scale_dtype']} scale and min"}


def reference_runs(path: str, default_runs: dict) -> dict:
    """{length: run} of bf16 and the default from an earlier oscar-eval output (``--reference``) for the
    lengths no default run in --work has; refused unless its layout, S, W, chunk and windows are the
    default's, and its per-window NLL equals the default run's at every length both have."""
    ref = _load(path)
    if not ref or not {"bf16", "oscar"} <= set(ref.get("methods", {})):
        raise SystemExit(f"fidelity_candidates: --reference {path}: no oscar-eval output with bf16 and oscar")
    st, mine = ref["settings"], next(iter(default_runs.values()))["settings"]
    keys = ("sink", "recent", "chunk", "ppl_windows", "group_size", "value_group_size", "int2_parts", "decode_tail")
    if any(st.get(k) != mine.get(k) for k in keys) or st["rotations"]["oscar"]["file"] != mine["rotations"]["oscar"]["file"]:
        raise SystemExit(f"fidelity_candidates: --reference {path}: other settings than the default run's")
    out = {}
    for n in ref["methods"]["oscar"].get("ppl_details", {}):
        if n in default_runs:
            for m in ("bf16", "oscar"):
                if ref["methods"][m]["ppl_details"][n]["nll_by_window"] != \
                        default_runs[n]["methods"][m]["ppl_details"][n]["nll_by_window"]:
                    raise SystemExit(f"fidelity_candidates: --reference {path}: {m} at {n} differs from the default run")
        else:
            out[n] = {"model": ref["model"], "settings": {**st, "argv": st.get("argv"), "reference": path},
                      "methods": {m: {"ppl_details": {n: ref["methods"][m]["ppl_details"][n]},
                                      "agreement": {k: v for k, v in ref["methods"][m].get("agreement", {}).items()
                                                    if k == n}} for m in ("bf16", "oscar")}}
    return out


def study(a, shape: dict) -> dict:
    """Every finished run in --work, paired by window with bf16, the default and (fake rows) fake."""
    layers, heads, d = shape["num_layers"], shape["num_kv_heads"], shape["head_dim"]
    per_position = bf16_bytes_per_position(layers, heads, d)
    runs = {}
    for name in CANDIDATES:
        for f in sorted(os.listdir(a.work)) if os.path.isdir(a.work) else []:
            if f.startswith(name + "_") and f.endswith(".json") and f[len(name) + 1:-5].isdigit():
                data = _load(os.path.join(a.work, f))
                if data and "wall_s" in data.get("settings", {}) and data["settings"].get("ppl_windows") == a.ppl_windows:
                    runs.setdefault(name, {})[f[len(name) + 1:-5]] = data
    if "default" not in runs:
        raise SystemExit("fidelity_candidates: no finished default run (with bf16) to pair with")
    if getattr(a, "reference", None):
        runs["default"].update(reference_runs(a.reference, runs["default"]))
    ref = {n: r["methods"]["bf16"]["ppl_details"][n] for n, r in runs["default"].items()}
    base = {n: r["methods"]["oscar"]["ppl_details"][n] for n, r in runs["default"].items()}
    fake = {n: r["methods"]["oscar"]["ppl_details"][n] for n, r in runs.get("fake", {}).items()}
    rows = {}
    for name, by_len in runs.items():
        st = next(iter(by_len.values()))["settings"]
        rot = next(iter(st["rotations"].values()))
        changes = CANDIDATES[name][2].format(**rot) if name == "default" else CANDIDATES[name][2]
        row = {"changes": changes, "int2_parts": st.get("int2_parts"), "sink": st["sink"],
               "recent": st["recent"], **bytes_of(st, d, heads),
               "ring_bytes_per_request": st["recent"] * per_position, "sink_bytes_per_sequence": st["sink"] * per_position,
               "rotations": os.path.basename(next(iter(st["rotations"].values()))["file"]), "ppl": {}}
        for n, data in sorted(by_len.items(), key=lambda kv: int(kv[0])):
            m = data["methods"]["oscar"]
            p = m["ppl_details"][n]
            w = p["nll_by_window"]
            cell = {"ppl": round(p["ppl"], 5), "windows": p["windows"], "wall_s": m.get("wall_s")}
            if data["settings"].get("reference"):
                cell["from"] = os.path.basename(data["settings"]["reference"])
            if n in ref:
                if ref[n]["window_starts"] != p["window_starts"]:
                    raise SystemExit(f"fidelity_candidates: {name} at {n}: other windows than the default's")
                cell.update(ratio=round(p["ppl"] / ref[n]["ppl"], 5), nll_vs_bf16=_gap(w, ref[n]["nll_by_window"]))
                if name != "default":
                    cell["nll_vs_default"] = _gap(w, base[n]["nll_by_window"])
            if name in FAKE or st.get("int2_parts") == "kv-fake":
                if name != "fake" and n in fake:
                    cell["nll_vs_fake"] = _gap(w, fake[n]["nll_by_window"])
            ag = m.get("agreement", {}).get(n)
            if ag:
                cell.update(top1=ag.get("top1"), kl=ag.get("kl"))
            row["ppl"][n] = cell
        rows[name] = row
    st0 = next(iter(runs["default"].values()))["settings"]
    return {"model": getattr(a, "model_name", None) or next(iter(runs["default"].values()))["model"], "default": "default",
            "settings": {"ppl_windows": a.ppl_windows, "chunk": st0["chunk"], "sink": st0["sink"],
                         "recent": st0["recent"], "device": st0["device"], "threads": st0["threads"],
                         "eval": st0["eval"], "calib": st0["calib"], "shape": shape,
                         "reference": getattr(a, "reference", None),
                         "argv": {name: {n: d["settings"]["argv"] for n, d in by_len.items()}
                                  for name, by_len in runs.items()}},
            "bf16": {n: round(r["ppl"], 5) for n, r in ref.items()},
            "rows": {name: rows[name] for name in CANDIDATES if name in rows}}


def model_shape(model_dir: str) -> dict:
    cfg = _load(os.path.join(model_dir, "config.json"))
    if not cfg:
        raise SystemExit(f"fidelity_candidates: {model_dir}: no config.json")
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"num_layers": cfg["num_hidden_layers"], "num_kv_heads": cfg["num_key_value_heads"], "head_dim": d}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--model-name", default=None, help="the model's name in the results (default: its folder's)")
    ap.add_argument("--rot-dir", required=True, help="folder of the rotations files")
    ap.add_argument("--rot-prefix", default="smol_", help="their names: PREFIX + stem + .safetensors")
    ap.add_argument("--ppl-len", type=lambda s: [int(x) for x in _csv(s)], default=[2048])
    ap.add_argument("--ppl-windows", type=int, default=16)
    ap.add_argument("--only", type=_csv, default=list(CANDIDATES), help="candidates to run (comma-separated)")
    ap.add_argument("--jobs", type=int, default=1, help="oscar-eval runs at once")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="oscar-eval's --device (default: its own)")
    ap.add_argument("--work", default=DEFAULT_WORK, help="folder of the runs (reused when their arguments match)")
    ap.add_argument("--reference", default=None,
                    help="an earlier oscar-eval output with bf16 and the default (e.g. fidelity_smollm2.json) on the "
                         "same windows: the pairing reference at lengths the default run lacks (checked equal where "
                         "both have a length)")
    ap.add_argument("--no-run", action="store_true", help="only rebuild --out from the runs in --work")
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    bad = [n for n in a.only if n not in CANDIDATES]
    if bad:
        raise SystemExit(f"fidelity_candidates: unknown candidates {bad} (known: {', '.join(CANDIDATES)})")
    shape = model_shape(a.model)
    os.makedirs(a.work, exist_ok=True)
    if not a.no_run:
        todo = [(n, length) for length in a.ppl_len for n in a.only]
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            for msg in pool.map(lambda t: run_one(a, *t), todo):
                print(f"fidelity_candidates: {msg}", file=sys.stderr, flush=True)
    save_json(a.out, study(a, shape))
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
