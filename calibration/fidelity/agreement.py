"""Agreement of a method's next-token distributions with BF16's, on the same positions.

Both measurements (``oscar-eval`` in the simulator, ``benchmarks.server_fidelity`` through the
server) score a position ``p`` of a perplexity window by the distribution that predicts token
``p + 1``; positions below the first prefill chunk read fresh BF16 K/V, so the figures count
positions ``p >= start`` (``start`` = the chunk) and break all positions down by bucket.

- top-1 agreement: the method's most likely token is BF16's. Logits are BF16 values, so two
  tokens can tie for the top; a position agrees when the two sets of tied top tokens meet
  (the same rule for full logits and for top-K lists, whatever order ties come in).
- :func:`kl_full`: KL(BF16 || method) over the whole vocabulary (the simulator has the logits).
- :func:`topk_agreement`: what a server's top-K lists allow: top-1 agreement exactly, and a
  *lower bound* on KL(BF16 || method) (see its doc).
"""
from __future__ import annotations

import numpy as np

Q_FLOOR = 1e-30  # a bucket the method gives (numerically) no mass: finite, very large KL terms


def _xlogx_over(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """p log(p / q), 0 where p == 0."""
    p = np.maximum(p, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(p > 0, p * (np.log(np.maximum(p, Q_FLOOR)) - np.log(np.maximum(q, Q_FLOOR))), 0.0)


def top1_agree(ref_lp: np.ndarray, ref_idx: np.ndarray, m_lp: np.ndarray, m_idx: np.ndarray) -> np.ndarray:
    """bool [N]: the tied-top token sets of the two top-K lists meet. ``*_lp`` [N, K] log-probs
    in descending order, ``*_idx`` [N, K] their token ids."""
    ref_top = ref_lp == ref_lp[:, :1]
    m_top = m_lp == m_lp[:, :1]
    same = ref_idx[:, :, None] == m_idx[:, None, :]
    return (same & ref_top[:, :, None] & m_top[:, None, :]).any(axis=(1, 2))


def kl_topk_lower_bound(ref_lp: np.ndarray, ref_idx: np.ndarray, m_lp: np.ndarray, m_idx: np.ndarray,
                        ref_k: int) -> tuple[np.ndarray, np.ndarray]:
    """A lower bound on KL(BF16 || method) per position from top-K lists, and how many of BF16's
    top ``ref_k`` tokens are missing from the method's list (int [N]).

    ``ref_lp`` / ``ref_idx`` [N, >= ref_k]: BF16's largest log-probs (descending) and token ids;
    ``m_lp`` / ``m_idx`` [N, K'] the method's (K' >= ref_k). Both distributions are coarsened to
    BF16's top ``ref_k`` tokens plus one bucket for all other tokens, which can only lower the KL
    (log-sum inequality). The method's probability of a BF16 token in its own list is exact; of
    the m tokens missing from it, each is at most the method's K'-th probability, so their
    merged mass q_M lies in [0, min(S - q_other, m * q_K')] (S: the method's mass outside the
    BF16 tokens it lists; q_other: what it lists of other tokens, which stays in the rest); the
    bound takes the q_M in that range with the least KL (the two-bucket term is convex in q_M:
    its minimum is at S * p_M / (p_M + p_rest), clipped to the range)."""
    if m_lp.shape[1] < ref_k or ref_lp.shape[1] < ref_k:
        raise ValueError(f"top-K lists of {ref_lp.shape[1]} (BF16) and {m_lp.shape[1]} (method) entries "
                         f"cannot bound a KL over BF16's top {ref_k}")
    r_lp, r_idx = ref_lp[:, :ref_k].astype(np.float64), ref_idx[:, :ref_k]
    mlp = m_lp.astype(np.float64)
    match = r_idx[:, :, None] == m_idx[:, None, :]  # [N, K, K']
    present = match.any(-1)
    q_lp = np.where(present, np.where(match, mlp[:, None, :], -np.inf).max(-1), 0.0)
    p = np.exp(r_lp)
    kl_present = np.where(present, p * (r_lp - q_lp), 0.0).sum(-1)
    p_missing = np.where(present, 0.0, p).sum(-1)
    p_rest = np.maximum(1.0 - p.sum(-1), 0.0)
    s = np.maximum(1.0 - np.where(present, np.exp(q_lp), 0.0).sum(-1), 0.0)
    q_other = np.where(match.any(1), 0.0, np.exp(mlp)).sum(-1)
    n_missing = (~present).sum(-1)
    cap = np.maximum(np.minimum(s - q_other, n_missing * np.exp(mlp[:, -1])), 0.0)
    both = p_missing + p_rest
    with np.errstate(divide="ignore", invalid="ignore"):
        q_m = np.clip(np.where(both > 0, s * p_missing / np.where(both > 0, both, 1.0), 0.0), 0.0, cap)
    kl = kl_present + _xlogx_over(p_missing, q_m) + _xlogx_over(p_rest, s - q_m)
    return kl, n_missing


def topk_agreement(ref_lp, ref_idx, m_lp, m_idx, ref_k: int) -> dict[str, np.ndarray]:
    """Per position [N]: ``top1`` (1.0 / 0.0), ``kl_topk`` (the lower bound of
    :func:`kl_topk_lower_bound`) and ``missing`` (BF16 top-``ref_k`` tokens absent from the method's list)."""
    kl, missing = kl_topk_lower_bound(ref_lp, ref_idx, m_lp, m_idx, ref_k)
    return {"top1": top1_agree(ref_lp, ref_idx, m_lp, m_idx).astype(np.float64), "kl_topk": kl,
            "missing": missing.astype(np.float64)}


def kl_full(ref_logits, m_logits):
    """KL(BF16 || method) per position over the whole vocabulary: logits [..., V] (torch) in, float64 [...] out."""
    import torch

    ref = torch.log_softmax(ref_logits.float(), -1)
    m = torch.log_softmax(m_logits.float(), -1)
    return (ref.exp() * (ref - m)).sum(-1).double()


class AgreementTally:
    """Per-position agreement measures summed over the positions ``>= start`` (overall and per
    window, in window order) and over all positions per bucket (``buckets``: [lo, hi) ranges)."""

    def __init__(self, start: int, buckets: list[tuple[int, int]]):
        self.start, self.buckets = start, buckets
        self.total: dict[str, float] = {}
        self.count = 0
        self.windows: dict[int, dict[str, float]] = {}
        self.window_count: dict[int, int] = {}
        self.by_bucket = {b: {} for b in buckets}
        self.bucket_count = dict.fromkeys(buckets, 0)

    def add(self, window: int, positions: np.ndarray, measures: dict[str, np.ndarray]) -> None:
        """Measures [n] at ``positions`` [n] (the predicting positions) of one window."""
        positions = np.asarray(positions)
        late = positions >= self.start
        self.count += int(late.sum())
        self.window_count[window] = self.window_count.get(window, 0) + int(late.sum())
        w = self.windows.setdefault(window, {})
        for lo, hi in self.buckets:
            self.bucket_count[(lo, hi)] += int(((positions >= lo) & (positions < hi)).sum())
        for name, vals in measures.items():
            vals = np.asarray(vals, dtype=np.float64)
            self.total[name] = self.total.get(name, 0.0) + float(vals[late].sum())
            w[name] = w.get(name, 0.0) + float(vals[late].sum())
            for lo, hi in self.buckets:
                b = self.by_bucket[(lo, hi)]
                b[name] = b.get(name, 0.0) + float(vals[(positions >= lo) & (positions < hi)].sum())

    def result(self, digits: int = 6) -> dict:
        """{"from_position", "positions", <measure>: mean, "by_window": {<measure>: [...]},
        "by_position": {"lo-hi": {<measure>: mean}}}."""
        mean = lambda s, n: round(s / n, digits) if n else None
        order = sorted(self.windows)
        return {"from_position": self.start, "positions": self.count,
                **{k: mean(v, self.count) for k, v in self.total.items()},
                "by_window": {k: [mean(self.windows[w].get(k, 0.0), self.window_count[w]) for w in order]
                              for k in self.total},
                "by_position": {f"{lo}-{hi}": {k: mean(v, self.bucket_count[(lo, hi)])
                                               for k, v in self.by_bucket[(lo, hi)].items()}
                                for lo, hi in self.buckets}}
