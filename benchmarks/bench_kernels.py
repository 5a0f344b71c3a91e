"""Kernel benchmark on one GPU: OSCAR INT2 hybrid decode vs SGLang's Triton BF16 decode vs
FlashInfer's paged BF16 decode, plus the store kernel and the device copy bandwidth.

    python -m benchmarks.bench_kernels [--breakdown] [--out benchmarks/results/kernels_h200.json]
    python -m benchmarks.bench_kernels --rotations --out benchmarks/results/kernels_rotations_h100.json

Writes the JSON (after every stage, so an interrupted run keeps what it measured) and a
plot next to it (same name, .png). Shapes: Qwen3-8B-like layer (32 query heads, 8 KV heads,
head_dim 128), batch {1, 8, 64} x context {4k, 16k, 64k, 128k}, INT2 layout of the
calibration default (keys in groups of 32, values of 128, float8 scales: 74 B per token and
KV head), BF16 sink 16 / ring 128 tokens, page 64. Timings: CUDA-graph replay
(triton.testing.do_bench_cudagraph, mean), random data. Every baseline is optional: a
failure is recorded as null with its reason. SGLang's Triton BF16 kernel indexes its K/V
buffers with int32 offsets, so it is skipped (with the reason) when a buffer has 2^31 or
more elements; FlashInfer runs before it, and a CUDA error (which poisons the process's
context) ends the run with what was measured so far. ``--breakdown`` times the decode with
each of its kernels left out on the key cases (where the time goes). ``--group-size /
--value-group-size / --scale-dtype`` set the INT2 layout of the table and the breakdown
(``--group-size 128 --scale-dtype float16``: the layout whose groups span the head, with its
own tuned tiles). ``--rotations`` times only ROTATION_CASES (a served step's many requests over
short contexts), today's decode beside the same decode with one-row rotation programs at every
batch (``block_rotation_min_batch`` out of reach), side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.testing

from oscar_kernels.triton_store import triton_store
from oscar_kernels import testing as kc
from oscar_kernels.contract.layout import DEFAULT_SCALE_DTYPE, SCALE_DTYPES, KVLayout, torch_scale_dtype
from oscar_kernels.triton_decode import DecodeConfig, DecodeWorkspace, triton_decode

ROOT = Path(__file__).resolve().parents[1]

HQ, H, D = 32, 8, 128
S, W, PAGE, GROUP = 16, 128, 64, 128
BATCHES = (1, 8, 64)
CONTEXTS = (4096, 16384, 65536, 131072)
MEM_LIMIT_GB = 120.0
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


class CudaContextLost(RuntimeError):
    """A kernel hit a CUDA error: the context is unusable for the rest of the process."""


def _is_cuda_error(e: Exception) -> bool:
    return "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError"


def time_us(fn, rep: int = 40) -> tuple[float, str]:
    """Mean time of fn in microseconds: CUDA-graph replay, else events around launches."""
    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3, "cudagraph"
    except Exception as e:
        if _is_cuda_error(e):
            raise
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=5, rep=rep) * 1e3, "events"


def copy_bandwidth(gbytes: float = 4.0) -> float:
    """Device-to-device copy: (bytes read + bytes written) / time, in GB/s."""
    n = int(gbytes * 1e9)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * n / (ms * 1e-3) / 1e9


def int2_bytes_read(layer, seq_lens: list[int], num_q_heads: int) -> int:
    """Bytes decode must read for the given lengths: codes + scales of every INT2 position,
    bf16 K/V of the sink and ring windows, req_to_token entries and q (for GBps figures)."""
    h, d = layer.num_kv_heads, layer.head_dim
    s, w = layer.sink_tokens, layer.recent_window
    per_int2 = 2 * layer.k_packed.shape[-1] + (layer.k_scales[0, 0].numel() + layer.v_scales[0, 0].numel()) \
        * layer.k_scales.element_size()
    total = 0
    for n in seq_lens:
        bf = min(n, s + w)
        total += h * ((n - bf) * per_int2 + bf * 2 * d * 2) + 4 * n
    return total + len(seq_lens) * num_q_heads * d * 2


def bf16_bytes(batch: int, context: int) -> int:
    return batch * context * H * D * 2 * 2


class Bf16Pool:
    """BF16 K/V buffers for the baselines, allocated once for the largest case."""

    def __init__(self, max_tokens: int):
        self.k = torch.randn(max_tokens, H, D, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn(max_tokens, H, D, device="cuda", dtype=torch.bfloat16)


INT32_LIMIT = 2 ** 31


def triton_skip_reason(sc) -> str | None:
    """Why SGLang's Triton BF16 decode cannot run on this case (None: it can)."""
    elems = sc.layer.k_packed.shape[0] * H * D
    if elems >= INT32_LIMIT:
        return (f"skipped: its K/V buffers would have {elems} >= 2^31 elements; the kernel's int32 "
                "offsets overflow (illegal memory access, which poisons the CUDA context)")
    return None


def sglang_triton_decode(sc, q, pool: Bf16Pool, offsets=(0,)):
    """SGLang's Triton decode kernel (decode_attention_fwd), default max_kv_splits=8, over the
    case's slots: one function per layer, whose K/V buffers start ``offset`` pool rows in
    (the layers share the indices and split counts, as in a server)."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton
    b = q.shape[0]
    n = sc.lens[0]
    max_splits = 8
    num_slots = sc.layer.k_packed.shape[0]
    kv_indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32) * n
    kv_indices = sc.req_to_token[sc.rows.long(), :n].reshape(-1).contiguous()
    seq_lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
    num_kv_splits = torch.empty(b, device="cuda", dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    get_num_kv_splits_triton[(1,)](num_kv_splits, seq_lens, b, 1, HQ, H, max_splits, sms,
                                   MAX_NUM_SEQ=max(256, triton.next_power_of_2(b)))
    logits = torch.empty(b, HQ, max_splits, D, device="cuda", dtype=torch.float32)
    lse = torch.empty(b, HQ, max_splits, device="cuda", dtype=torch.float32)
    o = torch.empty_like(q)

    def layer(offset):
        kb, vb = pool.k[offset:offset + num_slots], pool.v[offset:offset + num_slots]
        return lambda: decode_attention_fwd(q, kb, vb, o, kv_indptr, kv_indices, logits, lse, num_kv_splits,
                                            max_splits, sc.sm_scale, 1.0, 1.0)
    return [layer(offset) for offset in offsets]


def flashinfer_decode(sc, q, pool: Bf16Pool, offsets=(0,), page_size: int = 16):
    """FlashInfer BatchDecodeWithPagedKVCacheWrapper over the same slots (pages of 16): one
    plan, and one function per layer whose K/V start ``offset`` pool rows in (a multiple of
    the page)."""
    import flashinfer
    b = q.shape[0]
    n = sc.lens[0]
    num_slots = sc.layer.k_packed.shape[0]
    pages = (sc.req_to_token[sc.rows.long(), :n:page_size] // page_size).reshape(-1).to(torch.int32)
    indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32) * (n // page_size)
    last = torch.full((b,), page_size, device="cuda", dtype=torch.int32)
    ws = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=HQ // H >= 4)
    wrapper.plan(indptr, pages, last, HQ, H, D, page_size, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=sc.sm_scale)
    o = torch.empty_like(q)

    def layer(offset):
        kv = tuple(t[offset:offset + num_slots].view(-1, page_size, H, D) for t in (pool.k, pool.v))
        return lambda: wrapper.run(q, kv, out=o)
    return [layer(offset) for offset in offsets]


def oscar_decode(sc, q, config: DecodeConfig | None = None, workspace: DecodeWorkspace | None = None):
    b = q.shape[0]
    cfg = config or DecodeConfig()
    ws = workspace or DecodeWorkspace(b, HQ, H, D, "cuda", cfg)
    lens = torch.tensor(sc.lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    return lambda: triton_decode(q, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows, lens,
                                 sc.sm_scale, out=out, workspace=ws)


def oscar_store(sc):
    """One decode step's store: B tokens at position n-1 of every request (triton_store)."""
    b, n = len(sc.lens), sc.lens[0]
    rows = sc.rows.long()
    k = torch.randn(b, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, H, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((b,), n - 1, device="cuda", dtype=torch.int64)
    slots = sc.req_to_token[rows, n - 1].long()
    ends = pos + 1
    return lambda: triton_store(sc.layer, sc.index, sc.rotation, sc.req_to_token, k, v, slots, pos, rows, ends)


def try_time(name: str, make, rep: int = 40, calls: int = 1):
    """(us per call, how, error) of make()'s function, which makes ``calls`` calls."""
    try:
        us, how = time_us(make(), rep)
        return round(us / calls, 2), how, None
    except Exception as e:
        log(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
        if _is_cuda_error(e):
            raise CudaContextLost(f"{name}: {type(e).__name__}: {str(e)[:300]}") from e
        return None, None, f"{type(e).__name__}: {str(e)[:500]}"


# Cold L2: a decode step reads every layer's cache in turn, so in a server one layer's data is
# never L2-resident from one step to the next. A case whose working set is below COLD_L2_FACTOR
# x the L2 size is therefore timed as that many layers (each timed call runs every layer once,
# in turn, and the time is divided by the layers): between two reads of a layer's cache and
# rotation the others have evicted them. What a server shares across layers stays shared: the
# request table and sink index (OSCAR), the page table and plan (FlashInfer, SGLang's Triton
# kernel), the decode workspace. At most MAX_COPIES layers.
COLD_L2_FACTOR = 4
MAX_COPIES = 96


def copies_for(nbytes: int, l2_bytes: int) -> int:
    """Copies of a working set of ``nbytes`` that together exceed COLD_L2_FACTOR x L2."""
    return max(1, min(MAX_COPIES, -(-COLD_L2_FACTOR * l2_bytes // max(1, nbytes))))


def in_turn(fns: list):
    """One function that runs every function of ``fns`` once, in order."""
    def run():
        for f in fns:
            f()
    return run


def l2_bytes() -> int:
    return int(torch.cuda.get_device_properties(0).L2_cache_size)


@dataclass(frozen=True)
class Layout:
    """The INT2 layout of a table run: keys' and values' group sizes, one scale dtype
    (default: oscar-calibrate's, KVLayout.resolve)."""

    key_group: int = KVLayout.resolve(D).key_group_size
    value_group: int = KVLayout.resolve(D).value_group_size
    scale_dtype: str = DEFAULT_SCALE_DTYPE

    def describe(self) -> dict:
        return {"group_size": self.key_group, "value_group_size": self.value_group, "scale_dtype": self.scale_dtype}


def cold_copies(b: int, n: int, l2: int, group: int = GROUP, scale_dtype=torch.float16, device="cuda",
                value_group: int | None = None):
    """One case as the layers of a model: separately allocated caches and rotations (random
    data, one seed each) over one shared request table and sink index, as many layers as
    copies_for the bytes decode reads from one of them (int2_bytes_read). ``group`` is the
    keys' group size, ``value_group`` the values' (default: the same)."""
    first = kc.build_random([n] * b, H=H, D=D, G=group, S=S, W=W, page=PAGE, seed=b + n,
                            scale_dtype=scale_dtype, device=device, GV=value_group)
    copies = copies_for(int2_bytes_read(first.layer, first.lens, HQ), l2)
    return [first] + [kc.another_layer(first, b + n + 7919 * j) for j in range(1, copies)]


def save(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        log(f"no plot: {e}")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"oscar_decode_us": "tab:red", "triton_bf16_us": "tab:blue", "flashinfer_bf16_us": "tab:green"}
    styles = {1: ":", 8: "--", 64: "-"}
    for batch in BATCHES:
        rows = [c for c in result["cases"] if c["batch"] == batch and c.get("oscar_decode_us")]
        for key, color in colors.items():
            pts = [(c["context"], c[key]) for c in rows if c.get(key)]
            if pts:
                ax1.plot(*zip(*pts), styles[batch], marker="o", color=color,
                         label=f"{key.replace('_us', '')} b={batch}")
        pts = [(c["context"], c["oscar_GBps"]) for c in rows if c.get("oscar_GBps")]
        if pts:
            ax2.plot(*zip(*pts), styles[batch], marker="o", color="tab:red", label=f"oscar b={batch}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("decode attention, one layer (us)")
    ax1.legend(fontsize=7, ncol=3)
    if result.get("copy_GBps"):
        ax2.axhline(result["copy_GBps"], color="k", label="device copy")
        ax2.axhline(0.7 * result["copy_GBps"], color="k", ls="--", label="0.7 x copy")
    ax2.set_ylabel("OSCAR effective bandwidth (GB/s)")
    ax2.legend(fontsize=7)
    shape = result.get("shape", {})
    fig.suptitle(f"{result.get('device', 'GPU')}: 32 q / 8 kv heads, d=128, INT2 keys g={shape.get('group_size')} / "
                 f"values g={shape.get('value_group_size')}, {shape.get('scale_dtype')} scales, "
                 f"sink {S} + ring {W} BF16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot -> {path}")


def oscar_timed(name, scs, q, cfg, rep=20):
    """try_time of the decode over the copies ``scs`` of a case (cold L2), one config, one
    decode workspace for all (a server allocates one for every layer)."""
    def make():
        ws = DecodeWorkspace(q.shape[0], HQ, H, D, "cuda", cfg or DecodeConfig())
        return in_turn([oscar_decode(s, q, cfg, ws) for s in scs])
    return try_time(name, make, rep=rep, calls=len(scs))


KEY_CASES = ((8, 65536), (64, 16384), (1, 65536), (64, 131072))


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def breakdown_record(scs, q, b, n):
    """Where the default decode's time goes, timed by leaving one kernel out: full decode, then
    the decode with each launched kernel replaced by no launch; time(kernel) ~ full - without(kernel)."""
    import oscar_kernels.triton_decode as td
    name = "default"
    cfg = DecodeConfig()
    rec = {"variant": name, "config": {}, "batch": b, "context": n}
    rec["full_us"], _, err = oscar_timed(name, scs, q, cfg)
    merge = {"query_head": "_decode_merge_row", "split": "_decode_merge_split"}[cfg.merge_grid_for(b)]
    for kernel in ("_rotate_q_kernel", "_decode_stage1", merge):
        saved = getattr(td, kernel)
        setattr(td, kernel, _NoLaunch())
        try:
            us, _, _ = oscar_timed(f"{name} without {kernel}", scs, q, cfg)
        finally:
            setattr(td, kernel, saved)
        rec[f"without{kernel}_us"] = us
        if us is not None and rec["full_us"] is not None:
            rec[f"{kernel.lstrip('_')}_us"] = round(rec["full_us"] - us, 2)
    if err:
        rec["error"] = err
    log(f"breakdown {name} b={b} n={n}: " + ", ".join(f"{k}={v}" for k, v in rec.items() if k.endswith("_us")))
    return rec


ROTATION_CASES = ((8, 8192), (32, 8192), (64, 8192), (160, 8192), (64, 65536))


def run_rotations(result: dict, out: Path, layout: Layout) -> None:
    """The decode with rotations in row blocks (the default from block_rotation_min_batch
    requests) against one-row rotation programs at every batch, on ROTATION_CASES."""
    per_row = DecodeConfig(block_rotation_min_batch=1 << 30)
    for b, n in ROTATION_CASES:
        scs = layout_copies(b, n, l2_bytes(), layout)
        q = kc.random_q(scs[0], HQ)
        rec = {"batch": b, "context": n, "block_rotation": DecodeConfig().block_rotation(b)}
        rec["default_us"], _, err = oscar_timed("default", scs, q, None, rep=40)
        rec["row_rotations_us"], _, err2 = oscar_timed("row rotations", scs, q, per_row, rep=40)
        if err or err2:
            rec["error"] = err or err2
        if rec["default_us"] and rec["row_rotations_us"]:
            rec["default_vs_row"] = round(rec["default_us"] / rec["row_rotations_us"], 3)
        result["rotations"].append(rec)
        log(f"rotations b={b} n={n}: " + ", ".join(f"{k}={v}" for k, v in rec.items() if k.endswith(("_us", "_row"))))
        save(result, out)
        del scs, q
        torch.cuda.empty_cache()


def layout_copies(b: int, n: int, l2: int, layout: Layout):
    return cold_copies(b, n, l2, layout.key_group, torch_scale_dtype(layout.scale_dtype), value_group=layout.value_group)


def run_breakdown(result: dict, out: Path, cases, layout: Layout) -> None:
    """Leave-one-kernel-out timings of the default decode on the key cases (assert nothing
    about them: they are for reading)."""
    for b, n in [c for c in KEY_CASES if c in cases]:
        scs = layout_copies(b, n, l2_bytes(), layout)
        q = kc.random_q(scs[0], HQ)
        result["breakdown"].append(breakdown_record(scs, q, b, n))
        save(result, out)
        del scs, q
        torch.cuda.empty_cache()


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'8x65536,1x4096' -> [(8, 65536), (1, 4096)], each one of the table's cases."""
    cases = []
    for item in text.split(","):
        try:
            b, n = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"case {item!r} is not BATCHxCONTEXT (e.g. 8x65536)") from None
        if b not in BATCHES or n not in CONTEXTS:
            raise argparse.ArgumentTypeError(f"case {item!r}: batch must be one of {BATCHES}, context one of "
                                             f"{CONTEXTS}")
        cases.append((b, n))
    return cases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels_h200.json"))
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the decode with each kernel left out, on the key cases")
    ap.add_argument("--rotations", action="store_true",
                    help="only the row-block rotations against one-row rotation programs (ROTATION_CASES)")
    ap.add_argument("--cases", type=parse_cases, default=None, metavar="BxN,...",
                    help="only these batch x context cases of the table (e.g. 8x65536; default: all)")
    ap.add_argument("--group-size", type=int, default=None,
                    help="keys' INT2 group size of the table (default: oscar-calibrate's, head_dim / 4)")
    ap.add_argument("--value-group-size", type=int, default=None,
                    help="values' INT2 group size of the table (default: oscar-calibrate's, 128, or "
                         "--group-size when that is given)")
    ap.add_argument("--scale-dtype", choices=sorted(SCALE_DTYPES), default=DEFAULT_SCALE_DTYPE)
    args = ap.parse_args(argv)
    groups = KVLayout.resolve(D, args.group_size, args.value_group_size)
    layout = Layout(groups.key_group_size, groups.value_group_size, args.scale_dtype)
    out = Path(args.out)
    dev = torch.cuda.get_device_properties(0)
    result = {"device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
              "triton": triton.__version__, "shape": {"q_heads": HQ, "kv_heads": H, "head_dim": D,
                                                      **layout.describe(), "sink_tokens": S,
                                                      "recent_window": W, "page_size": PAGE},
              "timing": "CUDA-graph replay mean (triton.testing.do_bench_cudagraph); random data; cold L2: "
                        f"a case under {COLD_L2_FACTOR} x L2 is timed as *_copies layers in turn (each its "
                        "own cache and rotation; request table, sink index, workspace, BF16 page table "
                        "and plan shared, as in a server)",
              "bytes_note": "oscar_GBps = (INT2 codes+scales of history, BF16 sink+ring, req_to_token "
                            "entries, q) / time",
              "triton_bf16_note": "sglang.kernels.ops.attention.decode_attention.decode_attention_fwd, "
                                  "max_kv_splits=8 (SGLang default), splits from get_num_kv_splits_triton",
              "flashinfer_note": "BatchDecodeWithPagedKVCacheWrapper, NHD, page 16, tensor cores for GQA>=4",
              "copy_GBps": None, "cases": [], "skipped": [], "breakdown": [], "rotations": []}
    l2 = l2_bytes()
    result["l2_bytes"] = l2
    log(f"device {dev.name}, {dev.multi_processor_count} SMs, L2 {l2 >> 20} MiB")
    result["copy_GBps"] = round(copy_bandwidth(), 1)
    log(f"copy bandwidth {result['copy_GBps']} GB/s")
    save(result, out)
    if args.rotations:
        run_rotations(result, out, layout)
        result["elapsed_s"] = round(time.time() - T0, 1)
        save(result, out)
        return

    cases = []
    for b in BATCHES:
        for n in CONTEXTS:
            if args.cases is not None and (b, n) not in args.cases:
                continue
            need = (bf16_bytes(b, n) + b * n * H * 80) / 1e9
            if need > MEM_LIMIT_GB:
                result["skipped"].append({"batch": b, "context": n, "reason": f"needs {need:.0f} GB"})
            else:
                cases.append((b, n))
    max_tokens = max(b * n for b, n in cases)
    pool = None
    if not args.no_baselines:
        try:
            pool = Bf16Pool(max_tokens + PAGE)
        except Exception as e:
            log(f"BF16 pool allocation failed: {e}")
    try:
        for b, n in cases:
            log(f"case batch={b} context={n}")
            scs = layout_copies(b, n, l2, layout)
            sc = scs[0]
            q = kc.random_q(sc, HQ)
            rec = {"batch": b, "context": n, "q_heads": HQ, "kv_heads": H, "head_dim": D, "oscar_copies": len(scs)}
            result["cases"].append(rec)
            rec["oscar_decode_us"], rec["timing"], err = oscar_timed("oscar", scs, q, None, rep=40)
            if err:
                rec["oscar_error"] = err
            rec["oscar_bytes"] = int2_bytes_read(sc.layer, sc.lens, HQ)
            rec["oscar_GBps"] = (round(rec["oscar_bytes"] / (rec["oscar_decode_us"] * 1e-6) / 1e9, 1)
                                 if rec["oscar_decode_us"] else None)
            rec["store_us"], _, err = try_time("store", lambda: oscar_store(sc))
            if err:
                rec["store_error"] = err
            rec["bf16_bytes"] = bf16_bytes(b, n)
            # the BF16 case's layers side by side in the pool (cold L2, as for oscar)
            slots = sc.layer.k_packed.shape[0]
            bf16_copies = max(1, min(copies_for(rec["bf16_bytes"], l2), (pool.k.shape[0] if pool else 0) // slots))
            rec["bf16_copies"] = bf16_copies
            # FlashInfer first: SGLang's Triton kernel is the one that can fault
            for key, fn in (("flashinfer_bf16_us", flashinfer_decode), ("triton_bf16_us", sglang_triton_decode)):
                if pool is None:
                    rec[key], rec[key + "_error"] = None, "baselines disabled or BF16 pool allocation failed"
                    continue
                skip = triton_skip_reason(sc) if key == "triton_bf16_us" else None
                if skip:
                    rec[key], rec[key + "_error"] = None, skip
                    log(f"  {key}: {skip}")
                    continue
                offsets = [j * slots for j in range(bf16_copies)]
                rec[key], _, err = try_time(key, lambda fn=fn: in_turn(fn(sc, q, pool, offsets)), calls=bf16_copies)
                if err:
                    rec[key + "_error"] = err
            if rec["oscar_decode_us"] and rec.get("flashinfer_bf16_us"):
                rec["speedup_vs_flashinfer"] = round(rec["flashinfer_bf16_us"] / rec["oscar_decode_us"], 2)
            if rec["oscar_GBps"] and result["copy_GBps"]:
                rec["oscar_fraction_of_copy"] = round(rec["oscar_GBps"] / result["copy_GBps"], 3)
            log("  " + ", ".join(f"{k}={rec.get(k)}" for k in ("oscar_decode_us", "oscar_GBps", "triton_bf16_us",
                                                                "flashinfer_bf16_us", "store_us")))
            save(result, out)
            sc = scs = q = None  # free the caches before the next case
            torch.cuda.empty_cache()
        plot(result, out.with_suffix(".png"))
        if args.breakdown:
            del pool
            torch.cuda.empty_cache()
            run_breakdown(result, out, cases, layout)
    except CudaContextLost as e:
        result["aborted"] = f"CUDA context lost, later measurements impossible in this process: {e}"
        log(result["aborted"])
    result["elapsed_s"] = round(time.time() - T0, 1)
    save(result, out)
    log(f"done -> {out}")


def run_main(main) -> None:
    """Run a benchmark's main(): a traceback and exit status 1 on any error."""
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
