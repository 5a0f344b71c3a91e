"""Agreement with BF16 through the server, from the servers' top-K lists (benchmarks.server_fidelity).

Each server's perplexity windows come back with the ``K`` most likely tokens at every position;
they are kept in one ``.npz`` per method (:func:`save_topk`), since the full-vocabulary logits
never leave the server, and a method is compared with bf16 once both files exist
(:func:`add_agreement`, at the end of a run or after ``--merge``): top-1 agreement exactly and a
lower bound on KL(bf16 || method) (calibration.fidelity.agreement) per position past the first
prefill chunk, per window, and by position bucket.

File layout: for each perplexity length L, ``lp_L`` float32 [windows, L, K] (log-probs,
descending), ``idx_L`` int32 [windows, L, K] (token ids) and ``starts_L`` int64 [windows]
(the windows' offsets in the held-out stream; both methods must have scored the same windows).
"""
from __future__ import annotations

import os

import numpy as np

from calibration.fidelity.agreement import AgreementTally, topk_agreement
from calibration.fidelity.runner import position_buckets

REFERENCE = "bf16"


def save_topk(path: str, per_length: dict[int, dict]) -> str:
    """Write {L: perplexity() result with top_lp / top_idx} to ``path``; returns its absolute path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    arrays = {}
    for n, p in per_length.items():
        arrays[f"lp_{n}"], arrays[f"idx_{n}"] = p["top_lp"], p["top_idx"]
        arrays[f"starts_{n}"] = np.asarray(p["window_starts"], dtype=np.int64)
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return os.path.abspath(path)


def compare(ref_path: str, path: str, chunk: int, ref_k: int) -> dict[str, dict]:
    """{str(L): AgreementTally.result()} of the method in ``path`` against the bf16 lists in
    ``ref_path``, for every length both hold (positions >= ``chunk`` overall and per window)."""
    with np.load(ref_path) as ref, np.load(path) as m:
        lengths = sorted(int(k[3:]) for k in ref.files if k.startswith("lp_") and k in m.files)
        out = {}
        for n in lengths:
            if not np.array_equal(ref[f"starts_{n}"], m[f"starts_{n}"]):
                raise ValueError(f"{path}: its windows of {n} tokens are not those of {ref_path}")
            r_lp, r_idx, m_lp, m_idx = ref[f"lp_{n}"], ref[f"idx_{n}"], m[f"lp_{n}"], m[f"idx_{n}"]
            tally = AgreementTally(chunk, position_buckets(n))
            positions = np.arange(n)
            for w in range(r_lp.shape[0]):
                meas = topk_agreement(r_lp[w], r_idx[w], m_lp[w], m_idx[w], ref_k)
                tally.add(w, positions, meas)
            out[str(n)] = tally.result()
    return out


def add_agreement(result: dict, chunk: int, ref_k: int) -> list[str]:
    """Fill ``agreement`` of every method of ``result`` (a server_fidelity result) whose top-K
    file and bf16's both exist; returns the names compared."""
    methods = result.get("methods", {})
    ref = methods.get(REFERENCE, {}).get("topk_file")
    done = []
    if not ref or not os.path.isfile(ref):
        return done
    for name, m in methods.items():
        path = m.get("topk_file")
        if name == REFERENCE or not path or not os.path.isfile(path):
            continue
        m["agreement"] = compare(ref, path, chunk, ref_k)
        done.append(name)
    return done
