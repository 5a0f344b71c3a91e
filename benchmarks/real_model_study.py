"""The real-model fidelity study (issue 46) in one file: candidates paired against today's default.

Joins oscar-eval outputs made on the same held-out windows (one GPU session,
benchmarks/gpu_session_real_model.sh) into ``study_smollm2.json``:

- ``--main FILE``: the run with bf16 and the candidate rotations files (every method a row);
- ``--run NAME=FILE`` (repeatable): runs without bf16 that change one thing, e.g. ``--int2-parts k``
  (INT2 keys only) or ``--recent 512``; each of their methods becomes the row ``NAME/method``;
- ``--proxy FILE``: ``oscar-calibrate proxy --json`` of the same files, per layer.

Each row: what it changes, INT2 bytes per token and KV head (the rotations file's layout) and the
BF16 bytes per running request of its sinks and ring, and per perplexity length its ppl, ratio to
bf16 and the NLL difference paired by window against bf16 and against ``--default`` (mean and 95%
half-width over windows).

    python -m benchmarks.real_model_study --main R/fidelity_smollm2.json --run k=R/attr_k_smollm2.json \\
        --run v=R/attr_v_smollm2.json --run S64=R/window_sink64_smollm2.json --proxy R/proxy_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os

from benchmarks.server_harness import ROOT, save_json
from benchmarks.targets import bf16_bytes_per_position, window_gap as _gap
from oscar_kernels.contract.layout import KVLayout

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "study_smollm2.json")


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"real_model_study: {path}: {e}") from None


def _named(s: str) -> tuple[str, str]:
    name, eq, path = s.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"--run wants NAME=FILE, got {s!r}")
    return name, path


def row_for(method: dict, rotation: dict | None, settings: dict, ref: dict, default: dict | None,
            num_layers: int, num_kv_heads: int, head_dim: int) -> dict:
    """One candidate: its bytes and, per length, ppl and paired NLL gaps to bf16 and the default."""
    row = {"int2_parts": settings.get("int2_parts", "kv"), "sink": settings.get("sink"),
           "recent": settings.get("recent")}
    if rotation:
        layout = KVLayout(rotation["group_size"], rotation["value_group_size"], rotation["scale_dtype"])
        row.update(recipe=rotation.get("recipe"), key_shift=rotation.get("recipe_detail", {}).get("key_shift", "none"),
                   group_size=rotation["group_size"], value_group_size=rotation["value_group_size"],
                   bytes_per_token_head=layout.bytes_per_token_per_head(head_dim))
    # BF16 K and V of the sinks (shared per sequence) and the ring (per running request), all layers
    per_position = bf16_bytes_per_position(num_layers, num_kv_heads, head_dim)
    row["ring_bytes_per_request"] = (settings.get("recent") or 0) * per_position
    row["sink_bytes_per_sequence"] = (settings.get("sink") or 0) * per_position
    lengths = {}
    for n, d in method.get("ppl_details", {}).items():
        rd = ref.get("ppl_details", {}).get(n, {})
        cell = {"ppl": round(d["ppl"], 5), "ratio": round(d["ppl"] / rd["ppl"], 5) if rd else None,
                "nll_vs_bf16": _gap(d.get("nll_by_window", []), rd.get("nll_by_window", []))}
        if default is not None:
            dd = default.get("ppl_details", {}).get(n, {})
            cell["nll_vs_default"] = _gap(d.get("nll_by_window", []), dd.get("nll_by_window", []))
        ag = method.get("agreement", {}).get(n)
        if ag:
            cell.update(top1=ag.get("top1"), kl=ag.get("kl"))
        lengths[n] = cell
    row["ppl"] = lengths
    return row


def study(main: dict, runs: list[tuple[str, dict]], default_name: str, proxy: dict | None) -> dict:
    methods, st = main.get("methods", {}), main.get("settings", {})
    ref = methods.get("bf16")
    if not ref:
        raise SystemExit("real_model_study: --main has no bf16 method to pair with")
    default = methods.get(default_name)
    if default is None:
        raise SystemExit(f"real_model_study: --main has no method {default_name!r} (--default)")
    rot0 = next(iter(st.get("rotations", {}).values()), None)
    if rot0 is None:
        raise SystemExit("real_model_study: --main has no rotations file to read the model's shape from")
    shape = main.get("shape") or {}
    geometry = (shape.get("num_layers"), shape.get("num_kv_heads"), shape.get("head_dim"))
    rows = {}
    for label, data in [("", main)] + runs:
        rst = data.get("settings", {})
        if rst.get("ppl_windows") != st.get("ppl_windows") or rst.get("ppl_len") != st.get("ppl_len"):
            raise SystemExit(f"real_model_study: run {label or 'main'} has other perplexity windows than --main")
        for name, m in data.get("methods", {}).items():
            if name == "bf16":
                continue
            key = f"{label}/{name}" if label else name
            rows[key] = row_for(m, rst.get("rotations", {}).get(name), rst, ref,
                                None if key == default_name else default, *geometry)
    out = {"model": main.get("model"), "default": default_name, "settings": {
        "ppl_len": st.get("ppl_len"), "ppl_windows": st.get("ppl_windows"), "chunk": st.get("chunk"),
        "sink": st.get("sink"), "recent": st.get("recent"), "device": st.get("device"),
        "eval": st.get("eval"), "shape": dict(zip(("num_layers", "num_kv_heads", "head_dim"), geometry))},
        "bf16": {n: round(d["ppl"], 5) for n, d in ref.get("ppl_details", {}).items()},
        "rows": rows}
    if proxy:
        out["proxy"] = {"tokens": proxy.get("tokens"), "sink": proxy.get("sink"), "recent": proxy.get("recent"),
                        "data": proxy.get("data"), "results": proxy.get("results")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--main", required=True, help="oscar-eval output with bf16 and the candidates")
    ap.add_argument("--run", action="append", type=_named, default=[], metavar="NAME=FILE")
    ap.add_argument("--default", default="oscar", help="the method every row is paired against")
    ap.add_argument("--proxy", default=None, help="oscar-calibrate proxy --json output")
    ap.add_argument("--model-config", default=None,
                    help="the model's config.json (num_layers / KV heads / head_dim for the BF16 bytes); "
                         "default: the shape recorded in --main's rotations")
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    main_data = _load(a.main)
    rot0 = next(iter(main_data.get("settings", {}).get("rotations", {}).values()), {})
    if a.model_config:
        cfg = _load(a.model_config)
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        main_data["shape"] = {"num_layers": cfg["num_hidden_layers"], "num_kv_heads": cfg["num_key_value_heads"],
                              "head_dim": hd}
    elif "shape" in rot0:
        main_data["shape"] = rot0["shape"]
    else:
        raise SystemExit("real_model_study: give --model-config (the model's config.json)")
    result = study(main_data, [(n, _load(p)) for n, p in a.run], a.default, _load(a.proxy) if a.proxy else None)
    save_json(a.out, result)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
