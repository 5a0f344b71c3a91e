"""Steady-state decode figures of one SGLang 0.5.17 server, read from its scheduler log and /metrics.

Source of the steady-state decode rate: the scheduler's periodic "Decode batch" log lines
(``scheduler_components/metrics_reporter.py``). Each one closes an interval of exactly
``--decode-log-interval`` decode steps, timed in the scheduler with ``perf_counter``, and
reports ``gen throughput (token/s)`` = the tokens decoded in that interval / its seconds and
``#running-req`` at its end. A prefill that ran inside an interval is in its seconds too, so an
interval counts as steady only when the line before it is also a "Decode batch" line (no
"Prefill batch" and no "Retract requests" line between them) and ``#running-req`` is the same
at both ends (no request joined or left). Of the steady intervals, those at full concurrency
(``#running-req`` >= FULL_FRACTION x the largest seen) give the figures: median tokens/s,
requests in flight, ms per step.

Source of the end-to-end output rate: the counter ``sglang:realtime_tokens_total{mode="decode"}``
of ``/metrics`` (``--enable-metrics``; the scheduler adds the batch size at every decode step, so
unfinished requests count), sampled from the first request to the end of the window.
"""
from __future__ import annotations

import re
import statistics

FULL_FRACTION = 0.9

# the line prefix is configure_logger's "[%Y-%m-%d %H:%M:%S{.ms}{ DPn}{ TPn}...] "
_STAMP = r"\[(?P<time>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?)[^\]]*\]\s+"
DECODE_RE = re.compile(
    _STAMP + r"Decode batch(?: \[\d+\])?, #running-req: (?P<running>\d+), .*?"
    r"#token: (?P<tokens>\d+), token usage: (?P<usage>[0-9.]+), .*?"
    r"(?:cuda|cpu|npu|musa) graph: (?P<graph>True|False), "
    r"gen throughput \(token/s\): (?P<gen>[0-9.]+), #queue-req: (?P<queue>\d+)")
PREFILL_RE = re.compile(
    _STAMP + r"Prefill batch(?: \[\d+\])?, #new-seq: (?P<new_seq>\d+), #new-token: (?P<new_token>\d+), .*?"
    r"#running-req: (?P<running>\d+), #queue-req: (?P<queue>\d+)")
RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (?P<n>\d+)")


def parse_scheduler_log(text: str) -> list[dict]:
    """The scheduler's decode, prefill and retraction lines of ``text``, in order."""
    events = []
    for line in text.splitlines():
        if m := DECODE_RE.search(line):
            events.append({"kind": "decode", "time": m["time"], "running": int(m["running"]),
                           "tokens": int(m["tokens"]), "usage": float(m["usage"]), "graph": m["graph"] == "True",
                           "gen_tok_s": float(m["gen"]), "queue": int(m["queue"])})
        elif m := PREFILL_RE.search(line):
            events.append({"kind": "prefill", "time": m["time"], "new_seq": int(m["new_seq"]),
                           "new_token": int(m["new_token"]), "running": int(m["running"]), "queue": int(m["queue"])})
        elif m := RETRACT_RE.search(line):
            events.append({"kind": "retract", "retracted": int(m["n"])})
    return events


def steady_intervals(events: list[dict]) -> list[dict]:
    """The decode lines whose interval held decode steps only, at a constant batch."""
    out = []
    for prev, cur in zip(events, events[1:]):
        if prev["kind"] == cur["kind"] == "decode" and prev["running"] == cur["running"] and cur["gen_tok_s"] > 0:
            out.append(cur)
    return out


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def steady_state(events: list[dict], full_fraction: float = FULL_FRACTION) -> dict:
    """The steady-state figures of a workload's log events (see the module docstring);
    ``decode_tok_s`` None when no interval was steady."""
    steady = steady_intervals(events)
    decodes = [e for e in events if e["kind"] == "decode"]
    res = {"decode_lines": len(decodes), "prefill_lines": sum(e["kind"] == "prefill" for e in events),
           "retracted_requests": sum(e.get("retracted", 0) for e in events),
           "max_running_req": max((e["running"] for e in decodes), default=None),
           "steady_intervals": len(steady), "full_fraction": full_fraction}
    if not steady:
        return {**res, "decode_tok_s": None, "in_flight": None}
    peak = max(e["running"] for e in steady)
    full = [e for e in steady if e["running"] >= full_fraction * peak]
    rates = [e["gen_tok_s"] for e in full]
    ms = [1000.0 * e["running"] / e["gen_tok_s"] for e in full]
    return {**res, "full_intervals": len(full),
            "in_flight": int(statistics.median(e["running"] for e in full)),
            "in_flight_max": peak,
            "decode_tok_s": round(statistics.median(rates), 1),
            "decode_tok_s_p10": round(_quantile(rates, 0.1), 1), "decode_tok_s_p90": round(_quantile(rates, 0.9), 1),
            "ms_per_step": round(statistics.median(ms), 2),
            "kv_tokens_in_use": int(statistics.median(e["tokens"] for e in full)),
            "token_usage": round(statistics.median(e["usage"] for e in full), 3),
            "cuda_graph_fraction": round(sum(e["graph"] for e in full) / len(full), 3)}


# ------------------------------------------------------------------------- /metrics

_SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels``;
    None when there is none."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m or m["name"] != name:
            continue
        have = dict(_LABEL_RE.findall(m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            try:
                total += float(m["value"])
            except ValueError:
                continue
            found = True
    return total if found else None


DECODE_COUNTER = ("sglang:realtime_tokens_total", {"mode": "decode"})


def metrics_sample(text: str, t: float) -> dict:
    """One poll of /metrics: seconds since the workload started, the decode-token counter,
    running and queued requests."""
    name, labels = DECODE_COUNTER
    return {"t": round(t, 2), "decode_tokens": metric_value(text, name, **labels),
            "running": metric_value(text, "sglang:num_running_reqs"),
            "queue": metric_value(text, "sglang:num_queue_reqs")}


def window_rate(samples: list[dict], start_tokens: float | None = None) -> dict:
    """Decode tokens per second from the workload's start (t = 0; counter ``start_tokens``,
    else the first sample's) to the last sample with a counter value."""
    have = [s for s in samples if s.get("decode_tokens") is not None]
    if not have:
        return {"e2e_output_tok_s": None, "window_s": None, "decode_tokens": None}
    base = start_tokens if start_tokens is not None else have[0]["decode_tokens"]
    t0 = 0.0 if start_tokens is not None else have[0]["t"]
    last = have[-1]
    dt = last["t"] - t0
    tokens = last["decode_tokens"] - base
    return {"e2e_output_tok_s": round(tokens / dt, 1) if dt > 0 else None, "window_s": round(dt, 1),
            "decode_tokens": int(tokens)}


def tokens_by(samples: list[dict], start_tokens: float, t: float) -> float | None:
    """Decode tokens made by ``t`` seconds into the workload (linear between the samples
    around it); None when no sample reaches ``t``."""
    have = [(0.0, start_tokens)] + [(s["t"], s["decode_tokens"]) for s in samples if s.get("decode_tokens") is not None]
    for (ta, a), (tb, b) in zip(have, have[1:]):
        if ta <= t <= tb:
            return a - start_tokens + (b - a) * ((t - ta) / (tb - ta) if tb > ta else 1.0)
    return None
