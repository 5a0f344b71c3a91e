"""Render the result tables from benchmarks/results/*.json (figures are never typed).

README.md holds the headline table and benchmarks/RESULTS.md every other table, each
section between two markers:

    <!-- report:e2e -->
    ...generated markdown...
    <!-- /report:e2e -->

    python3 -m benchmarks.report --write             # regenerate README.md and benchmarks/RESULTS.md
    python3 -m benchmarks.report --check             # exit 1 when a section of either is stale
    python3 -m benchmarks.report --write FILE.md     # only that file
    python3 -m benchmarks.report e2e                 # print one section

tests/test_release_readme.py runs the check, so a new or changed results file must be
followed by ``--write``. To render only what is committed (a checkout may hold results
that are not committed yet):

    rm -rf /tmp/r && mkdir /tmp/r && git archive HEAD benchmarks/results | tar -x -C /tmp/r
    python3 -m benchmarks.report --results /tmp/r/benchmarks/results --write
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import glob
import json
import os
import re
import sys

from benchmarks import targets  # verdicts and the paired passkey gap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# the files that hold report sections (--write / --check without a file name)
DOCUMENTS = (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "RESULTS.md"))

E2E_CONFIGS = ("bf16_triton", "bf16_flashinfer", "fp8_e4m3", "oscar_int2")


def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _files(results_dir: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(results_dir, pattern)))


def _rel(path: str) -> str:
    """How the documents name a results file (wherever --results pointed)."""
    return f"benchmarks/results/{os.path.basename(path)}"


_MACHINE_PATH = re.compile(r"(?:/[\w.+-]+)+/(models|shapes)/([\w.+-]+)")


def user_paths(text: str) -> str:
    """``text`` with the measuring machine's absolute model paths written the way the
    repository's commands name them (``/any/where/models/tinylm-A`` -> ``../shared/models/tinylm-A``)."""
    return _MACHINE_PATH.sub(r"../shared/\1/\2", text)


def fmt(v, digits: int = 1) -> str:
    """A table cell: '-' for a missing value, thousands separators for integers."""
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def none_yet(command: str, where: str) -> str:
    return f"_No results yet: run `{command}` ({where})._"


# ------------------------------------------------------------------------- sections


def per_results_file(pattern: str, command: str, where: str, keep=None, footer=None):
    """Turn ``render_one(path, data) -> [markdown parts]`` into a section renderer over every
    results file matching ``pattern`` (and ``keep``), or the "no results yet" line; ``footer(datas)``:
    one closing paragraph for the whole section (definitions shared by every file)."""
    def wrap(render_one):
        @functools.wraps(render_one)
        def render(results_dir: str) -> str:
            files = [f for f in _files(results_dir, pattern) if keep is None or keep(f)]
            if not files:
                return none_yet(command, where)
            datas = [_load(f) for f in files]
            parts = [part for path, data in zip(files, datas) for part in render_one(path, data)]
            return "\n\n".join(parts + ([footer(datas)] if footer else []))
        return render
    return wrap


def _gpu_note(settings: dict) -> str:
    gpus = settings.get("gpus")
    return f" (configurations run in parallel, one per GPU: GPUs {', '.join(gpus)} of one host)" if gpus else ""


def _seconds(ms_values) -> str:
    """'1.51 / 4.63 / -': milliseconds as seconds, '-' where missing."""
    return " / ".join(fmt(x / 1000 if isinstance(x, (int, float)) else None, 2) for x in ms_values)


@per_results_file("e2e_*.json", "python3 -m benchmarks.e2e", "one GPU per configuration",
                  keep=lambda f: "decode_throughput" not in os.path.basename(f))
def render_e2e(path: str, data: dict) -> list[str]:
    parts = []
    configs = data.get("configs", {})
    names = [c for c in E2E_CONFIGS if c in configs] + [c for c in configs if c not in E2E_CONFIGS]
    base = configs.get("bf16_triton", {}).get("max_total_num_tokens")
    env, st = data.get("environment", {}), data.get("settings", {})
    parts.append(
        f"**{data.get('model', '?')}** (random weights) on {env.get('gpu', 'an unnamed GPU')}, "
        f"SGLang {env.get('sglang', '?')}, `--mem-fraction-static {st.get('mem_fraction_static')} "
        f"--page-size {st.get('page_size')} --max-running-requests {st.get('max_running_requests')}"
        f"{(' ' + st['extra_server_args']) if st.get('extra_server_args') else ''}` "
        f"for every configuration{_gpu_note(st)}. Source: `{_rel(path)}`, plot: "
        f"`{_rel(os.path.splitext(path)[0] + '.png')}`.")
    rows = []
    for n in names:
        c = configs[n]
        tp = c.get("throughput", {})
        mtt = c.get("max_total_num_tokens")
        ratio = f"{mtt / base:.2f}x" if isinstance(mtt, int) and base else "-"
        ttft = (tp.get("median_ttft_ms"), tp.get("p99_ttft_ms"))
        itl = (tp.get("median_itl_ms"), tp.get("p99_itl_ms"))
        conc = tp.get("settings", {}).get("max_concurrency")
        itl_rate = conc * 1000.0 / itl[0] if conc and itl[0] else None
        b1_ttft = [(c.get("decode") or {}).get(f"decode_ms_{k}", {}).get("median_ttft_ms")
                   for k in ("32k", "64k", "128k")]
        rows.append([
            n, fmt(mtt), ratio, fmt(c.get("concurrent_100k")),
            fmt(c.get("decode_ms_32k"), 2), fmt(c.get("decode_ms_64k"), 2), fmt(c.get("decode_ms_128k"), 2),
            _seconds(b1_ttft),
            fmt(c.get("throughput_tok_s")), fmt(c.get("steady_decode_tok_s")), fmt(itl_rate),
            fmt(conc),
            _seconds(ttft),
            " / ".join(fmt(x, 1) for x in itl),
            "; ".join(f"{k}: {v}"[:80] for k, v in (c.get("errors") or {}).items() if v),
        ])
    parts.append(table(
        ["config", "KV pool (tokens)", "vs bf16_triton", "100k-token requests that fit",
         "decode ms/step @32k", "@64k", "@128k", "one request's TTFT @32k / 64k / 128k (s)",
         "output tok/s", "steady decode tok/s",
         "decode tok/s at ITL p50", "in flight",
         "TTFT p50 / p99 (s)", "ITL p50 / p99 (ms)", "notes"], rows))
    tps = next((configs[n].get("throughput", {}).get("settings") for n in names
                if configs[n].get("throughput", {}).get("settings")), None)
    if tps:
        lo = int(tps["input_len"] * tps["range_ratio"])
        parts.append(
            f"Throughput workload: {tps['num_prompts']} requests of "
            f"{lo if lo != tps['input_len'] else ''}{'-' if lo != tps['input_len'] else ''}"
            f"{tps['input_len']} random input tokens and {tps['output_len']} output tokens, all sent at once, "
            f"at most 'in flight' = as many as fit in the pool (`sglang.benchmark.serving`, random-ids). "
            f"Steady decode tok/s = in flight x 1000 / median TPOT (ms), derived (TPOT includes the "
            f"stalls while other requests prefill); decode tok/s at ITL p50 = in flight x 1000 / median "
            f"inter-token latency (ms), derived (the rate of a decode step at that concurrency). "
            f"Decode: one request at a time, median inter-token latency; its time to first token is that "
            f"prompt's whole prefill (chunks of {st.get('chunked_prefill_size', '?')} tokens over the cached prefix).")
    return parts


STEADY_CONFIGS = ("bf16_flashinfer", "fp8_e4m3", "oscar_int2")


def _x(v) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _steady_decode_definitions(datas: list[dict]) -> str:
    """What the steady-decode tables' columns mean (once per section)."""
    fractions = sorted({d.get("settings", {}).get("dt_full_fraction") for d in datas} - {None})
    return (
        "Requests sent = as many as fit in oscar_int2's pool, the same count and `--max-running-requests` for every "
        "configuration (`--cuda-graph-max-bs-decode` the same). Steady decode tok/s: the median of the scheduler's "
        "'Decode batch' log intervals (each `--decode-log-interval` decode steps) that held decode steps only "
        "(no prefill, no retraction, the same #running-req at both ends), at full concurrency (#running-req >= "
        f"{' / '.join(fmt(f, 2) for f in fractions) or '-'} x the largest); in flight = their median #running-req; ms per decode "
        "step = #running-req / rate. E2e output tok/s: the decode-token counter of /metrics "
        "(`sglang:realtime_tokens_total{mode=\"decode\"}`) from the first request to the end of each "
        "configuration's window, and over the first seconds that every configuration's window covers (the ratio is "
        "of those); a bounded window closed before every request was done (the client was stopped there), so the "
        "prefill at its start weighs more than in a run to completion.")


@per_results_file("e2e_decode_throughput_*.json",
                  "python3 -m benchmarks.e2e --phases steady_32k --configs oscar_int2",
                  "one GPU, one configuration and workload per call, oscar_int2 first; then steady_8k, "
                  "and the other configurations", footer=_steady_decode_definitions)
def render_e2e_decode_throughput(path: str, data: dict) -> list[str]:
    parts = []
    configs = data.get("configs", {})
    env, st = data.get("environment", {}), data.get("settings", {})
    ref = st.get("reference", "bf16_flashinfer")
    parts.append(
        f"**{data.get('model', '?')}** (random weights) on {env.get('gpu') or 'an unnamed GPU'}, SGLang "
        f"{env.get('sglang', '?')}, `--mem-fraction-static {st.get('mem_fraction_static')} --page-size "
        f"{st.get('page_size')} --chunked-prefill-size {st.get('chunked_prefill_size')} --enable-metrics "
        f"--decode-log-interval {st.get('dt_log_interval')}"
        f"{(' ' + st['extra_server_args']) if st.get('extra_server_args') else ''}` for every configuration, one "
        f"server per configuration and workload. Source: `{_rel(path)}`.")
    names = [c for c in STEADY_CONFIGS if c in configs] + [c for c in configs if c not in STEADY_CONFIGS]
    for workload, w in st.get("workloads", {}).items():
        rows, span = [], None
        for n in names:
            r = configs[n].get(workload)
            err = (configs[n].get("errors") or {}).get(workload)
            if not isinstance(r, dict) and not err:
                continue
            r = r if isinstance(r, dict) else {}
            vs = r.get(f"vs_{ref}") or {}
            if r.get("bounded"):
                window = f"{fmt(r.get('window_s'))} (bounded)"
            elif r.get("window_s") is not None:
                window = f"{fmt(r.get('window_s'))} (all {fmt(r.get('completed'))} done)"
            else:
                window = "-"
            notes = "; ".join(x for x in (
                "the flag, not the pool, limited concurrency" if r.get("flag_limits_concurrency") else "",
                f"{fmt(r.get('steady', {}).get('retracted_requests'))} requests retracted"
                if r.get("steady", {}).get("retracted_requests") else "",
                f"CUDA graph in {r['steady']['cuda_graph_fraction']:.0%} of the steady steps"
                if r.get("steady", {}).get("cuda_graph_fraction") not in (None, 1.0) else "",
                str(err)[:80] if err else "") if x)
            rows.append([n, fmt(r.get("pool_tokens")), fmt(r.get("num_prompts")), fmt(r.get("fit_in_pool")),
                         fmt(r.get("max_running_requests")), fmt(r.get("in_flight")), fmt(r.get("decode_tok_s")),
                         _x(vs.get("decode_tok_s")), fmt(r.get("steady", {}).get("ms_per_step"), 2),
                         fmt(r.get("e2e_output_tok_s")), fmt((r.get("e2e_common_window") or {}).get("output_tok_s")),
                         _x(vs.get("e2e_common_window")), window, notes])
            span = (r.get("e2e_common_window") or {}).get("window_s") or span
        if not rows:
            continue
        parts.append(f"{w.get('label', workload)} (`{workload}`): {w.get('input_len')} random input tokens and "
                     f"{w.get('output_len')} output tokens per request, all requests sent at once.")
        parts.append(table(["config", "KV pool (tokens)", "requests sent", "fit in this pool",
                            "--max-running-requests", "in flight (steady)", "steady decode tok/s", f"vs {ref}",
                            "ms per decode step", "e2e output tok/s (its window)",
                            f"e2e output tok/s, first {fmt(span)} s", f"vs {ref}", "window (s)", "notes"], rows))
    target = data.get("target", {})
    verdicts = [f"`{k}` {_x(v.get('measured'))} ({'met' if v.get('met') else 'missed' if v.get('met') is False else 'not measured'})"
                for k, v in target.items() if isinstance(v, dict)]
    if verdicts:
        parts.append(f"Target (issue 29): {target.get('what', '')}: " + ", ".join(verdicts) + ".")
    return parts


def render_decode_profile(results_dir: str) -> str:
    """Issue 48's "where the step goes": the ``profile`` of each steady entry of the e2e decode-throughput
    files (benchmarks/decode_profile.py), ms per decode step by category, one column per configuration
    and workload; the stacked-bar plot beside it when its file (decode_profile.plot_name) exists."""
    from benchmarks import decode_profile as dp

    parts = []
    for path in _files(results_dir, "e2e_decode_throughput_*.json"):
        data = _load(path)
        runs = dp.profiles(data)
        if not runs:
            continue
        entry = lambda n, w: data["configs"][n][w]
        cats = [c for c in dp.CATEGORIES if any(p["ms_per_step"].get(c) for _, _, p in runs)]
        rows = [["in flight"] + [fmt(p.get("in_flight", entry(n, w).get("in_flight"))) for n, w, p in runs]]
        rows += [[c] + [fmt(p["ms_per_step"].get(c), 2) for _, _, p in runs] for c in cats]
        rows += [["step, wall (trace)"] + [fmt(p.get("wall_ms_per_step"), 2) for _, _, p in runs],
                 ["step (scheduler log)"] + [fmt((entry(n, w).get("steady") or {}).get("ms_per_step"), 2)
                                             for n, w, _ in runs],
                 ["steps in the trace"] + [f"{fmt(p.get('steps'))} of {fmt(p.get('graph_replays'))} replays"
                                           for _, _, p in runs]]
        env = data.get("environment", {})
        parts.append(f"**{data.get('model', '?')}** on {env.get('gpu') or 'an unnamed GPU'}, SGLang "
                     f"{env.get('sglang', '?')}: ms per steady decode step by category, CUDA graphs on, as served "
                     f"(torch profiler through `/start_profile`). Source: `{_rel(path)}`.")
        parts.append(table(["ms per decode step"] + [f"{n} {w}" for n, w, _ in runs], rows))
        parts.append("Everything else, largest kernels (ms per step): " + "; ".join(
            f"{n} {w}: " + ", ".join(f"`{k['name']}` {fmt(k['ms_per_step'], 2)}" for k in p.get("top_other", [])[:4])
            for n, w, p in runs) + ".")
        png = dp.plot_name(path)
        if os.path.isfile(os.path.join(results_dir, png)):
            parts.append(f"![ms per decode step by category](results/{png})")
    if not parts:
        return ("_No profile yet: run `python3 -m benchmarks.e2e --phases steady_32k --configs oscar_int2 "
                "--profile-steps 20` (one configuration and workload per GPU call, benchmarks/e2e.py's docstring)._")
    parts.append("Steps: the periods between consecutive CUDA-graph replays in the trace that ran decode work "
                 "only; a category is the kernels' summed durations per step, GPU idle the step's time with no "
                 "kernel running (benchmarks/decode_profile.py). The scheduler's ms per step is of the unprofiled "
                 "intervals.")
    return "\n\n".join(parts)


@per_results_file("capacity_*.json", "python3 -m benchmarks.capacity", "one GPU")
def render_capacity(path: str, data: dict) -> list[str]:
    parts = []
    meta = data.get("meta", {})
    dtypes = [k for k in data if k != "meta"]
    base = data.get("bf16")
    rows = [[d, fmt(data[d]), f"{data[d] / base:.2f}x" if isinstance(data[d], int) and base else "-"]
            for d in dtypes]
    parts.append(f"**{meta.get('model', '?')}** on {meta.get('gpu') or 'an unnamed GPU'}, "
                 f"`--mem-fraction-static {meta.get('mem_fraction_static')} --page-size "
                 f"{meta.get('page_size')}`. Source: `{_rel(path)}`.")
    parts.append(table(["--kv-cache-dtype", "max_total_num_tokens", "vs bf16"], rows))
    return parts


def _flatten(entry: dict) -> dict:
    out = {}
    for k, v in entry.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                if not isinstance(v2, (dict, list)):
                    out[f"{k} {k2}"] = v2
        elif not isinstance(v, list):
            out[k] = v
    return out


def _gap(gap: float, half: float, digits: int = 3) -> str:
    """A paired difference and its 95% half-width: '-0.023 ± 0.028'."""
    return f"{gap:+.{digits}f} ± {half:.{digits}f}"


def _passkey_cell(m: dict, ref: dict, n: str, is_ref: bool) -> str:
    a, ra = m.get("passkey", {}).get(n), ref.get("passkey", {}).get(n)
    if a is None or ra is None or is_ref:
        return fmt(a, 3)
    h, rh = m.get("passkey_hits", {}).get(n), ref.get("passkey_hits", {}).get(n)
    if h and rh and len(h) == len(rh):
        return f"{a:.3f} ({_gap(*targets.paired_gap(h, rh))})"
    return f"{a:.3f} ({a - ra:+.3f})"


def fidelity_table(methods: dict) -> str:
    """Perplexity and passkey per method, each against the bf16 row (targets: ppl <= 1.03 x
    bf16, passkey within 0.02 of bf16 at every length)."""
    ref = methods.get("bf16", {})
    ppl_key = next((k for k in ref if k.startswith("ppl_")), "ppl_8k")
    lengths = list(ref.get("passkey", {})) or sorted({n for m in methods.values() for n in m.get("passkey", {})}, key=int)
    rows = []
    for name, m in methods.items():
        ppl, rp = m.get(ppl_key), ref.get(ppl_key)
        row = [name, fmt(ppl, 4), f"{ppl / rp:.4f}" if ppl and rp else "-"]
        for n in lengths:
            row.append(_passkey_cell(m, ref, n, name == "bf16"))
        if any("passkey_first_token_logprob" in v for v in methods.values()):
            lp = m.get("passkey_first_token_logprob", {})
            row.append(" / ".join(fmt(lp.get(n), 3) for n in lengths))
        rows.append(row)
    paired = any("passkey_hits" in v for v in methods.values())
    header = ["method", ppl_key, "vs bf16",
              *[f"passkey {n} (vs bf16{', paired 95% CI' if paired else ''})" for n in lengths]]
    if any("passkey_first_token_logprob" in v for v in methods.values()):
        header.append("log p(first answer token) " + " / ".join(lengths))
    return table(header, rows)


def _ppl_passkey_caption(st: dict) -> str:
    """What a fidelity run measured: its perplexity windows and passkey prompts."""
    ppl = (f"{st.get('ppl_windows')} held-out windows of {st.get('ppl_len')} tokens" if st.get("ppl_windows")
           else "no perplexity (passkey only)")
    return f"{ppl}; passkey {st.get('passkey_trials')} prompts per length and depth {st.get('passkey_depths')}"


# the real model's fidelity files (render_real_model), left out of the tinylm-A sections
REAL_MODEL_SERVER = "server_smollm2.json"
REAL_MODEL_SIM = "fidelity_smollm2.json"
REAL_MODEL_SIM_MORE = "fidelity_smollm2_*.json"  # further simulated runs (another length or window count)
REAL_MODEL_FILES = (REAL_MODEL_SERVER, REAL_MODEL_SIM)


def _not_real_model(path: str) -> bool:
    name = os.path.basename(path)
    return name not in REAL_MODEL_FILES and not fnmatch.fnmatch(name, REAL_MODEL_SIM_MORE)


def _real_model_sims(results_dir: str) -> list[str]:
    """The simulated real-model runs: the main one, then the others by name."""
    more = sorted(os.path.basename(p) for p in glob.glob(os.path.join(results_dir, REAL_MODEL_SIM_MORE)))
    return [REAL_MODEL_SIM] + more


@per_results_file("server_*.json", "python3 -m benchmarks.server_fidelity --method NAME=FILE ...", "one GPU",
                  keep=_not_real_model)
def render_server_fidelity(path: str, data: dict) -> list[str]:
    parts = []
    st = data.get("settings", {})
    parts.append(f"SGLang server per method, `--chunked-prefill-size {st.get('chunked_prefill_size')}`; "
                 f"{_ppl_passkey_caption(st)}. Source: `{_rel(path)}`.")
    parts.append(fidelity_table(data.get("methods", {})))
    return parts


def _lengths(data: dict) -> list[str]:
    """The perplexity lengths of a fidelity file, shortest first ("2048", ...)."""
    return sorted({n for m in data.get("methods", {}).values() for n in m.get("ppl_details", {})}, key=int)


def _ppl_cells(m: dict, ref: dict, n: str, is_ref: bool) -> list[str]:
    """'ppl (ratio to bf16)' and the paired NLL difference by window at length ``n``."""
    d, rd = m.get("ppl_details", {}).get(n, {}), ref.get("ppl_details", {}).get(n, {})
    if not d:
        return ["-", "-"]
    if is_ref or not rd:
        return [f"{d['ppl']:.4f}", "-"]
    w, rw = d.get("nll_by_window", []), rd.get("nll_by_window", [])
    paired = _gap(*targets.paired_gap(w, rw), 4) if w and len(w) == len(rw) else "-"
    return [f"{d['ppl']:.4f} ({d['ppl'] / rd['ppl']:.4f}x)", paired]


def real_model_tables(data: dict, kl_keys: tuple[tuple[str, str], ...]) -> list[str]:
    """Perplexity (ratio, paired NLL difference) and passkey per method and length; then
    agreement with bf16 (top-1 and the ``kl_keys`` measures: (key, column label))."""
    methods = data.get("methods", {})
    ref = methods.get("bf16", {})
    lengths = _lengths(data)
    pk_lengths = list(ref.get("passkey", {}))
    rows = []
    for name, m in methods.items():
        row = [name]
        for n in lengths:
            row += _ppl_cells(m, ref, n, name == "bf16")
        rows.append(row + [_passkey_cell(m, ref, n, name == "bf16") for n in pk_lengths])
    header = ["method"]
    for n in lengths:
        header += [f"ppl {fmt(int(n))} (vs bf16)", f"NLL - bf16, {fmt(int(n))} (paired by window, 95%)"]
    parts = [table(header + [f"passkey {n} (vs bf16, paired 95%)" for n in pk_lengths], rows)]
    compared = {name: m["agreement"] for name, m in methods.items() if m.get("agreement")}
    if compared:
        header, rows = ["method"], []
        for n in lengths:
            header += [f"top-1 = bf16, {fmt(int(n))}"] + [f"{label}, {fmt(int(n))}" for _, label in kl_keys]
        for name, ag in compared.items():
            row = [name]
            for n in lengths:
                a = ag.get(n, {})
                row += [fmt(a.get("top1"), 4)] + [fmt(a.get(k), 4) for k, _ in kl_keys]
            rows.append(row)
        parts.append(table(header, rows))
    return parts


def render_real_model(results_dir: str) -> str:
    """The real model (SmolLM2-135M-Instruct) against bf16: through the server and in simulation."""
    parts = []
    served = _maybe_load(results_dir, REAL_MODEL_SERVER)
    if served.get("methods"):
        st = served.get("settings", {})
        parts.append(
            f"**{served.get('model', '?')} through the server** (SGLang 0.5.17, `--chunked-prefill-size "
            f"{st.get('chunked_prefill_size')}`; bf16 = SGLang's BF16 cache and fp8_e4m3 its FP8 cache "
            f"(`--kv-cache-dtype fp8_e4m3`), both on SGLang's triton attention; every other method "
            f"`--kv-cache-dtype oscar_int2` with its rotations file): {st.get('ppl_windows')} held-out windows per "
            f"length; passkey {st.get('passkey_trials')} prompts per length and depth {st.get('passkey_depths')}. "
            f"NLL - bf16: the mean over windows of each window's mean NLL minus bf16's on the same window, with its "
            f"95% interval. Agreement, {st.get('agreement', 'not measured')}: the KL column is a lower bound. "
            f"Source: `{_rel(os.path.join(results_dir, REAL_MODEL_SERVER))}`.")
        parts += real_model_tables(served, (("kl_topk", "KL(bf16 || method) >="),))
    for sim_name in _real_model_sims(results_dir):
        sim = _maybe_load(results_dir, sim_name)
        if not sim.get("methods"):
            continue
        st = sim.get("settings", {})
        parts.append(
            f"**{sim.get('model', '?')} in simulation** (`oscar-eval`, KV simulated with the server's kernels' "
            f"reference numerics; {st.get('device')}): S={st.get('sink')}, W={st.get('recent')}, "
            f"{_groups_caption(st)}, chunk {st.get('chunk')}; {st.get('ppl_windows')} held-out windows per length; "
            f"passkey {st.get('passkey_trials')} prompts per length and depth {st.get('passkey_depths')}. "
            f"Agreement at the positions past the first chunk: top-1 agreement, KL(bf16 || method) over the whole "
            f"vocabulary, and the lower bound the server's top-K lists give on the same logits (how tight the "
            f"server's KL column is). Source: `{_rel(os.path.join(results_dir, sim_name))}`.")
        parts += real_model_tables(sim, (("kl", "KL(bf16 || method)"), ("kl_topk", "its top-K lower bound")))
    if not parts:
        return none_yet(f"python3 -m benchmarks.server_fidelity --model DIR --fp8 --method oscar=F ... --out "
                        f"benchmarks/results/{REAL_MODEL_SERVER}` and `oscar-eval --model DIR ... --out "
                        f"benchmarks/results/{REAL_MODEL_SIM}", "one GPU")
    return "\n\n".join(parts)


REAL_MODEL_STUDY = "study_smollm2.json"


def _study_change(name: str, row: dict) -> str:
    """What a study row changes against the default, in words."""
    run, _, method = name.rpartition("/")
    what = []
    if row.get("int2_parts") in ("k", "v"):
        what.append(f"INT2 {'keys' if row['int2_parts'] == 'k' else 'values'} only (fake quantisation)")
    if row.get("key_shift") == "none" and row.get("recipe") == "oscar":
        what.append("no key shift")
    if row.get("group_size") is not None:
        what.append(f"key groups {row['group_size']}, value groups {row['value_group_size']}")
    if run and run.startswith(("S", "W", "sink", "recent")):
        what.append(f"S={row.get('sink')}, W={row.get('recent')}")
    return (row.get("recipe") or method) + ": " + "; ".join(what)


def _paired_cells(name: str, row: dict, lengths: list, default: str, third) -> list[str]:
    """A study row's cells per length: ppl (vs bf16), NLL - default (paired, 95%), and ``third(cell)``."""
    cells = []
    for n in lengths:
        c = row["ppl"].get(n)
        if not c:
            cells += ["-", "-", "-"]
            continue
        gap = c.get("nll_vs_default")
        cells += [f"{c['ppl']:.4f} ({c['ratio']:.4f}x)" if c.get("ratio") else fmt(c["ppl"], 4),
                  _gap(*gap, 4) if gap else ("(default)" if name == default else "-"), third(c)]
    return cells


def render_real_model_study(results_dir: str) -> str:
    """Issue 46's study: every candidate against bf16 and the default, paired by window."""
    data = _maybe_load(results_dir, REAL_MODEL_STUDY)
    if not data.get("rows"):
        return none_yet("python3 -m benchmarks.real_model_study --main fidelity_smollm2.json --run NAME=FILE ...",
                        "CPU, from one GPU session's oscar-eval outputs")
    st, rows = data["settings"], data["rows"]
    lengths = sorted({n for r in rows.values() for n in r["ppl"]}, key=int)
    header = ["candidate", "changes", "INT2 B / token / KV head", "BF16 ring MB / request"]
    for n in lengths:
        header += [f"ppl {fmt(int(n))} (vs bf16)", f"NLL - default, {fmt(int(n))} (95%)", f"top-1 / KL, {fmt(int(n))}"]
    top1_kl = lambda c: f"{c['top1']:.4f} / {c['kl']:.4f}" if c.get("top1") is not None else "-"
    out = [[name, _study_change(name, r), fmt(r.get("bytes_per_token_head")), fmt(r["ring_bytes_per_request"] / 1e6, 1),
            *_paired_cells(name, r, lengths, data["default"], top1_kl)] for name, r in rows.items()]
    bf16 = ", ".join(f"{fmt(int(n))}: {v:.4f}" for n, v in sorted(data["bf16"].items(), key=lambda kv: int(kv[0])))
    caption = (f"{data.get('model')} in simulation (`oscar-eval`, {st.get('device')}; chunk {st.get('chunk')}, "
               f"{st.get('ppl_windows')} held-out windows per length, S={st.get('sink')} and W={st.get('recent')} "
               f"unless a row says otherwise). bf16 ppl {bf16}. NLL - default: each window's mean NLL minus the "
               f"default's ({data['default']}) on the same window, mean and 95% half-width over windows. "
               f"Source: `{_rel(os.path.join(results_dir, REAL_MODEL_STUDY))}`.")
    parts = [caption, table(header, out)]
    proxy = data.get("proxy")
    if proxy and proxy.get("results"):
        res = proxy["results"]
        names = list(res)
        layers = len(next(iter(res.values())).get("layers", []))
        if layers:
            rows_p = [[str(l)] + [fmt(res[n]["layers"][l].get("out_rel"), 4) for n in names] for l in range(layers)]
            parts.append(f"Per layer: relative attention-output error of each file with fake INT2 K/V "
                         f"(`oscar-calibrate proxy`, {proxy.get('tokens')} tokens of {proxy.get('data')}, "
                         f"S={proxy.get('sink')}, W={proxy.get('recent')}).")
            parts.append(table(["layer"] + names, rows_p))
    return "\n\n".join(parts)


FIDELITY_CANDIDATES = "study_candidates_smollm2.json"


LAYER_PROXY = "layer_proxy_smollm2.json"


def render_fidelity_candidates(results_dir: str) -> str:
    """Issue 46's study of what closes the real model's gap: candidates paired by window with the default,
    SmolLM2's (with its per-layer attribution) first, then any other model's ``study_candidates_*.json``."""
    data = _maybe_load(results_dir, FIDELITY_CANDIDATES)
    if not data.get("rows"):
        return none_yet("python3 -m benchmarks.fidelity_candidates --model DIR --rot-dir DIR", "CPU, about an hour")
    parts = [_candidates_table(data, os.path.join(results_dir, FIDELITY_CANDIDATES))]
    attribution = _layer_attribution(data, _maybe_load(results_dir, LAYER_PROXY), os.path.join(results_dir, LAYER_PROXY))
    if attribution:
        parts.append(attribution)
    for path in sorted(glob.glob(os.path.join(results_dir, "study_candidates_*.json"))):
        if os.path.basename(path) != FIDELITY_CANDIDATES:
            parts.append(_candidates_table(_load(path), path))
    return "\n\n".join(parts)


def _layer_attribution(data: dict, proxy: dict, proxy_path: str) -> str | None:
    """The ``bf16-L<a>-<b>`` rows (a block of layers in BF16, the rest the default) as each block's share
    of the default's loss, beside the calibration-side proxy's share (its summed attention KL at the
    default's key groups) for the same block."""
    rows = {k: r for k, r in data["rows"].items() if k.startswith("bf16-L")}
    default = data["rows"].get(data["default"], {}).get("ppl", {})
    if not rows or not default:
        return None
    kl = next((r["layers"] for n, r in proxy.get("results", {}).items()
               if proxy.get("group_sizes", {}).get(n, [None])[0] == 16 or n.endswith("_oscar")), None)
    out = []
    for name, r in rows.items():
        lo, hi = (int(x) for x in name.removeprefix("bf16-L").split("-"))
        cells = [f"{lo}-{hi}"]
        for n, c in sorted(r["ppl"].items(), key=lambda kv: int(kv[0])):
            loss = default[n]["nll_vs_bf16"][0] if n in default else None
            gap = c.get("nll_vs_default")
            cells += [_gap(-gap[0], gap[1], 4) if gap else "-",
                      f"{-gap[0] / loss:.0%}" if gap and loss else "-"]
        if kl:
            cells.append(f"{sum(x['attn_kl'] for x in kl[lo:hi + 1]) / sum(x['attn_kl'] for x in kl):.0%}")
        out.append(cells)
    lengths = sorted({n for r in rows.values() for n in r["ppl"]}, key=int)
    header = ["layers in BF16"]
    for n in lengths:
        header += [f"NLL given back, {fmt(int(n))} (95%)", f"share of the default's NLL - bf16, {fmt(int(n))}"]
    if kl:
        header.append("proxy's share (attention KL, calibration text)")
    caption = (f"Per layer: which layers carry the INT2 loss. Each row keeps one block of layers' K/V in BF16 and the "
               f"rest at the default (`oscar-eval --bf16-layers`), paired by window with the default; the NLL it gives "
               f"back is that block's share of the default's NLL - bf16 (the shares need not add up to 100%: errors "
               f"of layers compound). Proxy: the block's part of the summed per-layer attention KL with fake-INT2 keys "
               f"at the default's groups (`oscar-calibrate proxy --calib-text`, {proxy.get('tokens')} tokens of "
               f"{proxy.get('data')}; `{_rel(proxy_path)}`), what the per-layer layouts are chosen on.")
    return caption + "\n\n" + table(header, out)


def _candidates_table(data: dict, path: str) -> str:
    st, rows = data["settings"], data["rows"]
    lengths = sorted({n for r in rows.values() for n in r["ppl"]}, key=int)
    header = ["candidate", "changes", "B / token / KV head, mean over layers (K + V)", "BF16 ring MB / request"]
    for n in lengths:
        header += [f"ppl {fmt(int(n))} (vs bf16)", f"NLL - default, {fmt(int(n))} (95%)", f"NLL - fake, {fmt(int(n))}"]
    vs_fake = lambda c: _gap(*c["nll_vs_fake"], 4) if c.get("nll_vs_fake") else "-"
    out = [[name, r["changes"], f"{fmt(float(r['bytes_per_token_head']), 1)} ({fmt(float(r['key_bytes']), 1)} + "
            f"{fmt(float(r['value_bytes']), 1)})", fmt(r["ring_bytes_per_request"] / 1e6, 1),
            *_paired_cells(name, r, lengths, data["default"], vs_fake)] for name, r in rows.items()]
    bf16 = ", ".join(f"{fmt(int(n))}: {v:.4f}" for n, v in sorted(data["bf16"].items(), key=lambda kv: int(kv[0])))
    caption = (f"{data.get('model')} in simulation (`python -m benchmarks.fidelity_candidates`: one `oscar-eval` run "
               f"per candidate, {st.get('device')}, {st.get('threads')} thread; chunk {st.get('chunk')}, "
               f"{st.get('ppl_windows')} held-out windows per length, the same windows for every row; S={st.get('sink')} "
               f"and W={st.get('recent')} unless a row says otherwise). bf16 ppl {bf16}. NLL - default: each window's mean "
               f"NLL minus the default's on the same window, mean and 95% half-width over windows; NLL - fake: the same "
               f"against the default in PyTorch fake quantisation (`fake`), the baseline of the simulator-only rows. "
               f"Bytes: codes and per-token group scales, or per-channel page scales amortised over the page; "
               f"the mean over the layers where layers differ (a BF16 layer: 2 bytes per channel for K and for V). "
               f"Source: `{_rel(path)}`.")
    return caption + "\n\n" + table(header, out)


KEY_DEBIAS = "key_debias_*.json"


def render_key_debias(results_dir: str) -> str:
    """The INT2 keys' logit debias (--oscar-key-debias) off and on, per model: each against bf16,
    and on against off paired by window and by prompt."""
    parts = []
    for path in sorted(glob.glob(os.path.join(results_dir, KEY_DEBIAS))):
        data = _load(path)
        off, on = data["off"]["methods"], data["on"]["methods"]
        st = data["off"].get("settings", {})
        methods = {"bf16": off["bf16"], "oscar": off["oscar"], "oscar + key debias": on["oscar"]}
        merged = {"methods": methods}
        cells = []
        for n in _lengths(merged):
            a, b = off["oscar"]["ppl_details"][n]["nll_by_window"], on["oscar"]["ppl_details"][n]["nll_by_window"]
            cells.append(f"NLL {fmt(int(n))} {_gap(*targets.paired_gap(b, a), 4)}")
        for n, hits in on["oscar"].get("passkey_hits", {}).items():
            cells.append(f"passkey {n} {_gap(*targets.paired_gap(hits, off['oscar']['passkey_hits'][n]))}")
        parts.append(
            f"**{data['off'].get('model', '?')}** (`oscar-eval --key-debias 0` and `1`, the kernels' numerics, "
            f"{st.get('device')}; S={st.get('sink')}, W={st.get('recent')}, {_groups_caption(st)}, chunk "
            f"{st.get('chunk')}; {st.get('ppl_windows')} held-out windows per length; passkey "
            f"{st.get('passkey_trials')} prompts per length and depth {st.get('passkey_depths')}). Debias on minus "
            f"off, paired: {'; '.join(cells)}. Source: `{_rel(path)}`.")
        parts += real_model_tables(merged, (("kl", "KL(bf16 || method)"),))
    if not parts:
        return none_yet("oscar-eval --key-debias 0 / 1 ... (benchmarks/gpu_session_real_model.sh, DEBIAS_SIM=1)",
                        "one GPU")
    return "\n\n".join(parts)


FAKE_INT2 = "in PyTorch fake quantisation (`FakeInt2KVSim`: rotate, clip, INT2, dequantise, rotate back)"
INT2_PART_NAMES = {"k": "keys", "v": "values", "kv-fake": "keys and values"}


def _int2_parts_caption(st: dict) -> str:
    """The ablation a fidelity file holds: one ``oscar-eval --int2-parts`` run (a string;
    "kv", the kernels, is none) or benchmarks/fidelity_int2_parts.py's merge (a list)."""
    run = st.get("int2_parts")
    if isinstance(run, list):
        return ("Ablation (`benchmarks/fidelity_int2_parts.py`): `[INT2 k]` / `[INT2 v]` quantise only the keys / "
                f"only the values of the INT2 history, `[INT2 kv-fake]` both, {FAKE_INT2}, same prompts.")
    if run not in INT2_PART_NAMES:
        return ""
    vg = st.get("value_groups")
    values = f"; values in groups of {vg['group_size']} with {vg['scale_dtype']} scales, keys in the file's" if vg else ""
    return (f"Ablation (`oscar-eval --int2-parts {run}`): INT2 for the {INT2_PART_NAMES[run]} of the history only, "
            f"{FAKE_INT2}{values}.")


def _groups_caption(st: dict, one: str = "G={}", two: str = "G={} (keys) / {} (values)") -> str:
    """The INT2 group size(s) of a results file's settings or shape (``one`` when keys and
    values share it, ``two`` with keys' and values' when they differ)."""
    g, gv = st.get("group_size"), st.get("value_group_size", st.get("group_size"))
    if isinstance(g, dict):  # one group size per method
        return one.format("(" + ", ".join(f"{k}: {v}" for k, v in g.items()) + ")")
    return one.format(g) if gv == g else two.format(g, gv)


@per_results_file("fidelity_*.json", "oscar-eval --model DIR --method naive=F --method hadamard=F --method oscar=F", "CPU or GPU",
                  keep=lambda f: "sweep" not in f and "ablation" not in f and _not_real_model(f))
def render_fidelity(path: str, data: dict) -> list[str]:
    parts = []
    st = data.get("settings", {})
    parts.append(f"`oscar-eval` (HF transformers, KV simulated with oscar_kernels' reference numerics), "
                 f"S={st.get('sink')}, W={st.get('recent')}, {_groups_caption(st)}, chunk {st.get('chunk')}; "
                 f"{_ppl_passkey_caption(st)}; {st.get('device')}. Source: `{_rel(path)}`.")
    calib = {name: r.get("recipe_detail", {}) for name, r in st.get("rotations", {}).items()}
    if len({(c.get("tokens"), c.get("seq_len")) for c in calib.values()}) > 1:  # methods differ in calibration
        parts.append("Calibration per method: " + "; ".join(
            f"{name} {fmt(c.get('tokens'))} tokens in windows of {fmt(c.get('seq_len'))}" for name, c in calib.items()) + ".")
    ablation = _int2_parts_caption(st)
    if ablation:
        parts.append(ablation)
    parts.append(fidelity_table(data.get("methods", {})))
    return parts


@per_results_file("soak_*.json", "python3 -m benchmarks.soak", "one GPU")
def render_soak(path: str, data: dict) -> list[str]:
    parts = []
    configs = data.get("configs", {})
    rows = [[n, fmt(c.get("pass")), fmt(c.get("requests")), fmt(c.get("aborted_mid_stream")),
             fmt(c.get("shared_prefix_requests")), fmt(c.get("error_count")),
             fmt(len(c.get("leak_messages") or [])) if "leak_messages" in c else "-",
             fmt(c.get("traceback_count")),
             f"{fmt(c.get('exact_equal'))} / {fmt(c.get('compared'))}"]
            for n, c in configs.items()]
    parts.append(f"Source: `{_rel(path)}`.")
    parts.append(table(["config", "pass", "requests", "aborted mid-stream", "on shared prefixes",
                        "failed requests", "leak messages", "tracebacks",
                        "greedy outputs equal to sequential"], rows))
    return parts


def _layer_shape(data: dict) -> str:
    """Device and layer shape of a kernel benchmark file, as the tables' captions give them."""
    sh = data.get("shape", {})
    groups = _groups_caption(sh, "group {}", "groups {} (keys) / {} (values)")
    scales = f", {sh['scale_dtype']} scales" if sh.get("scale_dtype") else ""
    return (f"{data.get('device', '?')}, {sh.get('q_heads')} query / {sh.get('kv_heads')} KV heads, head_dim "
            f"{sh.get('head_dim')}, {groups}{scales}, S={sh.get('sink_tokens')}, W={sh.get('recent_window')}")


@per_results_file("kernels_*.json", "python3 -m benchmarks.bench_kernels", "one GPU",
                  keep=lambda f: not f.endswith("_sweep.json") and "cases" in _load(f))
def render_kernels(path: str, data: dict) -> list[str]:
    parts = []
    parts.append(
        f"{_layer_shape(data)}, page {data.get('shape', {}).get('page_size')}; one layer; {data.get('timing', '')}. "
        f"Device copy bandwidth {fmt(data.get('copy_GBps'))} GB/s. Source: `{_rel(path)}`.")
    rows = [[fmt(c.get("batch")), fmt(c.get("context")), fmt(c.get("oscar_decode_us"), 2),
             fmt(c.get("oscar_GBps")), fmt(c.get("oscar_fraction_of_copy"), 3), fmt(c.get("store_us"), 2),
             fmt(c.get("triton_bf16_us"), 2), fmt(c.get("flashinfer_bf16_us"), 2),
             fmt(c.get("speedup_vs_flashinfer"), 2)] for c in data["cases"]]
    parts.append(table(["batch", "context", "oscar decode (us)", "oscar GB/s", "of copy bw", "store (us)",
                        "SGLang triton BF16 (us)", "flashinfer BF16 (us)", "speed-up vs flashinfer"], rows))
    best = fastest_variants(data.get("sweep", []))
    if best:
        parts.append(f"Decode variants of the same run's sweep more than {SWEEP_WIN:.0%} faster than that run's "
                     "defaults (the fastest per case): " + "; ".join(best) + ".")
    sweep = os.path.splitext(path)[0] + "_sweep.png"
    if os.path.isfile(sweep):
        parts.append(f"Decode variants (block sizes, warps, stages, splits, group size): `{_rel(sweep)}`.")
    if data.get("breakdown"):
        parts.append("Where the time goes (same run, `--breakdown`: the decode timed with each launch left "
                     "out in turn; a launch's time = full - without it):")
        parts.append(table(["batch", "context", "variant", "full (us)", "per launch (us)"],
                           [[fmt(r.get("batch")), fmt(r.get("context")), r.get("variant", ""),
                             fmt(r.get("full_us"), 2), _launch_times(r)] for r in data["breakdown"]]))
    return parts


def _launch_times(rec: dict) -> str:
    """'rotate_q_kernel 3.68, decode_stage1 175.23, ...' of a breakdown record."""
    return ", ".join(f"{k[:-3]} {fmt(v, 2)}" for k, v in rec.items()
                     if k.endswith("_us") and k != "full_us" and not k.startswith("without_"))


SWEEP_WIN = 0.02


def fastest_variants(sweep: list[dict]) -> list[str]:
    """Per (batch, context) of the default group size: the fastest timed variant against
    the run's default ('batch 1, 65,536: merge_grid=split 35.1 us vs 50.5 us default'),
    where it is more than SWEEP_WIN faster (smaller gaps are within run-to-run noise)."""
    by_case: dict[tuple, list[dict]] = {}
    for r in sweep:
        if r.get("oscar_decode_us") and not r["variant"].startswith("group="):
            by_case.setdefault((r["batch"], r["context"]), []).append(r)
    out = []
    for (b, n), here in by_case.items():
        default = next((r["oscar_decode_us"] for r in here if r["variant"] == "default"), None)
        win = min(here, key=lambda r: r["oscar_decode_us"])
        if default and win["oscar_decode_us"] < (1 - SWEEP_WIN) * default:
            out.append(f"batch {b}, {fmt(n)}: {win['variant']} {win['oscar_decode_us']:.1f} us vs "
                       f"{default:.1f} us default")
    return out


def _dataset_label(name: str) -> str:
    return "+".join(os.path.basename(p.rstrip("/")) for p in name.split(",")) if "/" in name else name


@per_results_file("calibration_proxy*.json", "python3 -m benchmarks.calibration_sweep", "CPU")
def render_calibration_proxy(path: str, data: dict) -> list[str]:
    parts = []
    evals = data.get("evals", {})
    sets = list(evals)
    configs = []
    for d in sets:
        configs += [c for c in evals[d].get("results", {}) if c not in configs]
    header = ["rotations"] + [f"{_dataset_label(d)}: {m}" for d in sets for m in ("logit_rel", "attn_kl", "out_rel")]
    rows = [[c] + [fmt(evals[d]["results"].get(c, {}).get("mean", {}).get(m), 4)
                   for d in sets for m in ("logit_rel", "attn_kl", "out_rel")] for c in configs]
    parts.append(f"Per-layer attention error with fake-INT2 K/V, mean over layers (lower is better); "
                 f"model `{os.path.basename(str(data.get('model', '?')))}`, {fmt(data.get('calib_tokens'))} "
                 f"calibration tokens, sink {data.get('sink')}, recent {data.get('recent')}. "
                 f"Source: `{_rel(path)}`.")
    parts.append(table(header, rows))
    return parts


@per_results_file("fidelity_*sweep*.json", "python -m benchmarks.fidelity_sweep --model DIR --method oscar=FILE ...", "CPU or GPU")
def render_fidelity_sweep(path: str, data: dict) -> list[str]:
    parts = []
    runs = data.get("runs", [])
    methods = []
    for r in runs:
        methods += [m for m in r.get("methods", {}) if m not in methods]
    bf16 = data.get("bf16", {})
    rows = [["bf16 (reference)", "-", "-", "-"] + [f"{fmt(bf16.get('ppl_2k'), 3)} / {fmt(bf16.get('ppl_decode_tail'), 3)}"
                                                    for _ in methods]]
    for r in runs:
        mem = r.get("memory", {})
        rows.append([f"S={r.get('sink')}", f"W={r.get('recent')}", fmt(mem.get("ring_in_int2_tokens")),
                     fmt(mem.get("sink_in_int2_tokens"))]
                    + [f"{fmt(r['methods'].get(m, {}).get('ppl_2k'), 3)} / "
                       f"{fmt(r['methods'].get(m, {}).get('ppl_decode_tail'), 3)}" for m in methods])
    parts.append(f"Perplexity (whole window / decoded tail) on held-out text, model "
                 f"`{data.get('model', '?')}`, `oscar-eval {' '.join(data.get('eval_args', []))}`; memory of the "
                 f"BF16 ring (per request) and sinks (per sequence) in INT2-token equivalents. "
                 f"Source: `{_rel(path)}`.")
    parts.append(table(["sink", "recent window", "ring = INT2 tokens", "sinks = INT2 tokens",
                        *[f"{m}: ppl / tail ppl" for m in methods]], rows))
    return parts


# oscar-calibrate's defaults as RESULTS.md states them next to files made with older ones
# (calibration/calibrate.py, oscar_kernels/contract/layout.py; tests/test_release_readme.py compares)
CALIBRATE_DEFAULTS = {"variant": "U-H-P", "clip": "none", "key_group": "head_dim / 4", "value_group": "min(128, head_dim)",
                      "scale_dtype": "float8_e4m3fn", "key_groups": "per-layer"}


def calibrate_defaults_text() -> str:
    d = CALIBRATE_DEFAULTS
    clip = "no clip" if d["clip"] == "none" else f"clip {d['clip']}"
    per_layer = ", per layer G/2, G or 2G at G's mean bytes" if d["key_groups"] == "per-layer" else ""
    return (f"{d['variant']}, {clip}, key group G = {d['key_group']} (32 at head_dim 128){per_layer}, "
            f"value group {d['value_group']}, {d['scale_dtype']} scales")


_DEFAULT_SETTINGS = re.compile(r"default oscar-calibrate settings \(([^)]*)\)")


@per_results_file("calibration_budget*.json", "oscar-calibrate --model DIR --out F --tokens N (several N)", "CPU")
def render_calibration_budget(path: str, data: dict) -> list[str]:
    parts = []
    walls, proxy = data.get("wall_seconds_by_tokens", {}), data.get("proxy", {})
    rows = []
    for n in sorted(walls, key=int):
        p = proxy.get(f"default_{n}", {})
        rows.append([fmt(int(n)), fmt(walls[n]), fmt(p.get("logit_rel"), 4), fmt(p.get("attn_kl"), 4),
                     fmt(p.get("out_rel"), 4)])
    for base in ("hadamard", "naive"):
        if base in proxy:
            rows.append([f"({base}, no calibration)", "-", fmt(proxy[base].get("logit_rel"), 4),
                         fmt(proxy[base].get("attn_kl"), 4), fmt(proxy[base].get("out_rel"), 4)])
    # the file names the defaults of the day it was made: say so, and what they are now
    what = data.get("what", "")
    older = _DEFAULT_SETTINGS.search(what)
    what = _DEFAULT_SETTINGS.sub(r"oscar-calibrate's defaults when this file was made (\1)", what)
    now = f" oscar-calibrate's defaults now: {calibrate_defaults_text()}." if older else ""
    parts.append(f"{user_paths(what)}. Source: `{_rel(path)}`.{now}")
    parts.append(table(["calibration tokens", "wall (s)", "logit_rel", "attn_kl", "out_rel"], rows))
    run = data.get("default_cpu_run")
    if run:
        parts.append(f"A CPU run of `{user_paths(run.get('command', ''))}` ({fmt(run.get('tokens'))} tokens) "
                     f"took {fmt(run.get('wall_seconds'))} s (load average during the run: "
                     f"{run.get('load_average_during', 'not recorded')}).")
    return parts


# every label names its read and tiles (a run shows only the columns it timed)
EXTEND_COLUMNS = (("oscar_int2_us", "oscar, INT2 prefix read (the run's default tiles)"),
                  ("oscar_int2_s1_us", "INT2 read, 1 stage"), ("oscar_int2_s2_us", "INT2 read, 2 stages"),
                  ("oscar_int2_n16_us", "INT2 read, 16-token INT2 steps"), ("oscar_int2_rows32_us", "INT2 read, 32 rows"),
                  ("oscar_bf16_us", "BF16 prefix read: 64 rows, 32-token steps, 1 stage"),
                  ("oscar_bf16_rows128_n64_s2_us", "BF16 read: 128 rows, 64-token steps, 2 stages"),
                  ("oscar_bf16_rows128_n64_s3_us", "BF16 read: 128 rows, 64-token steps, 3 stages"),
                  ("oscar_bf16_rows64_n64_s3_us", "BF16 read: 64 rows, 64-token steps, 3 stages"),
                  ("oscar_bf16_rows128_n128_s2_us", "BF16 read: 128 rows, 128-token steps, 2 stages"),
                  ("oscar_flashinfer_us", "oscar, BF16 prefix via FlashInfer"), ("materialize_us", "of which materialise"),
                  ("flashinfer_bf16_us", "FlashInfer BF16 prefill"))


@per_results_file("extend_*.json", "python3 -m benchmarks.bench_extend", "one GPU")
def render_extend(path: str, data: dict) -> list[str]:
    parts = []
    png = os.path.splitext(path)[0] + ".png"
    plot = f", plot: `{_rel(png)}`" if os.path.exists(png) else ""
    parts.append(f"{_layer_shape(data)}; {data.get('timing', '')}; microseconds. Source: `{_rel(path)}`{plot}.")
    tiles = data.get("default_tiles")
    if tiles:
        parts.append("Default tiles of the run: " + "; ".join(
            f"{read} read {t['block_rows']} rows, {t['block_n'] if read == 'int2' else t['block_n_bf16']}-token steps, "
            f"{t['num_stages']} stage{'s' * (t['num_stages'] > 1)}" for read, t in tiles.items()) + ".")
    cases = data.get("cases", [])
    columns = [(k, label) for k, label in EXTEND_COLUMNS if any(k in c for c in cases)]  # what this run timed
    rows = [[fmt(c.get("prefix")), fmt(c.get("new"))] + [fmt(c.get(k)) for k, _ in columns] for c in cases]
    parts.append(table(["cached prefix", "new tokens"] + [label for _, label in columns], rows))
    return parts


@per_results_file("tp_*.json", "python3 -m benchmarks.tp_check --rotations FILE --tp 2", "two GPUs")
def render_tp(path: str, data: dict) -> list[str]:
    parts = []
    st = data.get("settings", {})
    tp = st.get("tp")
    parts.append(
        f"{data.get('model', '?')}: {st.get('prompts')} prompts of {fmt(st.get('shortest'))}-{fmt(st.get('longest'))} "
        f"tokens, {st.get('max_new_tokens')} greedy tokens each, one request at a time, "
        f"`--chunked-prefill-size {st.get('chunk')} --mem-fraction-static {st.get('mem_fraction')}`; "
        f"tp={tp} against tp=1. Source: `{_rel(path)}`.")
    rows = []
    for name, c in data.get("configs", {}).items():
        runs = c.get("runs", {})
        one, many = runs.get("tp1", {}), runs.get(f"tp{tp}", {})
        div = ", ".join(f"{d['prompt_len']}: token {d['token']}"
                        + (" (near-tie)" if d.get("near_tie") else "") for d in c.get("first_divergent_token", []))
        done = bool(one) and bool(many)
        rows.append([name, fmt(one.get("max_total_num_tokens")), fmt(many.get("max_total_num_tokens")),
                     f"{c.get('exact_equal')} / {c.get('compared')}" if done else "not measured",
                     fmt(c.get("equal_up_to_a_near_tie")) if done else "-", div or "-"])
    parts.append(table(["config", "pool tokens tp=1", f"pool tokens tp={tp}", "greedy equal to tp=1",
                        "equal up to a near-tie", "first divergent token (prompt length: index)"], rows))
    return parts


# README's headline: one row per claim, every cell read from (and linked to) its results file
HEADLINE_CAPACITY = "capacity_qwen3-8b-shape.json"
HEADLINE_KERNELS = "kernels_h200.json"
HEADLINE_SERVER = "server_tinylm-A.json"
HEADLINE_REAL = "oscar"  # today's default on the real model: through the server, else in simulation
HEADLINE_PASSKEY = ("server_passkey8k_quantizers_tinylm-A.json", "minmax")  # the newest run of the default
HEADLINE_LONG = 65536  # the decode row's shortest context
HEADLINE_HICACHE = "hicache_qwen3-8b-shape.json"
HEADLINE_STEADY = "e2e_decode_throughput_qwen3-8b-shape.json"


def _link(text: str, name: str) -> str:
    return f"[{text}](benchmarks/results/{name})"


def _maybe_load(results_dir: str, name: str) -> dict:
    path = os.path.join(results_dir, name)
    return _load(path) if os.path.isfile(path) else {}


def _span(values: list[float], digits: int = 2) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}x" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}-{hi:.{digits}f}x"


def _headline_capacity(results_dir: str) -> list[list[str]]:
    data = _maybe_load(results_dir, HEADLINE_CAPACITY)
    osc, bf = data.get("oscar_int2"), data.get("bf16")
    if not osc or not bf:
        return []
    meta = data.get("meta", {})
    return [[f"KV cache capacity, {meta.get('model', '?')} on one {meta.get('gpu') or 'GPU'} "
             f"(`--mem-fraction-static {meta.get('mem_fraction_static')}`)",
             _link(f"{fmt(osc)} tokens ({osc / bf:.2f}x)", HEADLINE_CAPACITY), _link(f"{fmt(bf)} tokens", HEADLINE_CAPACITY)]]


def _headline_kernels(results_dir: str) -> list[list[str]]:
    data = _maybe_load(results_dir, HEADLINE_KERNELS)
    cases = [c for c in data.get("cases", []) if c.get("oscar_decode_us") and c.get("flashinfer_bf16_us")]
    rows = []
    for here in ([c for c in cases if c["context"] >= HEADLINE_LONG], [c for c in cases if c["context"] < HEADLINE_LONG]):
        if not here:
            continue
        ctx, batches = sorted({c["context"] // 1024 for c in here}), sorted({c["batch"] for c in here})
        speed = _span([c["flashinfer_bf16_us"] / c["oscar_decode_us"] for c in here])
        rows.append([f"decode attention, one layer, {ctx[0]}k-{ctx[-1]}k tokens of context, batch "
                     f"{batches[0]}-{batches[-1]} ({data.get('device', '?')})",
                     _link(f"{speed} the speed of FlashInfer BF16", HEADLINE_KERNELS),
                     _link("FlashInfer BF16: 1x", HEADLINE_KERNELS)])
    return rows


def _headline_server(results_dir: str) -> list[list[str]]:
    data = _maybe_load(results_dir, HEADLINE_SERVER)
    methods, st = data.get("methods", {}), data.get("settings", {})
    ref, osc = methods.get("bf16", {}), methods.get("oscar", {})
    rows = []
    if ref.get("ppl_8k") and osc.get("ppl_8k"):
        rows.append([f"perplexity, {st.get('ppl_windows')} windows of {fmt(st.get('ppl_len'))} tokens, through the "
                     f"server ({data.get('model', '?')})",
                     _link(f"{osc['ppl_8k']:.4f} ({osc['ppl_8k'] / ref['ppl_8k']:.4f}x)", HEADLINE_SERVER),
                     _link(f"{ref['ppl_8k']:.4f}", HEADLINE_SERVER)])
    lengths = [n for n in ref.get("passkey", {}) if n in osc.get("passkey", {})]
    if lengths:
        per = (st.get("passkey_trials") or 0) * len(st.get("passkey_depths") or [])
        rows.append([f"passkey retrieval at {' / '.join(f'{int(n) // 1024}k' for n in lengths)} tokens, "
                     f"{per} prompts each, through the server",
                     _link(" / ".join(f"{osc['passkey'][n]:.3f}" for n in lengths), HEADLINE_SERVER),
                     _link(" / ".join(f"{ref['passkey'][n]:.3f}" for n in lengths), HEADLINE_SERVER)])
    name, method = HEADLINE_PASSKEY
    paired = _maybe_load(results_dir, name).get("methods", {})
    ph, rh = paired.get(method, {}).get("passkey_hits", {}), paired.get("bf16", {}).get("passkey_hits", {})
    for n in [n for n in rh if n in ph and len(ph[n]) == len(rh[n])]:
        gap, half = targets.paired_gap(ph[n], rh[n])
        rows.append([f"passkey retrieval at {int(n) // 1024}k tokens, {len(rh[n])} paired prompts, through the server "
                     f"(difference, 95% interval)",
                     _link(f"{sum(ph[n]) / len(ph[n]):.3f} ({gap:+.3f} ± {half:.3f})", name),
                     _link(f"{sum(rh[n]) / len(rh[n]):.3f}", name)])
    return rows


def _headline_real_model(results_dir: str) -> list[list[str]]:
    for name in (REAL_MODEL_SERVER, REAL_MODEL_SIM):
        data = _maybe_load(results_dir, name)
        methods = data.get("methods", {})
        ref, osc = methods.get("bf16", {}).get("ppl_details", {}), methods.get(HEADLINE_REAL, {}).get("ppl_details", {})
        lengths = [n for n in sorted(ref, key=int) if n in osc]
        if lengths:
            break
    else:
        return []
    where = ("through the server" if name == REAL_MODEL_SERVER
             else f"in simulation (oscar-eval, {data.get('settings', {}).get('device')})")
    ppl = lambda d: " / ".join(f"{d[n]['ppl']:.3f}" for n in lengths)
    ratios = " / ".join(f"{osc[n]['ppl'] / ref[n]['ppl']:.3f}" for n in lengths)
    sizes = " / ".join(f"{int(n) // 1024}k" if int(n) % 1024 == 0 else n for n in lengths)
    return [[f"perplexity at {sizes} tokens, {data.get('settings', {}).get('ppl_windows')} windows each, {where} "
             f"({data.get('model', '?')})",
             _link(f"{ppl(osc)} ({ratios}x)", name), _link(ppl(ref), name)]]


def _headline_hicache(results_dir: str) -> list[list[str]]:
    data = _maybe_load(results_dir, HEADLINE_HICACHE)
    osc, bf = (data.get("configs", {}).get(c, {}) for c in ("oscar_int2", "bf16"))
    if not osc.get("host_pool") or not bf.get("host_pool"):
        return []
    size, tokens = _hicache_size(data), data.get("settings", {}).get("prefix_tokens", 0)
    ttft = lambda c: f"{c['host_median_s']:.3f} s (recomputed: {c['recompute_median_s']:.2f} s)"
    return [[f"HiCache host tier at `--hicache-size {size}` (GB), {data.get('model', '?')}: prefix tokens held",
             _link(f"{fmt(osc['host_pool']['tokens'])} ({osc['host_pool']['tokens'] / bf['host_pool']['tokens']:.2f}x)",
                   HEADLINE_HICACHE), _link(fmt(bf["host_pool"]["tokens"]), HEADLINE_HICACHE)],
            [f"time to first token, a {tokens // 1000}k-token prefix loaded back from the host tier "
             f"({data.get('gpu', '?')}; BF16 on SGLang's triton attention)",
             _link(ttft(osc), HEADLINE_HICACHE), _link(ttft(bf), HEADLINE_HICACHE)]]


def _headline_steady(results_dir: str) -> list[list[str]]:
    data = _maybe_load(results_dir, HEADLINE_STEADY)
    rows = []
    for workload, w in data.get("settings", {}).get("workloads", {}).items():
        osc, bf = (data.get("configs", {}).get(c, {}).get(workload) or {} for c in ("oscar_int2", "bf16_flashinfer"))
        if not osc.get("decode_tok_s") or not bf.get("decode_tok_s"):
            continue
        cell = lambda r: f"{fmt(r['decode_tok_s'], 0)} tok/s, {fmt(r.get('in_flight'))} requests in flight"
        rows.append([f"decode tokens/s with the pool full, {w['input_len'] // 1000}k in / {w['output_len'] // 1024}k "
                     f"out, {data.get('model', '?')} ({data.get('environment', {}).get('gpu') or 'GPU'}; BF16 on FlashInfer)",
                     _link(f"{cell(osc)} ({osc['decode_tok_s'] / bf['decode_tok_s']:.2f}x)", HEADLINE_STEADY),
                     _link(cell(bf), HEADLINE_STEADY)])
    return rows


def render_headline(results_dir: str) -> str:
    rows = (_headline_capacity(results_dir) + _headline_kernels(results_dir) + _headline_steady(results_dir)
            + _headline_server(results_dir) + _headline_real_model(results_dir) + _headline_hicache(results_dir))
    if not rows:
        return none_yet("python3 -m benchmarks.capacity", "one GPU; see benchmarks/RESULTS.md")
    return table(["measured", "oscar_int2", "BF16"], rows)


def render_targets(results_dir: str) -> str:
    rows = [list(r) for r in targets.evaluate(results_dir)]
    return table(["target", "measured", "verdict"], rows)


def _hicache_size(data: dict) -> str:
    args = data.get("settings", {}).get("server_args", [])
    return args[args.index("--hicache-size") + 1] if "--hicache-size" in args else "?"


@per_results_file("hicache_*.json", "python3 -m benchmarks.hicache", "one GPU, 8 min")
def render_hicache(path: str, data: dict) -> list[str]:
    st = data.get("settings", {})
    rows = []
    for name, c in data.get("configs", {}).items():
        pool = c.get("host_pool", {})
        hit = [t.get("host") for t in c.get("ttft", {}).get("host", [])]
        rows.append([name, fmt(pool.get("tokens")), fmt(pool.get("bytes_per_token")), fmt(c.get("max_total_num_tokens")),
                     fmt(c.get("recompute_median_s"), 3), fmt(c.get("host_median_s"), 3),
                     " / ".join(fmt(h) for h in hit) or "-", fmt(c.get("device_median_s"), 3)])
    parts = [f"`{_rel(path)}` ({data.get('gpu', '?')}, code {data.get('code', '?')}): {data.get('model', '?')} with "
             f"`--load-format dummy`, `--hicache-size {_hicache_size(data)}` GB of host memory for each configuration, a "
             f"device pool of `--max-total-tokens` tokens; time to first token of a {fmt(st.get('prefix_tokens'))}-token "
             f"prefix + {st.get('suffix_tokens')} new tokens, medians over {st.get('reps')} reps; bf16 with io backend "
             f"`{st.get('bf16_io_backend')}` and layout `{st.get('bf16_mem_layout')}`, oscar_int2 with io backend `direct` "
             f"and layout `{st.get('oscar_mem_layout')}`.",
             table(["config", "host tier tokens", "bytes per token", "device pool tokens", "TTFT recomputed (s)",
                    "TTFT host hit (s)", "tokens loaded from host (per rep)", "TTFT device hit (s)"], rows)]
    if data.get("notes"):
        parts.append("\n".join(f"- {n}" for n in data["notes"]))
    return parts


def _paired(p: dict | None, digits: int = 3) -> str:
    return _gap(p["gap"], p["half_width_95"], digits) if p else "-"


@per_results_file("quantizer_study_*.json",  # the study's candidates lost and left the code with its script
                  "git show 508d1dc:benchmarks/quantizer_study.py", "one GPU, 5 min, or CPU")
def render_quantizer_study(path: str, data: dict) -> list[str]:
    st, cands = data.get("settings", {}), data.get("candidates", {})
    parts = [f"`{_rel(path)}`: {data.get('model', '?')}, simulated {FAKE_INT2} with the server's read rule "
             f"(BF16 sink and ring, INT2 history); {st.get('ppl', '')}; passkey prompts "
             + ", ".join(f"{n}: {c}" for n, c in sorted(st.get("passkey_prompts_per_length", {}).items(),
                                                     key=lambda x: int(x[0]))) + f"; {st.get('device', '?')}.",
             _quantizer_table(cands)]
    served = data.get("through_server")
    if served:
        parts += [f"Through the server: {served['path']}; the same held-out windows and prompts.",
                  _quantizer_table(served["candidates"])]
    parts += [data[k] for k in ("conclusion", "not_run") if data.get(k)]
    return parts


def _quantizer_table(cands: dict) -> str:
    lengths = sorted({n for r in cands.values() for n in r.get("passkey", {})}, key=int)
    rows = []
    for name, r in cands.items():
        pk, vs_m, vs_b = r.get("passkey", {}), r.get("passkey_paired_vs_minmax", {}), r.get("passkey_paired_vs_bf16", {})
        rows.append([name, fmt((r.get("bytes_per_token_per_head") or {}).get("total")), fmt(r.get("ppl_8k"), 4),
                     fmt(r.get("ppl_ratio_vs_bf16"), 4), _paired(r.get("nll_paired_vs_minmax"), 4)]
                    + [fmt(pk.get(n), 3) for n in lengths]
                    + [_paired(vs_m.get(lengths[-1])), _paired(vs_b.get(lengths[-1]))])
    return table(["candidate", "bytes / token / KV head", "ppl_8k", "vs bf16", "NLL vs minmax (paired)"]
                 + [f"passkey {n}" for n in lengths]
                 + [f"passkey {lengths[-1]} vs minmax", f"passkey {lengths[-1]} vs bf16"], rows)


def _serve_cell(row: dict) -> str:
    verdict = row.get("verdict", "-")
    if verdict.startswith("refused"):
        return "refused at start-up: " + verdict.split("cannot serve ", 1)[-1].split(": ", 1)[-1]
    return verdict


def render_architectures(results_dir: str) -> str:
    """README's model table: each calibration/architectures.py row, calibrated on the CPU and served on a GPU."""
    calib = {r["name"]: r for r in _maybe_load(results_dir, "calibration_architectures.json").get("rows", [])}
    serve = _maybe_load(results_dir, "architectures_serving.json")
    if not calib or not serve.get("rows"):
        return none_yet("python3 -m benchmarks.architectures_serving", "one GPU, 6 min")
    rows = []
    for r in serve["rows"]:
        g, c = r.get("geometry", {}), calib.get(r["name"], {})
        features = ", ".join(f for f in r.get("features", []) if not f.startswith("head_dim"))
        rows.append([f"{r.get('source', r['name'])} (`{r.get('architecture', '?')}`)",
                     f"{g.get('num_q_heads')}q / {g.get('num_kv_heads')}kv, head_dim {g.get('head_dim')}"
                     + (f"; {features}" if features else ""),
                     _link("ok" if c.get("calibrate_ok") and c.get("file_ok") else "fail", "calibration_architectures.json"),
                     _link(_serve_cell(r), "architectures_serving.json")])
    checks = serve.get("checks", {})
    caption = (f"Served on one {serve.get('device', 'GPU')} (2 layers of the real attention geometry, seeded random "
               f"weights; `oscar_int2` against BF16, chunked prefill 1024): a pass is {checks.get('windows')}; a "
               f"{checks.get('long')}; {checks.get('concurrent')}; {checks.get('graphs')}. Calibrated on the CPU.")
    return caption + "\n\n" + table(["model", "attention geometry", "calibrate", "serve"], rows)


SECTIONS = {
    "architectures": render_architectures,
    "hicache": render_hicache,
    "quantizer-study": render_quantizer_study,
    "headline": render_headline,
    "targets": render_targets,
    "e2e": render_e2e,
    "e2e-decode-throughput": render_e2e_decode_throughput,
    "decode-profile": render_decode_profile,
    "capacity": render_capacity,
    "server-fidelity": render_server_fidelity,
    "real-model": render_real_model,
    "real-model-study": render_real_model_study,
    "fidelity-candidates": render_fidelity_candidates,
    "key-debias": render_key_debias,
    "fidelity": render_fidelity,
    "soak": render_soak,
    "kernels": render_kernels,
    "extend": render_extend,
    "tp": render_tp,
    "calibration-proxy": render_calibration_proxy,
    "fidelity-sweep": render_fidelity_sweep,
    "calibration-budget": render_calibration_budget,
}


# ------------------------------------------------------------------------- documents


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- report:{name} -->", f"<!-- /report:{name} -->"


def sections_in(text: str) -> list[str]:
    return re.findall(r"<!-- report:([a-z0-9-]+) -->", text)


def update(text: str, results_dir: str = RESULTS) -> str:
    """``text`` with every report section regenerated."""
    for name in sections_in(text):
        if name not in SECTIONS:
            raise ValueError(f"section report:{name} has no renderer (known: {', '.join(SECTIONS)})")
        begin, end = _markers(name)
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(end) < text.index(begin):
            raise ValueError(f"section report:{name} needs exactly one '{begin}' followed by one '{end}'")
        a, b = text.index(begin) + len(begin), text.index(end)
        text = text[:a] + "\n" + SECTIONS[name](results_dir).strip() + "\n" + text[b:]
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render the README's and benchmarks/RESULTS.md's tables from "
                                             "benchmarks/results/*.json")
    ap.add_argument("section", nargs="?", help=f"print one section ({', '.join(SECTIONS)})")
    names = ", ".join(os.path.relpath(d, ROOT) for d in DOCUMENTS)
    ap.add_argument("--write", nargs="*", metavar="FILE", help=f"regenerate the sections of these files in place "
                                                                f"(default: {names})")
    ap.add_argument("--check", nargs="*", metavar="FILE", help=f"exit 1 if a section of these files is stale "
                                                                f"(default: {names})")
    ap.add_argument("--results", default=RESULTS, help="results folder")
    a = ap.parse_args(argv)
    if a.section:
        if a.section not in SECTIONS:
            ap.error(f"unknown section {a.section!r} (known: {', '.join(SECTIONS)})")
        print(SECTIONS[a.section](a.results))
    status = 0
    for paths, write in ((a.write, True), (a.check, False)):
        if paths is None:
            continue
        for path in paths or DOCUMENTS:
            with open(path, encoding="utf-8") as f:
                old = f.read()
            new = update(old, a.results)
            if write:
                if new != old:
                    with open(path, "w", encoding="utf-8") as f:
                        f.write(new)
                print(f"{path}: {len(sections_in(new))} report sections {'updated' if new != old else 'up to date'}")
            elif new != old:
                stale = [n for n in sections_in(old) if update(_only(old, n), a.results) != _only(old, n)]
                print(f"{path}: stale report sections {', '.join(stale)}; run: "
                      f"python3 -m benchmarks.report --write", file=sys.stderr)
                status = 1
    return status


def _only(text: str, name: str) -> str:
    begin, end = _markers(name)
    return text[text.index(begin):text.index(end) + len(end)]


if __name__ == "__main__":
    sys.exit(main())
