"""Orthogonal building blocks of OSCAR rotations (pure PyTorch, offline only).

Conventions used everywhere in this project:
- vectors are rows; a rotation R [d, d] acts as ``x' = x @ R``;
- every matrix returned here is orthogonal: ``R @ R.T == I``
  (``oscar_kernels.contract.rotations_file.orthogonality_error`` measures it).
"""
from __future__ import annotations

import torch


def _check_power_of_two(n: int, what: str) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix H_n / sqrt(n).

    H_1 = [1];  H_2n = [[H_n, H_n], [H_n, -H_n]].  Symmetric and orthogonal: H @ H = I.
    """
    _check_power_of_two(n, "Hadamard size")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype)


def block_hadamard_matrix(n: int, block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Block-diagonal Hadamard kron(I_{n/block}, H_block): mixes channels only inside
    each aligned block of ``block`` channels (one quantisation group)."""
    _check_power_of_two(block, "Hadamard block")
    if n % block:
        raise ValueError(f"block {block} does not divide {n}")
    eye = torch.eye(n // block, dtype=torch.float64)
    return torch.kron(eye, hadamard_matrix(block)).to(dtype)


def bit_reversal_permutation(n: int) -> torch.Tensor:
    """perm[i] = i with its log2(n) bits reversed (an involution)."""
    _check_power_of_two(n, "bit-reversal size")
    bits = n.bit_length() - 1
    idx = torch.arange(n)
    rev = torch.zeros_like(idx)
    for b in range(bits):
        rev |= ((idx >> b) & 1) << (bits - 1 - b)
    return rev


def permutation_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """P with ``(x @ P)[..., i] == x[..., perm[i]]``, i.e. P[perm[i], i] = 1."""
    n = perm.numel()
    p = torch.zeros(n, n, dtype=dtype)
    p[perm, torch.arange(n)] = 1
    return p
