"""Fidelity of the KV cache *through the server*: perplexity, agreement with BF16 and passkey per method.

One SGLang server per method on the same model (default tinylm-A), all with
``--chunked-prefill-size 1024``: ``bf16`` (SGLang's own BF16 KV cache), with ``--fp8``
``fp8_e4m3`` (SGLang's own FP8 KV cache, ``--kv-cache-dtype fp8_e4m3`` on bf16's attention
backend), and every ``--method NAME=FILE`` served with ``--kv-cache-dtype oscar_int2
--oscar-rotations FILE`` (naive / hadamard / oscar files from oscar-calibrate). The text,
windows and prompts are calibration.fidelity.tasks' (tinylm's own eval, token-exact), so the
figures compare with oscar-eval's simulator:

- perplexity over ``--ppl-windows`` held-out windows of each ``--ppl-len`` + 1 tokens: each
  window goes to ``/generate`` as input ids with ``return_logprob``, ``logprob_start_len=0``
  and ``top_logprobs_num=--topk``; SGLang prefills it in chunks of 1024 (every chunk reads the
  cache of the previous ones) and returns the log-probability of every input token and the
  ``--topk`` most likely tokens at every position;
- agreement with bf16 on those windows, past the first chunk: top-1 agreement (exact) and a
  lower bound on KL(bf16 || method) from the top-K lists (calibration.fidelity.agreement):
  every server's lists go to ``--topk-dir`` (one .npz per method), and each method is compared
  with bf16's lists once both exist (at the end of a run, or by ``--merge``);
- passkey: tinylm's prompts (lengths ``--lengths``, depths 0.1/0.5/0.9, ``--passkey-trials``
  each) through ``/v1/completions`` (OpenAI client), greedy, 10 tokens; a hit when the
  first 6 characters are the value.

    python -m benchmarks.server_fidelity --method naive=R/naive.safetensors \\
        --method hadamard=R/hadamard.safetensors --method oscar=R/oscar.safetensors

writes benchmarks/results/server_tinylm-A.json
({"methods": {"bf16": {"ppl_8k": .., "passkey": {"2048": .., ...}}, ...}}) after every
method, and the server logs to benchmarks/results/server_logs/. Several invocations (say one
per method, side by side on one GPU with ``--server-args "--mem-fraction-static 0.2"``, each
its own ``--out``) are joined by ``--merge A.json --merge B.json --out ALL.json``.
"""
from __future__ import annotations

import argparse
import base64
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.server_agreement import add_agreement, save_topk
from benchmarks.server_harness import (ROOT, Server, default_model, log, previous_entries, run_script, same_run,
                                       save_json)
from calibration.fidelity import tasks
from calibration.fidelity.args import Refusal, at_least, passkey_lengths, ppl_key, ppl_lengths

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "server_tinylm-A.json")
DEFAULT_LOGS = os.path.join(ROOT, "benchmarks", "results", "server_logs")
DEFAULT_TOPK_DIR = os.path.join(ROOT, ".device", "topk")  # ignored by git; kept on the GPU machine between calls


def position_buckets(length: int) -> list[tuple[int, int]]:
    from calibration.fidelity.runner import position_buckets as buckets

    return buckets(length)


def window_nll(server: Server, ids: list[int]) -> list[float]:
    """-log p(ids[j+1] | ids[:j+1]) for j = 0 .. len(ids)-2, from the server's input logprobs."""
    return window_logprobs(server, ids)["nll"]


def window_logprobs(server: Server, ids: list[int], topk: int = 0) -> dict:
    """One window through ``/generate``: ``nll`` = -log p(ids[j+1] | ids[:j+1]) for j = 0 .. len(ids)-2
    from the server's input logprobs and, with ``topk``, the server's ``topk`` most likely tokens
    at the same positions: ``top_lp`` float32 [len(ids)-1, topk] (descending) and ``top_idx``
    int32 [len(ids)-1, topk] (row j: the distribution that predicts ids[j+1])."""
    payload = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
               "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    if topk:  # SGLang 0.5.17: the prompt's top-K as base64 arrays, not 3-element lists per entry
        payload.update(top_logprobs_num=topk, return_flat_raw_top_logprobs=True,
                       return_flat_raw_top_logprobs_b64=True)
    meta = server.post("/generate", payload)["meta_info"]
    lps = meta["input_token_logprobs"]
    # [logprob, token id, text] per input token; the first has no logprob. (SGLang reports
    # the id of the last vocabulary entry as 0, hence the tolerance.)
    if len(lps) != len(ids) or any(int(t[1]) not in (i, 0) for t, i in zip(lps, ids)):
        raise RuntimeError(f"{server.name}: input logprobs cover {len(lps)} tokens, expected the "
                           f"{len(ids)} input ids in order")
    out = {"nll": [-float(t[0]) for t in lps[1:]]}
    if topk:
        out["top_lp"], out["top_idx"] = parse_top_logprobs(server.name, meta, len(ids), topk)
    return out


def parse_top_logprobs(name: str, meta: dict, n_ids: int, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompt's top-K of a /generate ``meta_info`` as arrays [n_ids - 1, topk] (row j: the
    distribution that predicts input token j + 1). SGLang's flat format
    (``return_flat_raw_top_logprobs``): ``input_top_logprobs_shape`` [rows, k],
    ``input_top_logprobs_null_prefix`` (the leading input tokens without a row: the first),
    and the values / ids as lists (``*_flat``) or base64 little-endian float32 / int32
    (``*_flat_b64``); or the nested ``input_top_logprobs``: per input token None or a list of
    ``[logprob, token id, text]``, most likely first."""
    if "input_top_logprobs_shape" in meta:
        rows, k = meta["input_top_logprobs_shape"]
        null = meta["input_top_logprobs_null_prefix"]
        if "input_top_logprobs_val_flat_b64" in meta:
            lp = np.frombuffer(base64.b64decode(meta["input_top_logprobs_val_flat_b64"]), dtype="<f4")
            idx = np.frombuffer(base64.b64decode(meta["input_top_logprobs_idx_flat_b64"]), dtype="<i4")
        else:
            lp = np.asarray(meta["input_top_logprobs_val_flat"], dtype=np.float32)
            idx = np.asarray(meta["input_top_logprobs_idx_flat"], dtype=np.int32)
        ok = null + rows == n_ids and null <= 1 and k >= topk and lp.size == idx.size == rows * k
        lp, idx = (lp.reshape(rows, k), idx.reshape(rows, k)) if ok else (None, None)
    else:
        tops = meta.get("input_top_logprobs")
        ok = isinstance(tops, list) and len(tops) == n_ids and all(t and len(t) >= topk for t in tops[1:])
        null = 1
        if ok:
            lp = np.array([[float(e[0]) for e in t[:topk]] for t in tops[1:]], dtype=np.float32)
            idx = np.array([[int(e[1]) for e in t[:topk]] for t in tops[1:]], dtype=np.int32)
    if not ok:
        raise RuntimeError(f"{name}: the prompt's top logprobs should hold {topk} entries for each of the "
                           f"{n_ids - 1} predicted input tokens")
    return np.ascontiguousarray(lp[1 - null:, :topk]), np.ascontiguousarray(idx[1 - null:, :topk])


def perplexity(server: Server, stream, length: int, windows: int, workers: int, topk: int = 0) -> dict:
    """Mean next-token NLL over ``windows`` held-out windows of ``length`` + 1 tokens; with ``topk``
    also ``top_lp`` / ``top_idx`` [windows, length, topk] (window_logprobs' rows, window by window)."""
    starts = tasks.ppl_window_starts(len(stream), length, windows)
    rows = [stream[s:s + length + 1].tolist() for s in starts]
    with ThreadPoolExecutor(workers) as ex:
        got = list(ex.map(lambda r: window_logprobs(server, r, topk), rows))
    nlls = [g["nll"] for g in got]
    per_pos = [sum(col) / len(nlls) for col in zip(*nlls)]
    mean = sum(per_pos) / len(per_pos)
    out = {"ppl": math.exp(mean), "nll": mean, "windows": len(starts), "window_starts": starts,
           "nll_by_window": [round(sum(w) / len(w), 6) for w in nlls],  # paired comparisons of methods
           "nll_by_position": {f"{lo}-{hi}": round(sum(per_pos[lo:hi]) / (hi - lo), 5)
                               for lo, hi in position_buckets(length)}}
    if topk:
        out["top_lp"] = np.stack([g["top_lp"] for g in got])
        out["top_idx"] = np.stack([g["top_idx"] for g in got])
    return out


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


FP8 = "fp8_e4m3"  # SGLang's own FP8 KV cache: --kv-cache-dtype fp8_e4m3 on bf16's attention backend
BUILT_IN = ("bf16", FP8)


def _method(s: str) -> tuple[str, str]:
    name, eq, path = s.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"--method wants NAME=FILE, got {s!r}")
    if name in BUILT_IN:
        raise argparse.ArgumentTypeError(f"{name!r} is a built-in method (bf16 always, fp8_e4m3 with --fp8)")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"--method {name}: no such file {path}")
    return name, os.path.abspath(path)


def _fail(msg: str) -> Refusal:
    return Refusal("server_fidelity", msg)


def merge_outputs(paths: list[str], out: str) -> dict:
    """One result of several invocations' outputs (say one per method, run side by side on one
    GPU): their methods, which must share the model and settings, compared with bf16's top-K
    lists; written to ``out``."""
    merged: dict = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise _fail(f"--merge {path}: {e}") from None
        if merged and not same_run(data, merged):
            raise _fail(f"--merge {path}: another model or other settings than {paths[0]}")
        merged = {**data, "methods": {**merged.get("methods", {}), **data.get("methods", {})}}
    merged.pop("wall_s", None)  # each invocation's own
    merged["merged_from"] = [os.path.basename(p) for p in paths]
    st = merged.get("settings", {})
    if st.get("topk"):
        add_agreement(merged, st["chunked_prefill_size"], st["topk_ref"])
    save_json(out, merged)
    return merged


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="server_fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model("tinylm-A"))
    ap.add_argument("--method", action="append", type=_method, default=[], metavar="NAME=FILE")
    ap.add_argument("--fp8", action="store_true", help=f"also serve {FP8} (SGLang's FP8 KV cache)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 reference server")
    ap.add_argument("--bf16-backend", default="triton", help="--attention-backend of the bf16 and fp8 servers")
    ap.add_argument("--sink", type=at_least(0), default=None, help="--oscar-sink-tokens (default: the server's)")
    ap.add_argument("--recent", type=at_least(0), default=None, help="--oscar-recent-window (default: the server's)")
    ap.add_argument("--chunk", type=at_least(1), default=1024, help="--chunked-prefill-size")
    ap.add_argument("--ppl-len", type=ppl_lengths, default=ppl_lengths("8192"),
                    help="perplexity window length(s), e.g. 2048,4096,8192 (results ppl_2k, ppl_4k, ppl_8k)")
    ap.add_argument("--ppl-windows", type=at_least(0), default=16,
                    help="windows per length; 0: skip perplexity and agreement (passkey only)")
    ap.add_argument("--topk", type=at_least(0), default=64,
                    help="top_logprobs_num of every perplexity request: the method's list for the KL bound "
                         "(0: no agreement)")
    ap.add_argument("--topk-ref", type=at_least(1), default=20,
                    help="bf16's top tokens that the KL bound keeps apart (<= --topk)")
    ap.add_argument("--topk-dir", default=DEFAULT_TOPK_DIR,
                    help="where each server's top-K lists go (one .npz per method and output; large, not results)")
    ap.add_argument("--lengths", type=passkey_lengths, default=[2048, 4096, 8192], help="passkey lengths")
    ap.add_argument("--passkey-trials", type=at_least(0), default=20,
                    help="prompts per (length, depth); 0: no passkey")
    ap.add_argument("--workers", type=at_least(1), default=32, help="concurrent requests")
    ap.add_argument("--server-args", default="",
                    help="extra server arguments for every method, e.g. '--mem-fraction-static 0.2 "
                         "--max-total-tokens 200000'")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="runs nothing: the methods of these outputs (same model and settings) into --out, "
                         "each compared with bf16's top-K lists")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--log-dir", default=DEFAULT_LOGS)
    return ap


def server_args(args, method: str, rotations: str | None) -> list[str]:
    import shlex

    a = ["--model-path", args.model, "--chunked-prefill-size", str(args.chunk),
         *shlex.split(args.server_args)]
    if not rotations:  # SGLang's own cache; triton: the H200 default (FA3) is not in the wheel
        a += ["--attention-backend", args.bf16_backend]
        if method == FP8:
            a += ["--kv-cache-dtype", FP8]
    else:
        a += ["--kv-cache-dtype", "oscar_int2", "--oscar-rotations", rotations]
        if args.sink is not None:
            a += ["--oscar-sink-tokens", str(args.sink)]
        if args.recent is not None:
            a += ["--oscar-recent-window", str(args.recent)]
    return a


def model_context(model: str, extra_server_args: str) -> int | None:
    """The context length a server of ``model`` accepts: --context-length in the extra server
    arguments, else the config's max_position_embeddings (None when neither says)."""
    import shlex

    extra = shlex.split(extra_server_args)
    if "--context-length" in extra[:-1]:
        return int(extra[extra.index("--context-length") + 1])
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    return cfg.get("max_position_embeddings")


def _topk_path(args, name: str) -> str:
    stem = os.path.splitext(os.path.basename(args.out))[0]
    return os.path.join(args.topk_dir, f"{stem}.{name}.npz")


def _measure(args, name: str, server: Server, held, prompts) -> dict:
    """One started server's results entry: perplexity per length (top-K lists to --topk-dir), passkey."""
    entry, per_len = {}, {}
    for n in args.ppl_len if args.ppl_windows else []:
        log(f"{name}: perplexity, {args.ppl_windows} windows of {n}")
        p = perplexity(server, held.tokens, n, args.ppl_windows, args.workers, args.topk)
        log(f"{name}: {ppl_key(n)} = {p['ppl']:.4f}")
        per_len[n] = p
        entry[ppl_key(n)] = p["ppl"]
    if per_len:
        first = per_len[args.ppl_len[0]]  # the keys of one-length runs, as they always were
        entry.update(nll=first["nll"], nll_by_position=first["nll_by_position"],
                     nll_by_window=first["nll_by_window"], ppl_windows=first["windows"])
        entry["ppl_details"] = {str(n): {k: v for k, v in p.items() if k not in ("top_lp", "top_idx")}
                                for n, p in per_len.items()}
        if args.topk:
            entry["topk_file"] = save_topk(_topk_path(args, name), per_len)
    if prompts:
        log(f"{name}: passkey, {len(prompts)} prompts")
        pk = passkey(server, args.model, prompts, args.workers)
        log(f"{name}: passkey " + ", ".join(f"{k}: {v:.3f}" for k, v in pk["mean"].items()))
        entry.update(passkey=pk["mean"], passkey_by_depth=pk["by_depth"], passkey_examples=pk["examples"],
                     passkey_hits=pk["hits"])
    return entry


AGREEMENT_NOTE = (
    "at every predicting position p >= {chunk} (past the first prefill chunk) of the perplexity windows, from "
    "each server's top_logprobs_num={k} lists (input_top_logprobs): top1 = the method's most likely next token "
    "is bf16's (tied tops: the tied sets meet), exact; kl_topk = a LOWER BOUND on KL(bf16 || method): both "
    "distributions coarsened to bf16's top {ref_k} tokens plus one bucket for the rest (log-sum inequality), "
    "each bf16 token missing from the method's top {k} (at most its {k}-th probability) given the mass in that "
    "range with the least KL; missing = bf16 top-{ref_k} tokens absent from the method's top {k}")


def settings(args, held) -> dict:
    """What makes two runs comparable (server_harness.same_run): the model's eval, not the methods."""
    return {"chunked_prefill_size": args.chunk,
            "ppl_len": args.ppl_len[0] if len(args.ppl_len) == 1 else args.ppl_len,  # one length: as always
            "ppl_windows": args.ppl_windows, "passkey_lengths": args.lengths,
            "passkey_depths": list(tasks.PASSKEY_DEPTHS), "passkey_trials": args.passkey_trials,
            "oscar_sink_tokens": args.sink, "oscar_recent_window": args.recent,
            "heldout": held.description,
            "note": "server: SGLang 0.5.17 + oscar-sglang; None = the server's default",
            **({"topk": args.topk, "topk_ref": args.topk_ref,
                "agreement": AGREEMENT_NOTE.format(chunk=args.chunk, ref_k=args.topk_ref, k=args.topk)}
               if args.topk and args.ppl_windows else {})}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        merge_outputs(args.merge, args.out)
        log(f"merged {len(args.merge)} outputs -> {args.out}")
        return 0
    if args.topk and args.topk_ref > args.topk:
        raise _fail(f"--topk-ref {args.topk_ref} exceeds --topk {args.topk}")
    t_all = time.time()
    methods = ([] if args.no_bf16 else [("bf16", None)]) + ([(FP8, None)] if args.fp8 else []) + args.method
    if not methods:
        raise _fail("nothing to run (--no-bf16, no --fp8 and no --method)")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise _fail(f"{args.model}: not a model folder (no config.json)")
    context = model_context(args.model, args.server_args)
    if context and args.ppl_windows and max(args.ppl_len) + 2 > context:
        raise _fail(f"--ppl-len {max(args.ppl_len)} needs {max(args.ppl_len) + 2} tokens per request (the window's "
                    f"{max(args.ppl_len) + 1} input ids and one generated token), more than the model's context of "
                    f"{context}: use at most {context - 2}")
    from transformers import AutoTokenizer

    log(f"model {args.model}; methods {', '.join(m for m, _ in methods)}")
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        raise _fail(f"{args.model}: no tokenizer ({str(e).splitlines()[0]})") from None
    try:
        held = tasks.load_heldout_stream(tok)
        prompts = tasks.passkey_prompts(tasks.Passkey(tok, held.tokens), args.lengths, trials=args.passkey_trials)
        for n in args.ppl_len if args.ppl_windows else []:
            tasks.ppl_window_starts(len(held.tokens), n, args.ppl_windows)
    except (FileNotFoundError, ValueError) as e:
        raise _fail(str(e)) from None
    log(f"held-out stream: {held.description['tokens']} tokens from {held.description['files']} files")
    result = {"model": os.path.basename(os.path.normpath(args.model)), "settings": settings(args, held),
              "methods": {}}
    result["methods"] = previous_entries(args.out, result, "methods", [name for name, _ in methods])
    for name, rotations in methods:
        t0 = time.time()
        server = Server(f"fidelity-{name}", server_args(args, name, rotations), args.log_dir)
        try:
            startup = server.start()
            entry = _measure(args, name, server, held, prompts)
        finally:
            server.stop()
        result["methods"][name] = {
            **entry, "rotations": rotations, "server_cmd": server.cmd[1:], "server_log": server.log_path,
            "startup_s": round(startup, 1), "wall_s": round(time.time() - t0, 1),
        }
        result["wall_s"] = round(time.time() - t_all, 1)
        if "topk" in result["settings"]:
            for done in add_agreement(result, args.chunk, args.topk_ref):
                ag = result["methods"][done]["agreement"]
                log(f"{done} vs bf16: " + ", ".join(f"{n}: top-1 {a['top1']:.4f}, KL >= {a['kl_topk']:.4f}"
                                                    for n, a in ag.items()))
        save_json(args.out, result)
        log(f"{name}: done in {time.time() - t0:.0f} s -> {args.out}")
    log(f"total wall time {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    run_script(main)
