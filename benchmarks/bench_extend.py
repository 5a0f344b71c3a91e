"""Prefill (extend) benchmark on one GPU: one layer of chunked prefill over a cached prefix.

Where a long prompt's time to first token goes with OSCAR: every 8k-token chunk attends to
the whole cached prefix. Compares, on the same lengths and in the same run:

- ``oscar_int2_us``: prefix_read="int2", the prefix unpacked in every program, with that
  read's tiles (triton_extend.EXTEND_TILES);
- ``oscar_bf16_rows128_n64_s3_us``: prefix_read="bf16", the prefix materialised once as BF16
  (triton_materialize) and BF16 flash attention, tiles named in the key (rows, BF16 tokens
  per step, stages); ``materialize_us`` is that first kernel alone;
- ``oscar_flashinfer_us``: FlashInferExtend, the materialised prefix read by FlashInfer's
  prefill (--oscar-extend-prefix flashinfer);
- ``flashinfer_bf16_us``: FlashInfer's paged BF16 prefill (causal) over prefix + chunk, what
  the bf16_flashinfer server runs.

Each read's output is compared with the int2 read's (``*_max_abs_diff``; outputs are O(1)).
Shapes: Qwen3-8B-like layer (32 query / 8 KV heads, head_dim 128), INT2 group 128, sink 16,
ring 128, page 64; random data; mean time of launches between CUDA events
(triton.testing.do_bench: prefill is not graph-captured in SGLang).

    python -m benchmarks.bench_extend [--out benchmarks/results/extend_h200.json]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import triton
import triton.testing

from benchmarks.bench_kernels import T0, log, run_main, save
from oscar_kernels import testing as kc
from oscar_kernels.triton_extend import EXTEND_TILES, triton_extend
from oscar_kernels.triton_materialize import triton_materialize_prefix

ROOT = Path(__file__).resolve().parents[1]

HQ, H, D = 32, 8, 128
S, W, PAGE, GROUP = 16, 128, 64, 128
CASES = ((0, 8192), (32768, 8192), (122880, 8192), (65536, 1024))  # (cached prefix, new tokens)


def time_us(fn, rep: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=3, rep=rep) * 1e3


def try_time(name: str, make) -> tuple[float | None, str | None]:
    try:
        return round(time_us(make()), 1), None
    except Exception as e:
        log(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
        return None, f"{type(e).__name__}: {str(e)[:500]}"


class Chunk:
    """One request: a cached hybrid prefix (random INT2 + BF16 sinks/ring) and a chunk of
    new tokens (q, and the rotated k', v' that the store hands to extend)."""

    def __init__(self, prefix: int, new: int, seed: int = 0, device: str = "cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        self.sc = kc.build_random([prefix], H=H, D=D, G=GROUP, S=S, W=W, page=PAGE, seed=seed, device=device)
        self.prefix, self.new, self.device = prefix, new, device
        self.q = torch.randn(new, HQ, D, generator=g, device=device).bfloat16()
        self.k = torch.randn(new, H, D, generator=g, device=device).bfloat16()
        self.v = torch.randn(new, H, D, generator=g, device=device).bfloat16()
        self.pre = torch.tensor([prefix], dtype=torch.int32, device=device)
        self.qo = torch.tensor([0, new], dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)

    def oscar(self, prefix_read: str):
        sc = self.sc
        return lambda: triton_extend(self.q, self.k, self.v, sc.layer, sc.index, sc.rotation, sc.req_to_token,
                                     sc.rows, self.pre, self.qo, self.new, sc.sm_scale, out=self.out,
                                     prefix_read=prefix_read, prefix_lens_host=[self.prefix])

    def materialize(self):
        sc = self.sc
        k = torch.empty(max(self.prefix, 1), H, D, dtype=torch.bfloat16, device=self.device)
        v = torch.empty_like(k)
        return lambda: triton_materialize_prefix(sc.layer, sc.index, sc.req_to_token, sc.rows, self.pre,
                                                 [self.prefix], k, v)

    def oscar_flashinfer(self):
        """FlashInferExtend: our materialisation + FlashInfer's prefill (planned once here)."""
        from oscar_kernels.flashinfer_extend import FlashInferExtend
        sc = self.sc
        fi = FlashInferExtend("cuda")
        fi.plan([self.prefix], [self.new], HQ, H, D, sc.sm_scale)
        return lambda: fi.run(self.q, self.k, self.v, sc.layer, sc.index, sc.rotation, sc.req_to_token, sc.rows,
                              self.pre, out=self.out)

    def flashinfer(self):
        import flashinfer
        total = self.prefix + self.new
        pages = -(-total // PAGE)
        k = torch.randn(pages, PAGE, H, D, device="cuda").bfloat16()
        v = torch.randn_like(k)
        ws = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        i32 = dict(dtype=torch.int32, device="cuda")
        w.plan(torch.tensor([0, self.new], **i32), torch.tensor([0, pages], **i32), torch.arange(pages, **i32),
               torch.tensor([total - (pages - 1) * PAGE], **i32), HQ, H, D, PAGE, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=self.sc.sm_scale)
        return lambda: w.run(self.q, (k, v), out=self.out)


def attention_flops(prefix: int, new: int) -> float:
    """QK and PV multiply-adds of causal attention over prefix + chunk, x2 (FLOPs)."""
    pairs = new * prefix + new * (new + 1) / 2
    return 4.0 * pairs * HQ * D


def plot(result: dict, path: Path) -> None:
    """Milliseconds per case and read (log scale), one group of bars per case."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    keys = [k for k in dict.fromkeys(k for c in cases for k in c)
            if k.endswith("_us") and k != "materialize_us"]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        xs = [j + i * width for j, c in enumerate(cases) if c.get(key)]
        ax.bar(xs, [c[key] / 1e3 for c in cases if c.get(key)], width, label=key[:-3])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))],
                  [f"prefix {c['prefix'] // 1024}k\n+{c['new']} new" for c in cases])
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer (one request)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{result.get('device', 'GPU')}: extend (prefill chunk over a cached prefix), one layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot -> {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "extend_h200.json"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    dev = torch.cuda.get_device_properties(0)
    result = {"device": dev.name, "torch": torch.__version__, "triton": triton.__version__,
              "shape": {"q_heads": HQ, "kv_heads": H, "head_dim": D, "group_size": GROUP, "sink_tokens": S,
                        "recent_window": W, "page_size": PAGE},
              "timing": "mean between CUDA events (triton.testing.do_bench), one layer, batch 1, random data",
              "cases": []}
    keys = ("block_rows", "block_n", "block_n_bf16", "num_stages")
    result["default_tiles"] = {read: {k: getattr(t, k) for k in keys} for read, t in EXTEND_TILES.items()}
    # the bf16 key names its tiles (rows, BF16 tokens per step, stages), as earlier runs' columns do
    variants = (("oscar_int2_us", "int2"), ("oscar_bf16_rows128_n64_s3_us", "bf16"))
    for prefix, new in CASES:
        log(f"case prefix={prefix} new={new}")
        chunk = Chunk(prefix, new)
        rec = {"prefix": prefix, "new": new, "attention_tflop": round(attention_flops(prefix, new) / 1e12, 3)}
        result["cases"].append(rec)
        ref_out = None  # every read must give the int2 read's output (same math, other order)
        for key, read in variants:
            rec[key], err = try_time(key, lambda: chunk.oscar(read))
            if err:
                rec[key.replace("_us", "_error")] = err
            elif ref_out is None:
                ref_out = chunk.out.float().clone()
            else:
                rec[key.replace("_us", "_max_abs_diff")] = round((chunk.out.float() - ref_out).abs().max().item(), 4)
        rec["oscar_flashinfer_us"], err = try_time("oscar_flashinfer", chunk.oscar_flashinfer)
        if err:
            rec["oscar_flashinfer_error"] = err
        elif ref_out is not None:
            rec["oscar_flashinfer_max_abs_diff"] = round((chunk.out.float() - ref_out).abs().max().item(), 4)
        if prefix:
            rec["materialize_us"], err = try_time("materialize", chunk.materialize)
            if err:
                rec["materialize_error"] = err
        rec["flashinfer_bf16_us"], err = try_time("flashinfer", chunk.flashinfer)
        if err:
            rec["flashinfer_error"] = err
        for key in [k for k, _ in variants] + ["oscar_flashinfer_us", "flashinfer_bf16_us"]:
            if rec.get(key):
                rec[key.replace("_us", "_tflops")] = round(attention_flops(prefix, new) / (rec[key] * 1e-6) / 1e12, 1)
        log("  " + ", ".join(f"{k}={v}" for k, v in rec.items() if k.endswith(("_us", "_tflops"))))
        save(result, out)
        del chunk
        torch.cuda.empty_cache()
    result["elapsed_s"] = round(time.time() - T0, 1)
    save(result, out)
    plot(result, out.with_suffix(".png"))
    log(f"done -> {out}")


if __name__ == "__main__":
    run_main(main)
