"""The two measurements, driven through a KV simulator like the server drives its cache:
prompts are prefilled in chunks of ``chunk`` tokens and answers decoded token by token.

- :func:`perplexity_lockstep`: teacher-forced next-token NLL over held-out windows; each
  window is one sequence prefilled chunk by chunk, so every chunk after the first reads the
  simulated cache of the previous ones; optionally its last tokens are fed one per step
  (decode), where only the sink and the recent window are BF16. Several simulators advance
  together, step by step, and each one's logits are compared with the reference's (bf16) of
  the same step (calibration.fidelity.agreement); :func:`perplexity` runs one simulator.
- :func:`passkey`: tinylm's passkey task (prompts from tasks.passkey_prompts): chunked
  prefill of the prompt, then greedy decoding of up to 10 tokens, each step reading the
  cache; stops early once the answer's first 6 characters are settled (exact, see
  tasks.passkey_answer_settled) or at an end-of-sequence token.
"""
from __future__ import annotations

import math
import time
from itertools import groupby

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import agreement, tasks
from .attention import forward_step


def chunk_bounds(length: int, chunk: int) -> list[tuple[int, int]]:
    if chunk < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk}")
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def position_buckets(length: int) -> list[tuple[int, int]]:
    """tinylm's NLL-by-position buckets (0-256, 256-L/8, L/8-L/4, L/4-L/2, L/2-L)."""
    edges = sorted({0, min(length, 256), length // 8, length // 4, length // 2, length})
    return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


TOPK_REF, TOPK_METHOD = 20, 64  # the server's top-K lists (benchmarks.server_fidelity): the same bound here


def compare_logits(ref_logits: torch.Tensor, logits: torch.Tensor, topk=(TOPK_REF, TOPK_METHOD)) -> dict:
    """Per position [B, T] (numpy): ``kl`` = KL(BF16 || method) over the whole vocabulary, and
    what the server's top-K lists give on the same logits (``top1``, ``kl_topk``, ``missing``:
    agreement.topk_agreement with BF16's top ``topk[0]`` and the method's top ``topk[1]``).
    ``ref_logits`` / ``logits`` [B, T, V]: BF16's and the method's logits of the same step."""
    ref_k, k = topk
    b, t, _ = logits.shape
    kl = agreement.kl_full(ref_logits, logits).cpu().numpy()
    ref_lp, ref_idx = torch.log_softmax(ref_logits.float(), -1).topk(k, -1)
    m_lp, m_idx = torch.log_softmax(logits.float(), -1).topk(k, -1)
    flat = lambda x: x.reshape(b * t, k).cpu().numpy()
    out = agreement.topk_agreement(flat(ref_lp), flat(ref_idx), flat(m_lp), flat(m_idx), ref_k)
    return {"kl": kl, **{name: v.reshape(b, t) for name, v in out.items()}}


@torch.no_grad()
def perplexity_lockstep(model, sims: dict, stream: np.ndarray, length: int, windows: int, chunk: int,
                        batch: int = 1, decode_tail: int = 0, reference: str | None = "bf16",
                        topk=(TOPK_REF, TOPK_METHOD), desc: str = "ppl") -> dict[str, dict]:
    """Mean next-token NLL over the windows for every simulator in ``sims`` ({name: sim}), run in
    lockstep: each step (a prefill chunk or a decoded token) goes through the ``reference`` first,
    then through every other simulator, whose logits are compared with the reference's at once
    (:func:`compare_logits`), so one step's logits per method are held, never a window's.
    Positions ``< length - decode_tail`` are scored from chunked prefill; the last
    ``decode_tail`` ones are fed one token per step (teacher-forced decode, as generation reads
    the cache) and also reported apart. Returns {name: result}; a compared method's result has
    ``agreement`` (agreement.AgreementTally.result over positions >= ``chunk``) and every one
    ``seconds`` (its own forwards)."""
    if not 0 <= decode_tail < length:
        raise ValueError(f"decode tail {decode_tail} must be in 0..{length - 1}")
    if reference is not None and reference not in sims:
        reference = None
    order = ([reference] if reference else []) + [n for n in sims if n != reference]
    starts = tasks.ppl_window_starts(len(stream), length, windows)
    dev = next(model.parameters()).device
    nll_sum = {n: torch.zeros(length, dtype=torch.float64, device=dev) for n in order}
    nll_windows = {n: [] for n in order}  # mean NLL of each window, in window order (paired comparisons)
    seconds = dict.fromkeys(order, 0.0)
    tallies = {n: agreement.AgreementTally(chunk, position_buckets(length)) for n in order if reference and n != reference}
    split = length - decode_tail
    bar = tqdm(total=len(starts), desc=desc, unit="win", leave=False)
    for b0 in range(0, len(starts), batch):
        rows = np.stack([stream[s:s + length + 1] for s in starts[b0:b0 + batch]])
        ids = torch.from_numpy(rows).to(dev)
        for n in order:
            sims[n].begin(ids.shape[0])
        steps = chunk_bounds(split, chunk) + [(j, j + 1) for j in range(split, length)]
        win_sum = {n: torch.zeros(ids.shape[0], dtype=torch.float64, device=dev) for n in order}
        for lo, hi in steps:
            ref_logits = None
            for n in order:
                t0 = time.perf_counter()
                logits = forward_step(model, sims[n], ids[:, lo:hi])
                nll = F.cross_entropy(logits.float().transpose(1, 2), ids[:, lo + 1:hi + 1], reduction="none")
                nll_sum[n][lo:hi] += nll.double().sum(0)
                win_sum[n] += nll.double().sum(1)
                seconds[n] += time.perf_counter() - t0
                if n == reference:
                    ref_logits = logits
                elif n in tallies:
                    measures = compare_logits(ref_logits, logits, topk)
                    for i in range(ids.shape[0]):
                        tallies[n].add(b0 + i, np.arange(lo, hi), {k: v[i] for k, v in measures.items()})
        for n in order:
            nll_windows[n] += [round(x, 6) for x in (win_sum[n] / length).tolist()]
        bar.update(ids.shape[0])
    bar.close()
    out = {}
    for n in order:
        per_pos = nll_sum[n] / len(starts)
        mean = per_pos.mean().item()
        r = {"ppl": math.exp(mean), "nll": mean, "windows": len(starts), "window_starts": starts,
             "nll_by_window": nll_windows[n],
             "nll_by_position": {f"{lo}-{hi}": round(per_pos[lo:hi].mean().item(), 5)
                                 for lo, hi in position_buckets(length)}}
        if decode_tail:
            r.update(decode_tail=decode_tail, nll_prefill=per_pos[:split].mean().item(),
                     nll_decode=per_pos[split:].mean().item(), ppl_decode=math.exp(per_pos[split:].mean().item()))
        if n in tallies:
            r["agreement"] = tallies[n].result()
        r["seconds"] = round(seconds[n], 1)
        out[n] = r
    return out


def perplexity(model, sim, stream: np.ndarray, length: int, windows: int, chunk: int,
               batch: int = 1, decode_tail: int = 0, desc: str = "ppl") -> dict:
    """One simulator's :func:`perplexity_lockstep` result (no comparison)."""
    return perplexity_lockstep(model, {"sim": sim}, stream, length, windows, chunk, batch, decode_tail,
                               reference=None, desc=desc)["sim"]


@torch.no_grad()
def greedy_answers(model, sim, tokenizer, prompt_ids: np.ndarray, chunk: int, eos_ids: set[int],
                   first_targets: list[int]) -> tuple[list[str], list[float]]:
    """Chunked prefill of equal-length prompts [B, P], then greedy decoding step by step.
    Returns the answers and, per prompt, log p(first_targets[i]) after the prompt (a
    continuous retrieval score)."""
    dev = next(model.parameters()).device
    ids = torch.from_numpy(np.ascontiguousarray(prompt_ids)).to(dev)
    b = ids.shape[0]
    sim.begin(b)
    for lo, hi in chunk_bounds(ids.shape[1], chunk):
        logits = forward_step(model, sim, ids[:, lo:hi], logits_to_keep=1)
    lp = torch.log_softmax(logits[:, -1].float(), -1)
    first_lp = lp[torch.arange(b, device=lp.device), torch.tensor(first_targets, device=lp.device)].tolist()
    gen, done = [[] for _ in range(b)], [False] * b
    max_new_tokens = tasks.PASSKEY_MAX_NEW_TOKENS
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if done[i]:
                continue
            if t in eos_ids:
                done[i] = True
                continue
            gen[i].append(t)
            done[i] = tasks.passkey_answer_settled(tasks.decode(tokenizer, gen[i]))
        if all(done) or step == max_new_tokens - 1:
            break
        logits = forward_step(model, sim, nxt.unsqueeze(1), logits_to_keep=1)
    return [tasks.decode(tokenizer, g) for g in gen], first_lp


def passkey(model, sim, tokenizer, prompts: list[tasks.PasskeyPrompt], chunk: int, eos_ids: set[int],
            batch: int = 1, desc: str = "passkey", examples: int = 1) -> dict:
    """Accuracy per (length, depth) cell, its mean over depths per length, a few answers, and
    per length the mean log-probability of the value's first token right after the prompt
    (finer-grained than hit or miss when comparing methods on the same prompts). ``hits`` and
    ``first_token_logprobs``: per length, one entry per prompt in prompt order (the same order
    for every method: paired comparisons)."""
    by_depth, shown, first_lp, hit_list = {}, [], {}, {}
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False)
    for (length, depth), cell in groupby(prompts, key=lambda p: (p.length, p.depth)):
        cell = list(cell)
        hits = 0
        for b0 in range(0, len(cell), batch):
            part = cell[b0:b0 + batch]
            targets = [tasks.encode(tokenizer, p.value)[0] for p in part]
            answers, lps = greedy_answers(model, sim, tokenizer, np.stack([p.ids for p in part]), chunk, eos_ids,
                                          first_targets=targets)
            first_lp.setdefault(str(length), []).extend(lps)
            for p, a in zip(part, answers):
                hit = tasks.passkey_hit(a, p.value)
                hits += hit
                hit_list.setdefault(str(length), []).append(int(hit))
                if p.trial < examples:
                    shown.append({"len": length, "depth": depth, "want": p.value, "got": a[:12]})
            bar.update(len(part))
        by_depth.setdefault(str(length), {})[str(depth)] = hits / len(cell)
    bar.close()
    mean = {k: sum(v.values()) / len(v) for k, v in by_depth.items()}
    return {"mean": mean, "by_depth": by_depth, "examples": shown, "hits": hit_list,
            "first_token_logprob": {k: round(sum(v) / len(v), 4) for k, v in first_lp.items()},
            "first_token_logprobs": {k: [round(x, 4) for x in v] for k, v in first_lp.items()}}
