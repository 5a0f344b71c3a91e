"""Fidelity of the KV cache *through the server*: perplexity and passkey per method.

One SGLang server per method on the same model (default tinylm-A), all with
``--chunked-prefill-size 1024``: ``bf16`` (SGLang's own BF16 KV cache) and every
``--method NAME=FILE`` served with ``--kv-cache-dtype oscar_int2 --oscar-rotations FILE``
(naive / hadamard / oscar files from oscar-calibrate). The text, windows and prompts are
calibration.fidelity.tasks' (tinylm's own eval, token-exact), so the figures compare with
oscar-eval's simulator and tinylm-A.eval.json:

- perplexity over ``--ppl-windows`` held-out windows of ``--ppl-len`` + 1 tokens: each
  window goes to ``/generate`` as input ids with ``return_logprob`` and
  ``logprob_start_len=0``; SGLang prefills it in chunks of 1024 (every chunk reads the
  cache of the previous ones) and returns the log-probability of every input token;
- passkey: tinylm's prompts (lengths ``--lengths``, depths 0.1/0.5/0.9, ``--passkey-trials``
  each) through ``/v1/completions`` (OpenAI client), greedy, 10 tokens; a hit when the
  first 6 characters are the value.

    python -m benchmarks.server_fidelity --method naive=R/naive.safetensors \\
        --method hadamard=R/hadamard.safetensors --method oscar=R/oscar.safetensors

writes benchmarks/results/server_tinylm-A.json
({"methods": {"bf16": {"ppl_8k": .., "passkey": {"2048": .., ...}}, ...}}) after every
method, and the server logs to benchmarks/results/server_logs/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.server_harness import (ROOT, Server, default_model, log, previous_entries, run_script, same_run,
                                       save_json)
from calibration.fidelity import tasks

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "server_tinylm-A.json")
DEFAULT_LOGS = os.path.join(ROOT, "benchmarks", "results", "server_logs")


def position_buckets(length: int) -> list[tuple[int, int]]:
    from calibration.fidelity.runner import position_buckets as buckets

    return buckets(length)


def window_nll(server: Server, ids: list[int]) -> list[float]:
    """-log p(ids[j+1] | ids[:j+1]) for j = 0 .. len(ids)-2, from the server's input logprobs."""
    out = server.post("/generate", {
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    lps = out["meta_info"]["input_token_logprobs"]
    # [logprob, token id, text] per input token; the first has no logprob. (SGLang reports
    # the id of the last vocabulary entry as 0, hence the tolerance.)
    if len(lps) != len(ids) or any(int(t[1]) not in (i, 0) for t, i in zip(lps, ids)):
        raise RuntimeError(f"{server.name}: input logprobs cover {len(lps)} tokens, expected the "
                           f"{len(ids)} input ids in order")
    return [-float(t[0]) for t in lps[1:]]


def perplexity(server: Server, stream, length: int, windows: int, workers: int) -> dict:
    starts = tasks.ppl_window_starts(len(stream), length, windows)
    rows = [stream[s:s + length + 1].tolist() for s in starts]
    with ThreadPoolExecutor(workers) as ex:
        nlls = list(ex.map(lambda r: window_nll(server, r), rows))
    per_pos = [sum(col) / len(nlls) for col in zip(*nlls)]
    mean = sum(per_pos) / len(per_pos)
    return {"ppl": math.exp(mean), "nll": mean, "windows": len(starts), "window_starts": starts,
            "nll_by_window": [round(sum(w) / len(w), 6) for w in nlls],  # paired comparisons of methods
            "nll_by_position": {f"{lo}-{hi}": round(sum(per_pos[lo:hi]) / (hi - lo), 5)
                                for lo, hi in position_buckets(length)}}


def passkey(server: Server, model: str, prompts, workers: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600, max_retries=0)

    def answer(p):
        r = client.completions.create(model=model, prompt=p.ids.tolist(), temperature=0.0,
                                      max_tokens=tasks.PASSKEY_MAX_NEW_TOKENS)
        return r.choices[0].text

    with ThreadPoolExecutor(workers) as ex:
        answers = list(ex.map(answer, prompts))
    by_depth, examples = {}, []
    for p, a in zip(prompts, answers):
        cell = by_depth.setdefault(str(p.length), {}).setdefault(str(p.depth), [])
        cell.append(tasks.passkey_hit(a, p.value))
        if p.trial == 0:
            examples.append({"len": p.length, "depth": p.depth, "want": p.value, "got": a[:12]})
    hits = {k: [int(h) for d in v.values() for h in d] for k, v in by_depth.items()}  # same order every method
    by_depth = {k: {d: sum(h) / len(h) for d, h in v.items()} for k, v in by_depth.items()}
    mean = {k: sum(v.values()) / len(v) for k, v in by_depth.items()}
    return {"mean": mean, "by_depth": by_depth, "examples": examples, "hits": hits}


def _method(s: str) -> tuple[str, str]:
    name, eq, path = s.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"--method wants NAME=FILE, got {s!r}")
    if name == "bf16":
        raise argparse.ArgumentTypeError("'bf16' is the built-in reference")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"--method {name}: no such file {path}")
    return name, os.path.abspath(path)


def merge_outputs(paths: list[str], out: str) -> dict:
    """One result of several invocations' outputs (say one per method, run side by side on one
    GPU): their methods, which must share the model and settings; written to ``out``."""
    merged: dict = {}
    for path in paths:
        try:
            data = json.load(open(path))
        except (OSError, ValueError) as e:
            raise SystemExit(f"server_fidelity: --merge {path}: {e}")
        if merged and not same_run(data, merged):
            raise SystemExit(f"server_fidelity: --merge {path}: another model or other settings than {paths[0]}")
        merged = {**data, "methods": {**merged.get("methods", {}), **data.get("methods", {})}}
    merged.pop("wall_s", None)  # each invocation's own
    merged["merged_from"] = [os.path.basename(p) for p in paths]
    save_json(out, merged)
    return merged


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model("tinylm-A"))
    ap.add_argument("--method", action="append", type=_method, default=[], metavar="NAME=FILE")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 reference server")
    ap.add_argument("--bf16-backend", default="triton", help="--attention-backend of the bf16 server")
    ap.add_argument("--sink", type=int, default=None, help="--oscar-sink-tokens (default: the server's)")
    ap.add_argument("--recent", type=int, default=None, help="--oscar-recent-window (default: the server's)")
    ap.add_argument("--chunk", type=int, default=1024, help="--chunked-prefill-size")
    ap.add_argument("--ppl-len", type=int, default=8192)
    ap.add_argument("--ppl-windows", type=int, default=16, help="0: skip perplexity (passkey only)")
    ap.add_argument("--lengths", type=_ints, default=[2048, 4096, 8192], help="passkey lengths")
    ap.add_argument("--passkey-trials", type=int, default=20, help="prompts per (length, depth)")
    ap.add_argument("--workers", type=int, default=32, help="concurrent requests")
    ap.add_argument("--server-args", default="", help="extra server arguments for every method")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="runs nothing: the methods of these outputs (same model and settings) into --out")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--log-dir", default=DEFAULT_LOGS)
    return ap


def server_args(args, rotations: str | None) -> list[str]:
    import shlex

    a = ["--model-path", args.model, "--chunked-prefill-size", str(args.chunk),
         *shlex.split(args.server_args)]
    if not rotations:  # SGLang's BF16 cache; triton: the H200 default (FA3) is not in the wheel
        a += ["--attention-backend", args.bf16_backend]
    else:
        a += ["--kv-cache-dtype", "oscar_int2", "--oscar-rotations", rotations]
        if args.sink is not None:
            a += ["--oscar-sink-tokens", str(args.sink)]
        if args.recent is not None:
            a += ["--oscar-recent-window", str(args.recent)]
    return a


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        merge_outputs(args.merge, args.out)
        log(f"merged {len(args.merge)} outputs -> {args.out}")
        return 0
    t_all = time.time()
    methods = ([] if args.no_bf16 else [("bf16", None)]) + args.method
    if not methods:
        raise SystemExit("nothing to run (--no-bf16 and no --method)")
    from transformers import AutoTokenizer

    log(f"model {args.model}; methods {', '.join(m for m, _ in methods)}")
    tok = AutoTokenizer.from_pretrained(args.model)
    held = tasks.load_heldout_stream(tok)
    log(f"held-out stream: {held.description['tokens']} tokens from {held.description['files']} files")
    prompts = tasks.passkey_prompts(tasks.Passkey(tok, held.tokens), args.lengths, trials=args.passkey_trials)
    ppl_key = f"ppl_{args.ppl_len // 1024}k" if args.ppl_len % 1024 == 0 else f"ppl_{args.ppl_len}"
    result = {
        "model": os.path.basename(os.path.normpath(args.model)),
        "settings": {"chunked_prefill_size": args.chunk, "ppl_len": args.ppl_len,
                     "ppl_windows": args.ppl_windows, "passkey_lengths": args.lengths,
                     "passkey_depths": list(tasks.PASSKEY_DEPTHS), "passkey_trials": args.passkey_trials,
                     "oscar_sink_tokens": args.sink, "oscar_recent_window": args.recent,
                     "heldout": held.description,
                     "note": "server: SGLang 0.5.17 + oscar-sglang; None = the server's default"},
        "methods": {},
    }
    result["methods"] = previous_entries(args.out, result, "methods", [name for name, _ in methods])
    for name, rotations in methods:
        t0 = time.time()
        server = Server(f"fidelity-{name}", server_args(args, rotations), args.log_dir)
        try:
            startup = server.start()
            ppl = None
            if args.ppl_windows:  # 0: passkey only
                log(f"{name}: perplexity, {args.ppl_windows} windows of {args.ppl_len}")
                ppl = perplexity(server, held.tokens, args.ppl_len, args.ppl_windows, args.workers)
                log(f"{name}: {ppl_key} = {ppl['ppl']:.4f}")
            log(f"{name}: passkey, {len(prompts)} prompts")
            pk = passkey(server, args.model, prompts, args.workers)
            log(f"{name}: passkey " + ", ".join(f"{k}: {v:.3f}" for k, v in pk["mean"].items()))
        finally:
            server.stop()
        result["methods"][name] = {
            **({ppl_key: ppl["ppl"], "nll": ppl["nll"], "nll_by_position": ppl["nll_by_position"],
                "nll_by_window": ppl["nll_by_window"], "ppl_windows": ppl["windows"]} if ppl else {}),
            "passkey": pk["mean"], "passkey_by_depth": pk["by_depth"], "passkey_examples": pk["examples"], "passkey_hits": pk["hits"],
            "rotations": rotations, "server_cmd": server.cmd[1:], "server_log": server.log_path,
            "startup_s": round(startup, 1), "wall_s": round(time.time() - t0, 1),
        }
        result["wall_s"] = round(time.time() - t_all, 1)
        save_json(args.out, result)
        log(f"{name}: done in {time.time() - t0:.0f} s -> {args.out}")
    log(f"total wall time {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    run_script(main)
