"""oscar-eval: fidelity of the hybrid INT2 KV cache on an HF model, as the server stores it.

    oscar-eval --model DIR --method naive=FILE --method hadamard=FILE --method oscar=FILE \\
        [--sink S] [--recent W] [--chunk 1024] [--ppl-windows 16] [--passkey-trials N] \\
        [--lengths 2048,4096,8192] [--out JSON] [--device cpu|cuda]

Every method runs the same model with its attention routed through a KV simulator
(calibration.fidelity.sim_cache): ``bf16`` keeps K/V in BF16; each ``--method name=FILE``
stores them through the server's HybridAttention with that rotations file (BF16 sink of S tokens,
BF16 ring of the last W, INT2 history in between), prefilling in chunks of ``--chunk``
tokens and decoding token by token. Metrics: held-out perplexity over windows of
``--ppl-len`` tokens and tinylm's passkey retrieval (see calibration.fidelity.tasks).
``--int2-parts k`` / ``v`` quantise only keys / only values (PyTorch fake quantisation,
``kv-fake`` both) to attribute the INT2 error. Keys use the file's ``group_size``, values
its ``value_group_size`` (``--value-groups`` overrides the values' groups in fake runs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from oscar_kernels.contract.layout import SCALE_DTYPES
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import RotationsFileError, check_matches_model, load_rotations

from . import runner, tasks
from .attention import use_simulated_attention
from .sim_cache import Bf16KVSim, FakeInt2KVSim, HybridKVSim

DEFAULT_SINK_TOKENS = 16
DEFAULT_RECENT_WINDOW = 128
DEFAULT_PAGE_SIZE = 64
DEFAULT_CHUNK = 1024
DEFAULT_PPL_LEN = 8192
DEFAULT_PPL_WINDOWS = 16
DEFAULT_DECODE_TAIL = 0
DEFAULT_PASSKEY_TRIALS = 4  # CPU budget; use 20+ on a GPU (see README of the results)
DEFAULT_LENGTHS = "2048,4096,8192"
DEFAULT_OUT = "benchmarks/results/fidelity_tinylm-A.json"
INT2_PARTS = ("kv", "k", "v", "kv-fake")


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _float_list(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _value_groups(s: str) -> tuple[int, str]:
    g, _, dtype = s.partition(":")
    if not g.isdigit() or dtype not in SCALE_DTYPES:
        raise argparse.ArgumentTypeError(f"--value-groups wants G:DTYPE with DTYPE in {sorted(SCALE_DTYPES)}, got {s!r}")
    return int(g), dtype


def _method(s: str) -> tuple[str, str]:
    name, eq, path = s.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"--method wants NAME=FILE, got {s!r}")
    if name == "bf16":
        raise argparse.ArgumentTypeError("'bf16' is the built-in reference; name the method otherwise")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="oscar-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--method", action="append", type=_method, default=[], metavar="NAME=FILE",
                    help="a rotations file to evaluate under NAME (repeatable)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 reference")
    ap.add_argument("--sink", type=int, default=DEFAULT_SINK_TOKENS, help="BF16 sink tokens S")
    ap.add_argument("--recent", type=int, default=DEFAULT_RECENT_WINDOW, help="BF16 recent window W")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="pool page size (S <= page size)")
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prefill chunk (server --chunked-prefill-size)")
    ap.add_argument("--ppl-len", type=int, default=DEFAULT_PPL_LEN, help="perplexity window length")
    ap.add_argument("--ppl-windows", type=int, default=DEFAULT_PPL_WINDOWS, help="perplexity windows (0 = skip)")
    ap.add_argument("--decode-tail", type=int, default=DEFAULT_DECODE_TAIL,
                    help="last tokens of every ppl window fed one per step (decode) instead of prefilled")
    ap.add_argument("--passkey-trials", type=int, default=DEFAULT_PASSKEY_TRIALS,
                    help="prompts per (length, depth) cell (0 = skip)")
    ap.add_argument("--lengths", type=_int_list, default=_int_list(DEFAULT_LENGTHS), help="passkey lengths")
    ap.add_argument("--depths", type=_float_list, default=list(tasks.PASSKEY_DEPTHS), help="passkey depths")
    ap.add_argument("--corpus-mb", type=float, default=tasks.HELDOUT_CORPUS_MB, help="held-out text to read")
    ap.add_argument("--batch", type=int, default=1, help="sequences per forward (windows / prompts)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="model dtype (the KV cache is BF16/INT2 either way)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (1 is fastest on a shared, oversubscribed machine)")
    ap.add_argument("--int2-parts", choices=INT2_PARTS, default="kv",
                    help="kv: K and V through the server's kernels (default); ablations in PyTorch fake "
                         "quantisation (FakeInt2KVSim): k = INT2 keys only, v = INT2 values only, "
                         "kv-fake = both (the ablations' own baseline)")
    ap.add_argument("--value-groups", type=_value_groups, default=None, metavar="G:DTYPE",
                    help="with --int2-parts kv-fake or v: the values' INT2 group size and scale dtype "
                         "(e.g. 128:float8_e4m3fn; default: the rotations file's value_group_size and "
                         "scale_dtype)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="result JSON")
    return ap


def _check_disjoint(name: str, calib_data: str) -> None:
    low = calib_data.lower()
    hit = [p for p in tasks.HELDOUT_PACKAGES if p in low]
    if hit:
        raise SystemExit(f"oscar-eval: method {name}: its calibration data ({calib_data!r}) mentions the "
                         f"held-out eval packages {hit}; calibration and eval text must be disjoint")


def _load_model(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 local_files_only=True).to(device).eval()
    use_simulated_attention(model)
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    ids.add(tasks.token_id(tokenizer, tasks.EOT))
    return ids


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("oscar-eval: --device cuda but CUDA is not available")
    names = [n for n, _ in a.method]
    if len(set(names)) != len(names):
        raise SystemExit(f"oscar-eval: method names must be unique, got {names}")
    if a.no_bf16 and not a.method:
        raise SystemExit("oscar-eval: nothing to evaluate (--no-bf16 and no --method)")
    if a.value_groups and a.int2_parts not in ("kv-fake", "v"):
        raise SystemExit("oscar-eval: --value-groups needs --int2-parts kv-fake or v (the kernels take the "
                         "rotations file's groups and one scale dtype)")
    if a.threads:
        torch.set_num_threads(a.threads)
    t_start = time.time()
    rotations = {}
    try:
        for name, path in a.method:  # before the model loads: a bad file fails at once
            rotations[name] = (path, load_rotations(path))
            _check_disjoint(name, rotations[name][1].meta.calib_data)
        if not os.path.isfile(os.path.join(a.model, "config.json")):
            print(f"oscar-eval: error: {a.model}: not a model folder (no config.json)", file=sys.stderr)
            return 2
        model, tok = _load_model(a.model, a.device, a.dtype)
        shape = ModelShape.from_hf_config(model.config)
        for path, rot in rotations.values():
            check_matches_model(rot.meta, shape, path)
    except RotationsFileError as e:
        print(f"oscar-eval: error: {e}", file=sys.stderr)
        return 2

    try:
        stream = tasks.load_heldout_stream(tok, corpus_mb=a.corpus_mb)
    except FileNotFoundError as e:
        print(f"oscar-eval: error: {e}", file=sys.stderr)
        return 2
    pk = tasks.Passkey(tok, stream.tokens)
    prompts = tasks.passkey_prompts(pk, a.lengths, a.depths, a.passkey_trials) if a.passkey_trials > 0 else []
    eos = _eos_ids(model, tok)
    max_len = max([a.ppl_len if a.ppl_windows > 0 else 0]
                  + [len(p.ids) + tasks.PASSKEY_MAX_NEW_TOKENS for p in prompts])
    ppl_key = f"ppl_{a.ppl_len // 1024}k" if a.ppl_len % 1024 == 0 else f"ppl_{a.ppl_len}"

    def per_method(field: str):
        """The methods' common value of a metadata field, or {name: value} when they differ."""
        vals = {n: getattr(r.meta, field) for n, (_, r) in rotations.items()}
        if not vals:
            return None
        return next(iter(vals.values())) if len(set(vals.values())) == 1 else vals

    calib = {n: r.meta.calib_data for n, (_, r) in rotations.items()}
    result = {
        "model": os.path.basename(os.path.normpath(a.model)),
        "settings": {
            "sink": a.sink, "recent": a.recent,
            "group_size": per_method("group_size"), "value_group_size": per_method("value_group_size"),
            "calib": calib,
            "eval": {"text": stream.description,
                     "ppl": f"{a.ppl_windows} windows of {a.ppl_len} tokens evenly spread over the held-out "
                            "stream (tasks.ppl_window_starts), next-token NLL; chunked prefill, the last "
                            f"{a.decode_tail} tokens of each window decoded one per step",
                     "passkey": "tinylm_train.py eval prompts of L-16 tokens from the held-out stream, "
                                "greedy decoding, hit = first 6 characters equal the value"},
            "int2_parts": a.int2_parts,
            **({"value_groups": {"group_size": a.value_groups[0], "scale_dtype": a.value_groups[1]}}
               if a.value_groups else {}),
            "chunk": a.chunk, "page_size": a.page_size, "ppl_len": a.ppl_len, "ppl_windows": a.ppl_windows,
            "decode_tail": a.decode_tail,
            "passkey_trials": a.passkey_trials, "passkey_lengths": a.lengths, "passkey_depths": a.depths,
            "seeds": {"heldout_shuffle": tasks.HELDOUT_SHUFFLE_SEED, "passkey": tasks.PASSKEY_SEED},
            "batch": a.batch, "device": a.device, "threads": torch.get_num_threads(), "dtype": a.dtype, "cache_dtype": "bfloat16",
            "rotations": {n: {"file": os.path.abspath(p), "recipe": r.meta.recipe,
                              "recipe_detail": r.meta.recipe_detail, "calib_data": r.meta.calib_data,
                              "calib_tokens": r.meta.calib_tokens, "group_size": r.meta.group_size,
                              "value_group_size": r.meta.value_group_size, "scale_dtype": r.meta.scale_dtype,
                              "created": r.meta.created}
                          for n, (p, r) in rotations.items()},
            "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "methods": {},
    }

    todo = ([("bf16", None)] if not a.no_bf16 else []) + [(n, r) for n, (_, r) in rotations.items()]
    for name, rot in todo:
        t0 = time.time()
        if rot is None:
            sim = Bf16KVSim(shape.num_layers, shape.num_kv_heads, shape.head_dim, a.batch, max_len, a.device)
        elif a.int2_parts == "kv":
            sim = HybridKVSim(rot.layers, rot.meta.group_size, a.sink, a.recent, a.batch, max_len,
                              a.device, rot.meta.scale_dtype, a.page_size,
                              value_group_size=rot.meta.value_group_size)
        else:
            sim = FakeInt2KVSim(rot.layers, rot.meta.group_size, a.sink, a.recent, a.batch, max_len,
                                a.device, rot.meta.scale_dtype, parts=a.int2_parts.removesuffix("-fake"),
                                value_group_size=a.value_groups[0] if a.value_groups else rot.meta.value_group_size,
                                value_scale_dtype=a.value_groups[1] if a.value_groups else None)
        res = {}
        if a.ppl_windows > 0:
            p = runner.perplexity(model, sim, stream.tokens, a.ppl_len, a.ppl_windows, a.chunk, a.batch,
                                  a.decode_tail, desc=f"{name} ppl")
            res[ppl_key] = p["ppl"]
            if a.decode_tail:
                res["ppl_decode_tail"] = p["ppl_decode"]
            res["ppl_detail"] = p
        if prompts:
            pr = runner.passkey(model, sim, tok, prompts, a.chunk, eos, a.batch, desc=f"{name} passkey")
            res["passkey"] = pr["mean"]
            res["passkey_by_depth"] = pr["by_depth"]
            res["passkey_examples"] = pr["examples"]
            res["passkey_first_token_logprob"] = pr["first_token_logprob"]
            res["passkey_hits"] = pr["hits"]  # per prompt: the report's paired interval
            res["passkey_first_token_logprobs"] = pr["first_token_logprobs"]
        res["wall_s"] = round(time.time() - t0, 1)
        result["methods"][name] = res
        _write(a.out, result)
        summary = {k: res[k] for k in (ppl_key, "ppl_decode_tail", "passkey") if k in res}
        print(f"oscar-eval: {name}: {json.dumps(summary)} ({res['wall_s']} s)", file=sys.stderr, flush=True)
        del sim
    result["settings"]["wall_s"] = round(time.time() - t_start, 1)
    _write(a.out, result)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
