"""Rotations from covariances: eigendecomposition and the composition variants.

Conventions (as in :mod:`calibration.transforms`): vectors are rows and a rotation acts as
``x' = x @ R``. Factors (all [D, D], orthogonal):

- ``U``: eigenvectors of C (C_Q for keys, C_S for values) as columns, eigenvalues sorted
  descending, so ``(x @ U)[i] = <x, u_i>`` is the coordinate along the i-th most important
  direction. Sign fixed (largest-magnitude entry of each column positive) for determinism.
- ``H``: the normalised Sylvester Hadamard over the whole head_dim;
  ``Hblock``: ``kron(I_{D/G}, H_G)``, a Hadamard inside each quantisation group of G channels.
- ``P``: the bit-reversal permutation matrix, ``(x @ P)[i] = x[bitrev(i)]``.
- A head_dim (or group) that is not a power of two (Phi-3: 96) takes the Sylvester-Paley
  Hadamard ``H_8 (x) Paley_12`` of :func:`calibration.transforms.hadamard_any` and, for P,
  :func:`calibration.transforms.dealing_permutation` (the bit reversal generalised); the
  identities below that name the Sylvester matrix hold for powers of two only. Chosen by the
  proxy over Sylvester blocks (benchmarks/results/calibration_architectures.json, head_dim_96).

A variant name lists the factors in the order they act on a row vector, so
``"U-P-Hblock"`` means ``R = U @ P @ Hblock``: ``x' = ((x @ U) @ P) @ Hblock``.

What changes the INT2 error (quantisation is per token, per group of G consecutive
channels, with the group's own min and range):

- A permutation *after* the last mixing factor only reorders channels. With one group per
  head (G = D; the default layout's key groups are D/4, see oscar_kernels.contract.layout)
  min/max over the group are permutation invariant, so P there changes nothing at all
  (``U-H-P`` == ``U-H`` exactly, up to channel order of the clip).
- Bit reversal commutes with the Sylvester Hadamard: ``P H P = H`` because
  ``popcount(rev(i) & j) == popcount(i & rev(j))``. Hence ``U-P-H`` and ``U-H-P`` are
  the same matrix, and with G = D ``U-H``, ``U-H-P`` and ``U-P-H`` quantise identically.
  With G = D, ``Hblock`` == ``H`` as well, so every Hadamard variant collapses to ``U-H``.
- Only with G < D do the variants differ: ``U-P-Hblock`` first deals the sorted eigen-
  directions round-robin over the groups (group g receives directions of rank
  ``bitrev`` spread over the whole spectrum) and then mixes inside each group, so every
  group has a balanced dynamic range; ``U-Hblock-P`` mixes *consecutive* eigen-directions
  (top-G together) and then scatters the mixed channels over the groups, so each group holds
  channels of very different variance and its range is set by the largest ones.
- Between recipes what matters is the basis fed to the final Hadamard (``U`` vs identity)
  and the clip thresholds, which act per channel in the rotated space.

``P-H-Ut`` is the other reading of the paper's ``R = U H P``: applying R to *column*
vectors (``x' = R x``), i.e. for rows ``x' = x @ R^T = x @ P @ H @ U^T``. It is kept so the
reading can be measured, not because it is expected to help.
"""
from __future__ import annotations

import torch

from .transforms import block_hadamard_matrix, dealing_permutation, hadamard_any, permutation_matrix

VARIANTS = {
    "U-H-P": "R = U @ H @ P (the paper's R = U H P acting on row vectors; H over the head)",
    "U-P-H": "R = U @ P @ H (bit reversal before a whole-head Hadamard)",
    "U-Hblock-P": "R = U @ Hblock @ P (Hadamard per group of consecutive eigen-directions, then bit reversal)",
    "U-P-Hblock": "R = U @ P @ Hblock (bit reversal deals eigen-directions over groups, then Hadamard per group)",
    "U-H": "R = U @ H (no permutation)",
    "U-P": "R = U @ P (no Hadamard; ablation)",
    "U": "R = U (eigenbasis only; ablation)",
    "P-H-Ut": "R = P @ H @ U^T (the paper's product applied to column vectors, R x)",
}


def sorted_eigh(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of symmetric ``c`` [..., D, D] (float64): eigenvalues descending
    [..., D] and eigenvectors as columns [..., D, D], each column's largest-|.| entry > 0."""
    c = c.double()
    c = (c + c.transpose(-1, -2)) / 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # head_dim-sized eigh: on 2 busy cores MKL's threads spin (1 s vs 15 ms per 128 x 128)
    try:
        vals, vecs = torch.linalg.eigh(c)
    finally:
        torch.set_num_threads(threads)
    vals, vecs = vals.flip(-1), vecs.flip(-1)
    pivot = vecs.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(vecs, -2, pivot))
    sign[sign == 0] = 1
    return vals, vecs * sign


def factor(name: str, d: int, group_size: int) -> torch.Tensor:
    if name == "H":
        return hadamard_any(d)
    if name == "Hblock":
        return block_hadamard_matrix(d, group_size)
    if name == "P":
        return permutation_matrix(dealing_permutation(d))
    raise ValueError(f"unknown factor {name!r}")


def compose(u: torch.Tensor, variant: str, group_size: int) -> torch.Tensor:
    """R for ``variant`` from eigenvectors ``u`` [..., D, D] (float64, orthogonal)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (choose from {', '.join(VARIANTS)})")
    d = u.shape[-1]
    r = None
    for name in variant.split("-"):
        if name == "U":
            f = u.double()
        elif name == "Ut":
            f = u.double().transpose(-1, -2)
        else:
            f = factor(name, d, group_size)
        r = f if r is None else r @ f
    return r


def hadamard_rotation(num_heads: int, d: int) -> torch.Tensor:
    """[H, D, D]: R = H for every head (recipe ``hadamard``)."""
    return hadamard_any(d).expand(num_heads, d, d).clone()


def identity_rotation(num_heads: int, d: int) -> torch.Tensor:
    """[H, D, D]: R = I for every head (recipe ``naive``)."""
    return torch.eye(d, dtype=torch.float64).expand(num_heads, d, d).clone()
