"""Where a decode step goes: a torch-profiler trace of a serving SGLang server, in ms per step by category.

Input: the Chrome trace (JSON, gzipped or not) that SGLang 0.5.17's ``/start_profile`` writes
(``torch.profiler`` with ``ProfilerActivity.CUDA``; benchmarks/e2e.py ``--profile-steps`` asks for
it once a steady workload decodes at full concurrency). CUPTI records every kernel a CUDA graph
replays as an ordinary ``kernel`` event whose ``args.correlation`` is the correlation id of the
``cudaGraphLaunch`` runtime event that replayed it, so a decode step served from a graph is in
the trace kernel by kernel.

Steps, counted from the trace: the graph replays are the ``cudaGraphLaunch`` / ``cuGraphLaunch``
runtime events that own kernels; the decode replays are those with at least DECODE_REPLAY_FRACTION
of the largest replay's kernel count (a whole forward; the segments of SGLang's breakable prefill
graphs hold a layer or so), in the order of their first kernel's start g_1 < ... < g_K.
Period i = [g_i, g_{i+1}) holds replay i and whatever the GPU ran before replay i+1 (sampling,
the next step's input copies and attention metadata), i.e. one decode step as the server runs
it; K replays give K - 1 periods. A period that also holds a GEMM or attention kernel launched
outside a graph, or another replay (a prefill, an eager forward), is dropped; the n periods kept
are the steps.
Every GPU event (kernel, memcpy, memset) counts in the period its start falls in:

    ms_c      = sum of the durations of category c's events in the kept periods / n
    wall      = sum of the kept periods' lengths / n
    gpu_busy  = length of the union of the events' intervals (clipped to their period) / n
    GPU idle  = wall - gpu_busy                 (no kernel running: host-bound time, bubbles)
    overlap   = sum_c ms_c - gpu_busy           (kernels that ran concurrently, e.g. two streams)

so the categories plus GPU idle add up to the wall step when nothing overlaps.

Categories (first rule that matches the kernel name; names from oscar_kernels/*.py's
``@triton.jit`` functions, SGLang's kernels and FlashInfer's ``__global__`` functions):
attention split into rotations (``_rotate_q_kernel``), stage 1 (``_decode_stage1``; SGLang
Triton's ``_fwd_*kernel_stage1``), merge (``_decode_merge_row/_split``; FlashInfer's
``MergeState*``; SGLang Triton's ``_fwd_kernel_stage2``), FlashInfer (its decode/prefill
kernels) and metadata (the KV index builders run per step); KV store and ring (oscar's
``_store_kernel``, SGLang's ``store_kvcache``); sampling / logits; communication;
norms / RoPE / activation; GEMMs (cuBLAS ``nvjet``/``gemm``/``cutlass``...); everything else
(memcpy, memset and unnamed elementwise kernels; the largest are listed by name). Two rules
read the order inside one replay: its last GEMM kernels (the last one and the GEMM kernels right
before it, e.g. a split-K reduce's partner) are the LM head (sampling / logits), and a
``_rotate_q_kernel`` right after a ``_decode_merge_split`` is the output un-rotation (merge).

    python3 -m benchmarks.decode_profile TRACE.json.gz                 # the breakdown of one trace
    python3 -m benchmarks.decode_profile --plot [RESULTS.json] [PNG]   # stacked bars of e2e's profiles
"""
from __future__ import annotations

import gzip
import json
import os
import re
import sys
from collections import defaultdict

ROT, STAGE1, MERGE = "attention: rotations", "attention: stage 1", "attention: merge"
FLASHINFER, META = "attention: FlashInfer", "attention: metadata"
KV, GEMM, NORM = "KV store and ring", "GEMMs", "norms / RoPE / activation"
SAMPLING, COMM, OTHER, IDLE = "sampling / logits", "communication", "everything else", "GPU idle"
# the stacking order of the plot and the rows of the table (GPU idle last)
CATEGORIES = (ROT, STAGE1, MERGE, FLASHINFER, META, KV, GEMM, NORM, SAMPLING, COMM, OTHER, IDLE)
ATTENTION = (ROT, STAGE1, MERGE, FLASHINFER)  # forward-pass attention (not its metadata)

RULES = (  # (category, regex over the kernel name); the first match wins
    (ROT, r"\b_rotate_q_kernel"),
    (STAGE1, r"\b_decode_stage1|\b_fwd_(grouped_)?kernel_stage1"),
    (MERGE, r"\b_decode_merge_(row|split)|\b_fwd_kernel_stage2|MergeState|AttentionSumKernel"),
    (FLASHINFER, r"(Batch|Single)(Decode|Prefill)With\w*KVCache\w*Kernel|BatchAttention|PODWithKVCache"),
    (META, r"create_flashinfer_kv_indices|create_kv_indices"),
    (KV, r"\b_store_kernel|store_kvcache|store_cache|set_kv_buffer|reshape_and_cache"),
    (SAMPLING, r"(?i)argmax|softmax|sampling|topk|top_k|multinomial|radixsort|penalt|gumbel"),
    (COMM, r"(?i)nccl|all_?reduce|cross_device|custom_ar|all_?gather|reduce_?scatter"),
    (NORM, r"(?i)rms_?norm|layer_?norm|qk_?norm|norm_rope|rope|rotary|act_and_mul|silu|gelu|act_kernel"),
    (GEMM, r"(?i)gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|splitkreduce|marlin|wgmma"),
)
_RULES = tuple((c, re.compile(p)) for c, p in RULES)
DECODE_REPLAY_FRACTION = 0.5
GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def classify(name: str) -> str:
    """The category of a kernel by its name alone (see the module docstring)."""
    for cat, rx in _RULES:
        if rx.search(name):
            return cat
    return OTHER


def short_name(name: str, width: int = 90) -> str:
    """A kernel name for a table: no 'void ', at most ``width`` characters."""
    name = re.sub(r"^void ", "", name.strip())
    return name if len(name) <= width else name[:width - 3] + "..."


def load_trace(path: str) -> dict:
    """A Chrome trace file (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _events(trace) -> list[dict]:
    return trace.get("traceEvents", []) if isinstance(trace, dict) else list(trace)


def breakdown(trace, top: int = 8) -> dict:
    """ms per decode step by category of one trace (the module docstring's arithmetic)."""
    events = [e for e in _events(trace) if e.get("ph") == "X"]
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and GRAPH_LAUNCH.match(e.get("name", ""))
                and "correlation" in e.get("args", {})}
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: float(e["ts"]))
    replays = defaultdict(list)
    for e in gpu:
        c = e.get("args", {}).get("correlation")
        if e["cat"] == "kernel" and c in launches:
            replays[c].append(e)
    if len(replays) < 2:
        raise ValueError(f"{len(replays)} CUDA-graph replays in the trace: need two to bound one decode step "
                         f"(graph launches seen: {len(launches)}; kernels: {sum(e['cat'] == 'kernel' for e in gpu)})")
    # each event's category; the order rules look inside one replay
    cat = {}
    for ks in replays.values():
        last_attn = None
        for k in ks:
            c = classify(k["name"])
            if c == ROT and last_attn is not None and re.search(r"\b_decode_merge_split", last_attn):
                c = MERGE  # the split merge's output un-rotation
            if c in (ROT, STAGE1, MERGE):
                last_attn = k["name"]
            cat[id(k)] = c
        last = max((j for j, k in enumerate(ks) if cat[id(k)] == GEMM), default=None)
        while last is not None and last >= 0 and cat[id(ks[last])] == GEMM:
            cat[id(ks[last])] = SAMPLING  # the LM head: the forward's last GEMM (with its split-K reduce)
            last -= 1
    most = max(len(ks) for ks in replays.values())
    decode = [ks for ks in replays.values() if len(ks) >= DECODE_REPLAY_FRACTION * most]
    in_graph = {id(k) for ks in decode for k in ks}
    elsewhere = {id(k) for ks in replays.values() if len(ks) < DECODE_REPLAY_FRACTION * most for k in ks}
    if len(decode) < 2:
        raise ValueError(f"{len(decode)} whole-forward CUDA-graph replays in the trace: need two to bound a step")
    starts = sorted(float(ks[0]["ts"]) for ks in decode)
    periods = list(zip(starts, starts[1:]))
    per = [[] for _ in periods]
    i = 0
    for e in gpu:
        t = float(e["ts"])
        while i < len(periods) and t >= periods[i][1]:
            i += 1
        if i == len(periods):
            break
        if t >= periods[i][0]:
            per[i].append(e)
    sums, counts, names = defaultdict(float), defaultdict(int), defaultdict(lambda: [0.0, 0])
    wall = busy = 0.0
    kept = 0
    for (a, b), evs in zip(periods, per):
        labels = [cat.get(id(e)) or (classify(e["name"]) if e["cat"] == "kernel" else OTHER) for e in evs]
        if any(id(e) in elsewhere or id(e) not in in_graph and c in ATTENTION + (GEMM,) for e, c in zip(evs, labels)):
            continue  # a prefill or an eager forward ran here
        kept += 1
        wall += b - a
        spans = sorted((float(e["ts"]), min(b, float(e["ts"]) + float(e.get("dur", 0)))) for e in evs)
        end = a
        for s, f in spans:  # the union of the busy intervals
            busy += max(0.0, f - max(s, end))
            end = max(end, f)
        for e, c in zip(evs, labels):
            d = float(e.get("dur", 0))
            sums[c] += d
            counts[c] += 1
            n = names[(c, e["name"])]
            n[0] += d
            n[1] += 1
    if not kept:
        raise ValueError(f"none of the {len(periods)} periods between graph replays held decode work only")
    ms = {c: round(sums[c] / kept / 1000, 3) for c in CATEGORIES if c != IDLE}
    ms[IDLE] = round(max(0.0, wall - busy) / kept / 1000, 3)
    ranked = sorted(names.items(), key=lambda kv: -kv[1][0])
    row = lambda k, v: {"name": short_name(k[1]), "category": k[0], "ms_per_step": round(v[0] / kept / 1000, 3),
                        "per_step": round(v[1] / kept, 2)}
    return {
        "steps": kept, "graph_replays": len(decode), "other_replays": len(replays) - len(decode),
        "periods_dropped": len(periods) - kept,
        "ms_per_step": ms,
        "wall_ms_per_step": round(wall / kept / 1000, 3),
        "gpu_busy_ms_per_step": round(busy / kept / 1000, 3),
        "kernel_ms_per_step": round(sum(sums.values()) / kept / 1000, 3),
        "overlap_ms_per_step": round(max(0.0, sum(sums.values()) - busy) / kept / 1000, 3),
        "kernels_per_step": {c: round(counts[c] / kept, 2) for c in CATEGORIES if counts.get(c)},
        "kernels_per_replay": round(len(in_graph) / len(decode), 2),
        "top_other": [row(k, v) for k, v in ranked if k[0] == OTHER][:top],
        "top_kernels": [row(k, v) for k, v in ranked][:top],
    }


# ------------------------------------------------------------------------- the plot


def profiles(data: dict) -> list[tuple[str, str, dict]]:
    """[(configuration, workload, profile)] of an e2e steady-decode results file, workload by workload."""
    out = []
    workloads = list(data.get("settings", {}).get("workloads", {})) or ["steady_32k", "steady_8k"]
    for w in workloads:
        for name, entry in data.get("configs", {}).items():
            prof = (entry.get(w) or {}).get("profile") if isinstance(entry.get(w), dict) else None
            if isinstance(prof, dict) and isinstance(prof.get("ms_per_step"), dict):
                out.append((name, w, prof))
    return out


COLORS = {ROT: "#98df8a", STAGE1: "#2ca02c", MERGE: "#1b5e20", FLASHINFER: "#1f77b4", META: "#aec7e8",
          KV: "#ff7f0e", GEMM: "#7f7f7f", NORM: "#bcbd22", SAMPLING: "#9467bd", COMM: "#17becf",
          OTHER: "#d62728", IDLE: "#ffffff"}


def plot(data: dict, path: str) -> str | None:
    """Stacked bars of ms per decode step by category, one bar per configuration and workload;
    None (no file) when the results hold no profile."""
    rows = profiles(data)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(rows), 5.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for c in CATEGORIES:
        vals = [p["ms_per_step"].get(c) or 0.0 for _, _, p in rows]
        if not any(vals):
            continue
        ax.bar(x, vals, bottom=bottom, color=COLORS[c], edgecolor="#444444", linewidth=0.5, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, (_, _, p) in enumerate(rows):
        ax.annotate(f"{p.get('wall_ms_per_step', 0):.1f} ms", (i, bottom[i]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), [f"{n}\n{w}\n{p.get('in_flight', '?')} in flight" for n, w, p in rows], fontsize=8)
    ax.set_ylabel("ms per decode step (torch profiler, CUDA graphs on)")
    env = data.get("environment", {})
    ax.set_title(f"Where a steady decode step goes: {data.get('model', '?')}, {env.get('gpu') or 'GPU ?'}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.margins(y=0.1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_name(results_path: str) -> str:
    """The plot's file name beside an e2e results file: e2e_decode_throughput_X.json -> decode_profile_X.png
    (one plot per results file: the same model on two GPUs keeps two)."""
    stem = os.path.basename(results_path).removesuffix(".json").removeprefix("e2e_decode_throughput_")
    return f"decode_profile_{stem}.png"


def default_results() -> str:
    from benchmarks.e2e import RESULTS

    return os.path.join(RESULTS, "e2e_decode_throughput_qwen3-8b-shape.json")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--plot":
        src = argv[1] if len(argv) > 1 else default_results()
        with open(src, encoding="utf-8") as f:
            data = json.load(f)
        out = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(src), plot_name(src))
        made = plot(data, out)
        print(f"plot: {made}" if made else f"{src}: no profile yet (run benchmarks/e2e.py with --profile-steps)")
        return 0
    if len(argv) != 1:
        print("usage: python3 -m benchmarks.decode_profile TRACE.json[.gz] | --plot [RESULTS.json] [PNG]",
              file=sys.stderr)
        return 2
    print(json.dumps(breakdown(load_trace(argv[0])), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
