"""Issue 46: spend the keys' bytes unevenly over the layers, chosen on calibration-side data only.

    python -m benchmarks.layer_layout --proxy benchmarks/results/layer_proxy_smollm2.json --budget 42,44,46

The proxy (``oscar-calibrate proxy --calib-text --sink 16 --recent 128`` over one rotations file per
key group size, each calibrated for its groups) gives every layer's attention KL with fake-INT2 keys
at each group size, on the calibration text, never on the held-out windows. :func:`allocate` picks
one key group size per layer that minimises the summed KL under a budget of mean bytes per token and
KV head (the values keep the default's groups): an exact knapsack over the layers (a few hundred
states; :mod:`calibration.layer_groups`, which oscar-calibrate now runs by default), so the layout
is a function of the calibration data and the budget alone. The summed per-layer KL is a proxy (each layer sees exact inputs, errors do not propagate); the candidates it
picks are judged by the paired perplexity of ``benchmarks.fidelity_candidates``.
"""
from __future__ import annotations

import argparse
import json
import re

from calibration.layer_groups import allocate, key_bytes  # noqa: F401 (the knapsack lives in calibration)


def proxy_errors(report: dict, metric: str = "attn_kl", default_group: int = 16) -> dict[int, list[float]]:
    """{key group size: per-layer ``metric``} from an ``oscar-calibrate proxy --json`` report: each
    file's key group size as the report records it, or (reports without ``group_sizes``) from its
    name, ``*_g<G>``, and ``default_group`` for a name without that suffix."""
    out = {}
    for name, res in report["results"].items():
        m = re.search(r"_g(\d+)$", name)
        g = report["group_sizes"][name][0] if "group_sizes" in report else int(m.group(1)) if m else default_group
        if g in out:
            raise ValueError(f"two rotations files with key groups of {g} in the proxy report")
        out[g] = [layer[metric] for layer in res["layers"]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy", required=True, help="oscar-calibrate proxy --json output")
    ap.add_argument("--budget", required=True, help="mean bytes per token and KV head, K + V (comma-separated)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--value-bytes", type=float, default=18.0, help="the values' bytes (default: groups of 64, fp8)")
    ap.add_argument("--scale-dtype", default="float8_e4m3fn")
    ap.add_argument("--metric", default="attn_kl", choices=("attn_kl", "logit_rel", "out_rel"))
    ap.add_argument("--default-group", type=int, default=16,
                    help="key groups of a file named without _g<G> (reports without group_sizes)")
    a = ap.parse_args(argv)
    with open(a.proxy) as f:
        errors = proxy_errors(json.load(f), a.metric, a.default_group)
    cost = {g: key_bytes(a.head_dim, g, a.scale_dtype) for g in errors}
    for b in (float(x) for x in a.budget.split(",")):
        groups, err = allocate(errors, cost, b - a.value_bytes)
        mean = sum(cost[g] for g in groups) / len(groups) + a.value_bytes
        by = {g: [i for i, x in enumerate(groups) if x == g] for g in sorted(set(groups))}
        print(f"budget {b} B: mean {mean:.2f} B, summed {a.metric} {err:.4f}; "
              + "; ".join(f"g{g}: {','.join(map(str, ls))}" for g, ls in by.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
