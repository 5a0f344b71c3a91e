"""oscar-eval: fidelity of the hybrid INT2 KV cache on an HF model, as the server stores it.

    oscar-eval --model DIR --method naive=FILE --method hadamard=FILE --method oscar=FILE \\
        [--sink S] [--recent W] [--chunk 1024] [--ppl-len 2048,4096,8192] [--ppl-windows 16] \\
        [--passkey-trials N] [--lengths 2048,4096,8192] [--out JSON] [--device cpu|cuda]

Every method runs the same model with its attention routed through a KV simulator
(calibration.fidelity.sim_cache): ``bf16`` keeps K/V in BF16; each ``--method name=FILE``
stores them through the server's HybridAttention with that rotations file (BF16 sink of S tokens,
BF16 ring of the last W, INT2 history in between), prefilling in chunks of ``--chunk``
tokens and decoding token by token. Metrics: held-out perplexity over windows of each
``--ppl-len`` (``ppl_2k``, ``ppl_8k``, ...), tinylm's passkey retrieval (see
calibration.fidelity.tasks) and, for every method, agreement with bf16 on the perplexity
windows: the methods run in lockstep with bf16, chunk by chunk, and each chunk's logits are
compared with bf16's at once (top-1 agreement, KL(bf16 || method) over the whole vocabulary and
the lower bound the server's top-K lists give; see calibration.fidelity.agreement) over the
positions past the first chunk, which read fresh BF16 K/V.
``--int2-parts k`` / ``v`` quantise only keys / only values (PyTorch fake quantisation,
``kv-fake`` both) to attribute the INT2 error. Keys use the file's ``group_size``, values
its ``value_group_size`` (``--value-groups`` overrides the values' groups in fake runs);
``--key-channel-page P`` (fake runs only) quantises the keys KIVI-style instead: one scale and
min per rotated channel over each page of P positions (simulator only; no kernel stores it).
Per layer: ``--layer-rotations FILE:LAYERS`` gives those layers the rotations, key and value
groups of another rotations file of the same model (one calibrated for those groups), so a
layout can spend its bytes unevenly over the layers (kernels' numerics, reference path);
``--bf16-layers LAYERS`` keeps those layers' K/V in BF16, to charge the INT2 loss to layers;
``--bf16-kv-heads HEADS`` keeps those KV heads' K/V in BF16 in every layer, to charge it to heads.
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
from .args import Refusal, at_least, depths, layer_list, passkey_lengths, ppl_key, ppl_lengths
from .attention import use_simulated_attention
from .sim_cache import Bf16KVSim, FakeInt2KVSim, HybridKVSim, LayerSplitKVSim

DEFAULT_SINK_TOKENS = 16
DEFAULT_RECENT_WINDOW = 128
DEFAULT_PAGE_SIZE = 64
DEFAULT_CHUNK = 1024
DEFAULT_PPL_LEN = "8192"
DEFAULT_PPL_WINDOWS = 16
DEFAULT_DECODE_TAIL = 0
DEFAULT_PASSKEY_TRIALS = 4  # CPU budget; use 20+ on a GPU (see README of the results)
DEFAULT_LENGTHS = "2048,4096,8192"
DEFAULT_OUT = "benchmarks/results/fidelity_tinylm-A.json"
INT2_PARTS = ("kv", "k", "v", "kv-fake")


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


def _layer_rotations(s: str) -> tuple[str, list[int]]:
    path, colon, layers = s.rpartition(":")
    if not colon or not path:
        raise argparse.ArgumentTypeError(f"--layer-rotations wants FILE:LAYERS (e.g. g8.safetensors:3,7), got {s!r}")
    return path, layer_list(layers)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="oscar-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--method", action="append", type=_method, default=[], metavar="NAME=FILE",
                    help="a rotations file to evaluate under NAME (repeatable)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 reference")
    ap.add_argument("--sink", type=at_least(0), default=DEFAULT_SINK_TOKENS, help="BF16 sink tokens S")
    ap.add_argument("--recent", type=at_least(0), default=DEFAULT_RECENT_WINDOW, help="BF16 recent window W")
    ap.add_argument("--page-size", type=at_least(1), default=DEFAULT_PAGE_SIZE, help="pool page size (S <= page size)")
    ap.add_argument("--chunk", type=at_least(1), default=DEFAULT_CHUNK,
                    help="prefill chunk (server --chunked-prefill-size)")
    ap.add_argument("--ppl-len", type=ppl_lengths, default=ppl_lengths(DEFAULT_PPL_LEN),
                    help="perplexity window length(s), e.g. 2048,4096,8192 (results ppl_2k, ppl_4k, ppl_8k)")
    ap.add_argument("--ppl-windows", type=at_least(0), default=DEFAULT_PPL_WINDOWS,
                    help="perplexity windows per length (0 = skip)")
    ap.add_argument("--decode-tail", type=at_least(0), default=DEFAULT_DECODE_TAIL,
                    help="last tokens of every ppl window fed one per step (decode) instead of prefilled")
    ap.add_argument("--passkey-trials", type=at_least(0), default=DEFAULT_PASSKEY_TRIALS,
                    help="prompts per (length, depth) cell (0 = skip)")
    ap.add_argument("--lengths", type=passkey_lengths, default=passkey_lengths(DEFAULT_LENGTHS),
                    help=f"passkey lengths (each >= {tasks.passkey_min_length()})")
    ap.add_argument("--depths", type=depths, default=list(tasks.PASSKEY_DEPTHS),
                    help="passkey depths, each in (0, 1)")
    ap.add_argument("--corpus-mb", type=float, default=tasks.HELDOUT_CORPUS_MB, help="held-out text to read")
    ap.add_argument("--batch", type=at_least(1), default=1, help="sequences per forward (windows / prompts)")
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
    ap.add_argument("--key-channel-page", type=at_least(0), default=0, metavar="P",
                    help="with --int2-parts kv-fake or k: KIVI-style keys, one scale and min per rotated channel "
                         "over each page of P positions (0 = the rotations file's per-token key groups; "
                         "needs --recent >= P)")
    ap.add_argument("--key-page-scale-dtype", choices=sorted(SCALE_DTYPES), default=None,
                    help="with --key-channel-page: the page scales' dtype (default: the rotations file's)")
    ap.add_argument("--key-debias", type=float, default=0.0, metavar="C",
                    help="the INT2 keys' logit debias, times C: 1 as the kernels apply it, 0 off (default) "
                         "(the kernels take 0 or 1; the fake-quantisation ablations any C >= 0)")
    ap.add_argument("--layer-rotations", type=_layer_rotations, action="append", default=[], metavar="FILE:LAYERS",
                    help="with --int2-parts kv: these layers (e.g. 3,7-9) take their rotations and key/value groups "
                         "from FILE (same model and scale dtype) in every method (repeatable, disjoint layers)")
    ap.add_argument("--bf16-layers", type=layer_list, default=[], metavar="LAYERS",
                    help="these layers keep K/V in BF16 in every method (attribution of the INT2 loss to layers)")
    ap.add_argument("--bf16-kv-heads", type=layer_list, default=[], metavar="HEADS",
                    help="these KV heads (e.g. 0,2) keep K/V in BF16 in every INT2 layer of every method "
                         "(attribution of the INT2 loss to KV heads)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="result JSON")
    return ap


def _check_disjoint(name: str, calib_data: str) -> None:
    low = calib_data.lower()
    hit = [p for p in tasks.HELDOUT_PACKAGES if p in low]
    if hit:
        raise _refuse(f"method {name}: its calibration data ({calib_data!r}) mentions the "
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


def _refuse(msg: str) -> Refusal:
    return Refusal("oscar-eval", msg)


def _per_layer(rot, overrides: list) -> tuple[list, list[tuple[int, int]]]:
    """A method's rotations and (keys', values') groups of every layer: ``rot``'s, but for the
    layers of each (layers, other rotations) in ``overrides``, which take the other file's."""
    layers = list(rot.layers)
    groups = [(gk, rot.meta.value_group_size) for gk in rot.meta.key_group_sizes]
    for ids, other in overrides:
        for i in ids:
            layers[i], groups[i] = other.layers[i], (other.meta.key_group_sizes[i], other.meta.value_group_size)
    return layers, groups


def _build_sim(rot, a, shape, max_len: int, overrides: list = ()):
    """The KV simulator of one method (``rot`` None: bf16) for sequences of up to ``max_len``;
    ``overrides``: [(layers, rotations)] of --layer-rotations; --bf16-layers wraps it."""
    bf16 = lambda: Bf16KVSim(shape.num_layers, shape.num_kv_heads, shape.head_dim, a.batch, max_len, a.device)
    if rot is None:
        return bf16()
    sim = _build_int2_sim(rot, a, max_len, overrides)
    split = a.bf16_layers or a.bf16_kv_heads
    return LayerSplitKVSim(sim, bf16(), a.bf16_layers, a.bf16_kv_heads) if split else sim


def _build_int2_sim(rot, a, max_len: int, overrides: list):
    if a.int2_parts == "kv":
        layers, groups = _per_layer(rot, overrides)
        return HybridKVSim(layers, [g for g, _ in groups], a.sink, a.recent, a.batch, max_len,
                           a.device, rot.meta.scale_dtype, a.page_size, value_group_size=[g for _, g in groups],
                           key_debias=a.key_debias == 1.0)
    return FakeInt2KVSim(rot.layers, rot.meta.group_size, a.sink, a.recent, a.batch, max_len,
                         a.device, rot.meta.scale_dtype, parts=a.int2_parts.removesuffix("-fake"),
                         value_group_size=a.value_groups[0] if a.value_groups else rot.meta.value_group_size,
                         value_scale_dtype=a.value_groups[1] if a.value_groups else None,
                         key_channel_page=a.key_channel_page, key_page_scale_dtype=a.key_page_scale_dtype,
                         key_debias=a.key_debias)


def _summary(res: dict, lengths: list[int]) -> dict:
    """The figures printed per method: perplexities, agreement with bf16 past the first chunk, passkey."""
    out = {k: res[k] for k in [ppl_key(n) for n in lengths] + ["ppl_decode_tail"] if k in res}
    for n, ag in res.get("agreement", {}).items():
        out[f"top1_{n}"], out[f"kl_{n}"] = ag["top1"], ag["kl"]
    if "passkey" in res:
        out["passkey"] = res["passkey"]
    return out


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise _refuse("--device cuda but CUDA is not available")
    names = [n for n, _ in a.method]
    if len(set(names)) != len(names):
        raise _refuse(f"method names must be unique, got {names}")
    if a.no_bf16 and not a.method:
        raise _refuse("nothing to evaluate (--no-bf16 and no --method)")
    if a.value_groups and a.int2_parts not in ("kv-fake", "v"):
        raise _refuse("--value-groups needs --int2-parts kv-fake or v (the kernels take the "
                      "rotations file's groups and one scale dtype)")
    if a.key_channel_page and a.int2_parts not in ("kv-fake", "k"):
        raise _refuse("--key-channel-page needs --int2-parts kv-fake or k (the kernels store per-token key groups)")
    if a.key_channel_page and a.recent < a.key_channel_page:
        raise _refuse(f"--key-channel-page {a.key_channel_page} needs --recent >= it (an incomplete page stays "
                      f"in the BF16 ring), got --recent {a.recent}")
    if a.key_debias < 0 or (a.int2_parts == "kv" and a.key_debias not in (0.0, 1.0)):
        raise _refuse(f"--key-debias {a.key_debias}: the kernels (--int2-parts kv) take 0 or 1, the "
                      "fake-quantisation ablations any C >= 0")
    if a.key_page_scale_dtype and not a.key_channel_page:
        raise _refuse("--key-page-scale-dtype needs --key-channel-page")
    if a.ppl_windows and a.decode_tail >= min(a.ppl_len):
        raise _refuse(f"--decode-tail {a.decode_tail} must be shorter than the shortest --ppl-len {min(a.ppl_len)}")
    if a.layer_rotations and a.int2_parts != "kv":
        raise _refuse("--layer-rotations needs --int2-parts kv (the fake-quantisation ablations take one group size)")
    over = [i for _, ids in a.layer_rotations for i in ids]
    if len(set(over)) != len(over):
        raise _refuse(f"--layer-rotations: a layer is given twice ({sorted(i for i in set(over) if over.count(i) > 1)})")
    if a.threads:
        torch.set_num_threads(a.threads)
    t_start = time.time()
    rotations = {}
    try:
        for name, path in a.method:  # before the model loads: a bad file fails at once
            rotations[name] = (path, load_rotations(path))
            _check_disjoint(name, rotations[name][1].meta.calib_data)
            if rotations[name][1].meta.per_layer_key_groups and a.int2_parts != "kv":
                raise _refuse(f"{path} sets key groups per layer: --int2-parts {a.int2_parts} (fake quantisation) "
                              f"takes one group size; use --int2-parts kv")
        if not os.path.isfile(os.path.join(a.model, "config.json")):
            raise _refuse(f"{a.model}: not a model folder (no config.json)")
        model, tok = _load_model(a.model, a.device, a.dtype)
        shape = ModelShape.from_hf_config(model.config)
        if shape.is_hybrid:  # the simulated caches index their rotations by the model's layer index
            raise _refuse(f"{a.model}: only layers {', '.join(map(str, shape.attention_layers))} of its "
                          f"{shape.num_layers} are full attention; the simulated cache serves models whose "
                          f"every layer is full attention")
        for path, rot in rotations.values():
            check_matches_model(rot.meta, shape, path)
        overrides = []  # [(layers, rotations)] of --layer-rotations
        for path, ids in a.layer_rotations:
            other = load_rotations(path)
            _check_disjoint(path, other.meta.calib_data)
            check_matches_model(other.meta, shape, path)
            bad = [i for i in ids if i >= shape.num_layers]
            if bad:
                raise _refuse(f"--layer-rotations {path}: layers {bad} outside the model's {shape.num_layers}")
            dtypes = {r.meta.scale_dtype for _, r in rotations.values()} | {other.meta.scale_dtype}
            if len(dtypes) > 1:
                raise _refuse(f"--layer-rotations {path}: scale dtypes {sorted(dtypes)} differ (the cache takes one)")
            overrides.append((ids, other))
        bad = [i for i in a.bf16_layers if i >= shape.num_layers]
        if bad:
            raise _refuse(f"--bf16-layers {bad}: outside the model's {shape.num_layers} layers")
        bad = [h for h in a.bf16_kv_heads if h >= shape.num_kv_heads]
        if bad:
            raise _refuse(f"--bf16-kv-heads {bad}: outside the model's {shape.num_kv_heads} KV heads")
    except RotationsFileError as e:
        raise _refuse(str(e)) from None

    try:
        stream = tasks.load_heldout_stream(tok, corpus_mb=a.corpus_mb)
        pk = tasks.Passkey(tok, stream.tokens)
        prompts = tasks.passkey_prompts(pk, a.lengths, a.depths, a.passkey_trials) if a.passkey_trials > 0 else []
        if a.ppl_windows:
            for n in a.ppl_len:
                tasks.ppl_window_starts(len(stream.tokens), n, a.ppl_windows)
    except (FileNotFoundError, ValueError) as e:
        raise _refuse(str(e)) from None
    eos = _eos_ids(model, tok)
    max_len = max([max(a.ppl_len) if a.ppl_windows > 0 else 0]
                  + [len(p.ids) + tasks.PASSKEY_MAX_NEW_TOKENS for p in prompts])

    def per_method(field: str):
        """The methods' common value of a metadata field, or {name: value} when they differ."""
        vals = {n: getattr(r.meta, field) for n, (_, r) in rotations.items()}
        if not vals:
            return None
        return next(iter(vals.values())) if len(set(vals.values())) == 1 else vals

    calib = {n: r.meta.calib_data for n, (_, r) in rotations.items()}
    lens_text = " / ".join(map(str, a.ppl_len))
    ppl_len = a.ppl_len[0] if len(a.ppl_len) == 1 else a.ppl_len  # one length: the key as it always was
    result = {
        "model": os.path.basename(os.path.normpath(a.model)),
        "settings": {
            "sink": a.sink, "recent": a.recent,
            "group_size": per_method("group_size"), "value_group_size": per_method("value_group_size"),
            "calib": calib,
            "eval": {"text": stream.description,
                     "ppl": f"{a.ppl_windows} windows of {lens_text} tokens evenly spread over the held-out "
                            "stream (tasks.ppl_window_starts), next-token NLL; chunked prefill, the last "
                            f"{a.decode_tail} tokens of each window decoded one per step",
                     "agreement": "every method in lockstep with bf16 on the perplexity windows, at each predicting "
                                  f"position p >= {a.chunk} (past the first chunk, which reads fresh BF16 K/V): top1 = "
                                  "the method's most likely next token is bf16's (tied tops: the tied sets meet); "
                                  "kl = KL(bf16 || method) over the whole vocabulary; kl_topk = the lower bound that "
                                  f"top-K lists give (bf16's top {runner.TOPK_REF}, the method's top "
                                  f"{runner.TOPK_METHOD}, as benchmarks.server_fidelity computes it through the "
                                  "server); missing = bf16 top tokens absent from the method's list",
                     "passkey": "tinylm_train.py eval prompts of L-16 tokens from the held-out stream, "
                                "greedy decoding, hit = first 6 characters equal the value"},
            "int2_parts": a.int2_parts, "key_debias": a.key_debias,
            **({"value_groups": {"group_size": a.value_groups[0], "scale_dtype": a.value_groups[1]}}
               if a.value_groups else {}),
            **({"key_channel_page": {"page": a.key_channel_page,
                                     "scale_dtype": a.key_page_scale_dtype or per_method("scale_dtype")}}
               if a.key_channel_page else {}),
            "chunk": a.chunk, "page_size": a.page_size, "ppl_len": ppl_len, "ppl_windows": a.ppl_windows,
            "decode_tail": a.decode_tail,
            "passkey_trials": a.passkey_trials, "passkey_lengths": a.lengths, "passkey_depths": a.depths,
            "seeds": {"heldout_shuffle": tasks.HELDOUT_SHUFFLE_SEED, "passkey": tasks.PASSKEY_SEED},
            "batch": a.batch, "device": a.device, "threads": torch.get_num_threads(), "dtype": a.dtype, "cache_dtype": "bfloat16",
            "rotations": {n: {"file": os.path.abspath(p), "recipe": r.meta.recipe,
                              "recipe_detail": r.meta.recipe_detail, "calib_data": r.meta.calib_data,
                              "calib_tokens": r.meta.calib_tokens, "group_size": r.meta.group_size,
                              "value_group_size": r.meta.value_group_size, "scale_dtype": r.meta.scale_dtype,
                              "created": r.meta.created,
                              **({"layer_groups": [list(g) for g in _per_layer(r, overrides)[1]]}
                                 if overrides or a.bf16_layers or a.bf16_kv_heads or r.meta.per_layer_key_groups
                                 else {})}
                          for n, (p, r) in rotations.items()},
            **({"layer_rotations": [{"file": os.path.abspath(p), "layers": ids, "recipe_detail": o.meta.recipe_detail,
                                     "group_size": o.meta.group_size, "value_group_size": o.meta.value_group_size,
                                     "calib_data": o.meta.calib_data, "created": o.meta.created}
                                    for (p, _), (ids, o) in zip(a.layer_rotations, overrides)]}
               if overrides else {}),
            **({"bf16_layers": a.bf16_layers} if a.bf16_layers else {}),
            **({"bf16_kv_heads": a.bf16_kv_heads} if a.bf16_kv_heads else {}),
            "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "methods": {},
    }

    todo = ([("bf16", None)] if not a.no_bf16 else []) + [(n, r) for n, (_, r) in rotations.items()]
    sims = {name: _build_sim(rot, a, shape, max_len, overrides) for name, rot in todo}
    methods = result["methods"] = {name: {} for name in sims}
    seconds = dict.fromkeys(sims, 0.0)
    if a.ppl_windows > 0:  # every length, all methods in lockstep with bf16
        for n in a.ppl_len:
            per = runner.perplexity_lockstep(model, sims, stream.tokens, n, a.ppl_windows, a.chunk, a.batch,
                                             a.decode_tail, desc=f"ppl {n}")
            for name, p in per.items():
                res = methods[name]
                res[ppl_key(n)] = p["ppl"]
                if a.decode_tail and "ppl_decode_tail" not in res:  # the first length's, as before
                    res["ppl_decode_tail"] = p["ppl_decode"]
                if "agreement" in p:
                    res.setdefault("agreement", {})[str(n)] = p.pop("agreement")
                seconds[name] += p.pop("seconds")
                res.setdefault("ppl_detail", p)  # the first length's
                res.setdefault("ppl_details", {})[str(n)] = p
            _write(a.out, result)
    for name, sim in sims.items():
        res, t0 = methods[name], time.time()
        if prompts:
            pr = runner.passkey(model, sim, tok, prompts, a.chunk, eos, a.batch, desc=f"{name} passkey")
            res["passkey"] = pr["mean"]
            res["passkey_by_depth"] = pr["by_depth"]
            res["passkey_examples"] = pr["examples"]
            res["passkey_first_token_logprob"] = pr["first_token_logprob"]
            res["passkey_hits"] = pr["hits"]  # per prompt: the report's paired interval
            res["passkey_first_token_logprobs"] = pr["first_token_logprobs"]
        res["wall_s"] = round(seconds[name] + time.time() - t0, 1)
        _write(a.out, result)
        print(f"oscar-eval: {name}: {json.dumps(_summary(res, a.ppl_len))} ({res['wall_s']} s)",
              file=sys.stderr, flush=True)
    del sims
    result["settings"]["wall_s"] = round(time.time() - t_start, 1)
    _write(a.out, result)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
