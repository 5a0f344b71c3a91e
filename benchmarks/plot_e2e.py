"""Plot of benchmarks/e2e.py's results: capacity, batch-1 decode latency, throughput.

    python3 -m benchmarks.plot_e2e benchmarks/results/e2e_qwen3-8b-shape.json [out.png]
"""
from __future__ import annotations

import json
import os
import re
import sys

COLORS = {"bf16_triton": "#7f7f7f", "bf16_flashinfer": "#1f77b4", "fp8_e4m3": "#ff7f0e",
          "oscar_int2": "#2ca02c", "oscar_int2_bf16_prefix": "#98df8a",
          "oscar_int2_flashinfer_prefix": "#17becf", "oscar_int2_int2_prefix": "#bcbd22"}


def decode_points(entry: dict) -> list[tuple[int, float]]:
    """[(input tokens, ms per decode step)] from the decode_ms_<N>k keys that have a value."""
    pts = []
    for k, v in entry.items():
        m = re.fullmatch(r"decode_ms_(\d+)k", k)
        if m and isinstance(v, (int, float)):
            pts.append((int(m.group(1)) * 1000, float(v)))
    return sorted(pts)


def plot_e2e(data: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = data.get("configs", {})
    names = list(configs)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    title = f"{data.get('model', '?')} (random weights), {data.get('environment', {}).get('gpu', 'GPU ?')}"
    settings = data.get("settings", {})
    if settings:
        title += (f"; mem-fraction-static {settings.get('mem_fraction_static')}, "
                  f"page {settings.get('page_size')}")
    fig.suptitle(title)

    ax = axes[0]
    xs = [n for n in names if isinstance(configs[n].get("max_total_num_tokens"), int)]
    vals = [configs[n]["max_total_num_tokens"] / 1e6 for n in xs]
    bars = ax.bar(xs, vals, color=[COLORS.get(n, "#9467bd") for n in xs])
    for b, n in zip(bars, xs):
        c = configs[n].get("concurrent_100k")
        ax.annotate(f"{c} x 100k" if c is not None else "", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.margins(y=0.15)
    ax.set_ylabel("KV pool: max_total_num_tokens (millions)")
    ax.set_title("Capacity at the same memory budget")
    ax.tick_params(axis="x", rotation=20)

    ax = axes[1]
    for n in names:
        pts = decode_points(configs[n])
        if pts:
            ax.plot([p[0] / 1000 for p in pts], [p[1] for p in pts], "o-", label=n,
                    color=COLORS.get(n))
    ax.set_xlabel("input tokens (thousands)")
    ax.set_ylabel("ms per decode step (batch 1, median ITL)")
    ax.set_title("Batch-1 decode latency")
    ax.set_ylim(bottom=0)
    if ax.lines:
        ax.legend()

    ax = axes[2]
    xs = [n for n in names if isinstance(configs[n].get("throughput_tok_s"), (int, float))]
    bars = ax.bar(xs, [configs[n]["throughput_tok_s"] for n in xs],
                  color=[COLORS.get(n, "#9467bd") for n in xs])
    for b, n in zip(bars, xs):
        tp = configs[n].get("throughput", {})
        conc = tp.get("settings", {}).get("max_concurrency")
        itl = tp.get("median_itl_ms")
        label = f"{conc} in flight" + (f"\nITL p50 {itl:.0f} ms" if isinstance(itl, (int, float)) else "")
        ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    fontsize=8)
    tps = next((configs[n]["throughput"].get("settings", {}) for n in xs), {})
    ax.set_title("Throughput" + (f" ({tps.get('num_prompts')} requests, {tps.get('input_len')} in / "
                                 f"{tps.get('output_len')} out)" if tps else ""))
    ax.margins(y=0.2)
    ax.set_ylabel("output tokens/s")
    ax.tick_params(axis="x", rotation=20)

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        data = json.load(f)
    out = argv[1] if len(argv) > 1 else os.path.splitext(argv[0])[0] + ".png"
    print(plot_e2e(data, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
