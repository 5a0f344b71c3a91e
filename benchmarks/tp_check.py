"""Tensor parallelism: greedy outputs of ``--tp-size N`` against ``--tp-size 1``.

For every configuration (``--configs``, default ``oscar_int2,bf16``; bf16 is the control
that shows how far tensor parallelism alone moves greedy outputs: the all-reduce changes
the summation order) the script starts one server at tp=1 and one at ``--tp``, sends the
same prompts one at a time (no batching effects) to ``/generate`` with greedy decoding, and
compares the output tokens. With tinylm-A (2 KV heads) and tp=2 every rank holds one KV
head and loads only that head's rotations; tp=4 replicates each head on two ranks.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set for every server unless already set).

    python -m benchmarks.tp_check --rotations tinylm-A.oscar.safetensors [--tp 2]

writes benchmarks/results/tp_tinylm-A.json: per configuration and tp, start-up time and
``max_total_num_tokens``; per configuration the prompts whose outputs are equal, those
equal up to one near-tie of the tp=1 run (its top two within --near-tie nats, tp=N taking
the runner-up), and the first divergent token of the others with tp=1's top-2 gap there.
"""
from __future__ import annotations

import argparse
import os
import time

from benchmarks.server_harness import (ROOT, Server, agree_up_to_a_near_tie, default_model, first_divergence, log,
                                       run_script, save_json)

CONFIGS = ("oscar_int2", "bf16")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def build_prompts(stream, count: int, shortest: int, longest: int) -> list[list[int]]:
    """``count`` prompts from the held-out token stream, lengths spread evenly over
    [shortest, longest], taken from disjoint places."""
    step = (longest - shortest) / max(1, count - 1)
    lengths = [int(shortest + k * step) for k in range(count)]
    stride = len(stream) // count
    return [[int(t) for t in stream[k * stride:k * stride + n]] for k, n in enumerate(lengths)]


def config_args(name: str, rotations: str | None) -> list[str]:
    if name == "bf16":
        return ["--attention-backend", "triton"]  # the H200 default (FA3) is not in the wheel
    return ["--kv-cache-dtype", "oscar_int2", "--oscar-rotations", rotations]


def greedy_outputs(server: Server, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list[dict]]]:
    """Per prompt: the greedy output ids and, per position, the top-2 {token id: logprob}."""
    outs = []
    for ids in prompts:
        r = server.post("/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                                      "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new,
                                                          "ignore_eos": True}})
        tops = [{tid: lp for lp, tid, *_ in pos} for pos in r["meta_info"]["output_top_logprobs"]]
        outs.append((r["output_ids"], tops))
    return outs


def compare(prompts, ref, got, margin: float) -> dict:
    """tp=N outputs against tp=1: exact, equal up to one near-tie of the tp=1 run, or not."""
    rows = []
    for p, (want, want_top), (ids, _) in zip(prompts, ref, got):
        k = first_divergence(ids, want)
        if k < 0:
            continue
        why = agree_up_to_a_near_tie(ids, want, want_top, margin)
        top = sorted(want_top[k].values(), reverse=True) if k < len(want_top) else []
        rows.append({"prompt_len": len(p), "token": k, "near_tie": why is None,
                     "ref_top2_gap": round(top[0] - top[1], 4) if len(top) > 1 else None})
    return {"compared": len(prompts), "exact_equal": len(prompts) - len(rows),
            "equal_up_to_a_near_tie": len(prompts) - sum(not r["near_tie"] for r in rows),
            "near_tie_nats": margin, "first_divergent_token": rows}


def run_config(name: str, args, prompts, rotations) -> dict:
    res = {"config": name, "runs": {}}
    outputs = {}
    for tp in (1, args.tp):
        server_args = ["--model-path", args.model, "--tp-size", str(tp),
                       "--chunked-prefill-size", str(args.chunk), "--mem-fraction-static", str(args.mem_fraction),
                       *config_args(name, rotations)]
        server = Server(f"tp{tp}-{name}", server_args, args.log_dir, env=NO_MULTICAST)
        try:
            startup = server.start()
            t0 = time.time()
            outputs[tp] = greedy_outputs(server, prompts, args.max_new_tokens)
            res["runs"][f"tp{tp}"] = {"startup_s": round(startup, 1),
                                      "max_total_num_tokens": server.max_total_num_tokens()[0],
                                      "requests_wall_s": round(time.time() - t0, 1),
                                      "server_cmd": server.cmd[1:], "server_log": server.log_path}
            log(f"{name} tp={tp}: {len(prompts)} prompts in {time.time() - t0:.1f} s")
        finally:
            server.stop()
    res.update(compare(prompts, outputs[1], outputs[args.tp], args.near_tie))
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model("tinylm-A"))
    ap.add_argument("--rotations", default=None, help="rotations file of the model (needed for oscar_int2)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size compared with 1")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--shortest", type=int, default=1024)
    ap.add_argument("--longest", type=int, default=8192)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--near-tie", type=float, default=0.1,
                    help="nats: a divergence where tp=1's top two are this close counts as a near-tie")
    ap.add_argument("--chunk", type=int, default=1024, help="--chunked-prefill-size")
    ap.add_argument("--mem-fraction", type=float, default=0.5, help="--mem-fraction-static")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tp_tinylm-A.json"))
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "benchmarks", "results", "tp_logs"))
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if any(c not in CONFIGS for c in configs):
        raise SystemExit(f"--configs: choose from {', '.join(CONFIGS)}")
    if "oscar_int2" in configs and not args.rotations:
        raise SystemExit("--rotations FILE is needed for oscar_int2 (make one with oscar-calibrate)")
    if args.tp < 2:
        raise SystemExit("--tp must be >= 2")
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    from transformers import AutoTokenizer

    from calibration.fidelity import tasks

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = build_prompts(tasks.load_heldout_stream(tok).tokens, args.prompts, args.shortest, args.longest)
    result = {"model": os.path.basename(os.path.normpath(args.model)), "rotations": args.rotations,
              "settings": {k: getattr(args, k) for k in ("tp", "prompts", "shortest", "longest",
                                                         "max_new_tokens", "chunk", "mem_fraction")},
              "configs": {}}
    for name in configs:
        result["configs"][name] = run_config(name, args, prompts, args.rotations)
        save_json(args.out, result)
        c = result["configs"][name]
        log(f"{name}: tp={args.tp} equals tp=1 on {c['exact_equal']}/{c['compared']} prompts "
            f"({c['equal_up_to_a_near_tie']} up to a near-tie) -> {args.out}")
    return 0


if __name__ == "__main__":
    run_script(main)
