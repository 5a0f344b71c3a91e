"""Orthogonal building blocks of OSCAR rotations (pure PyTorch, offline only).

Conventions used everywhere in this project:
- vectors are rows; a rotation R [d, d] acts as ``x' = x @ R``;
- every matrix returned here is orthogonal: ``R @ R.T == I``
  (``oscar_kernels.contract.rotations_file.orthogonality_error`` measures it).

Head dims that are not powers of two (Phi-3: 96 = 8 * 12) get a true Hadamard matrix too:
:func:`hadamard_any` is the Kronecker product of a Sylvester factor and a Paley one
(H_96 = H_8 (x) Paley_12, every entry +-1/sqrt(96)), and :func:`dealing_permutation`
generalises the bit reversal.
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


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, int(q**0.5) + 1))


def paley_hadamard(q: int) -> torch.Tensor:
    """Normalised Paley (construction I) Hadamard matrix of order q + 1, q a prime = 3 mod 4.

    With the Jacobsthal matrix Q[i, j] = chi(j - i) (chi the quadratic character mod q,
    chi(0) = 0), S = [[0, 1^T], [-1, Q]] is skew and H = I + S has H H^T = (q + 1) I.
    """
    if not _is_prime(q) or q % 4 != 3:
        raise ValueError(f"Paley construction I needs a prime q = 3 mod 4, got {q}")
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jac = chi[(idx[None, :] - idx[:, None]) % q]  # [q, q]
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jac
    return (torch.eye(q + 1, dtype=torch.float64) + s) / (q + 1) ** 0.5


def hadamard_factors(n: int) -> tuple[int, int | None]:
    """(2^k, q) with n = 2^k * (q + 1) for the smallest Paley order q + 1 (q None: n = 2^k)."""
    if n >= 1 and not n & (n - 1):
        return n, None
    for p in range(4, n + 1, 4):
        if n % p == 0 and not (n // p) & (n // p - 1) and _is_prime(p - 1) and (p - 1) % 4 == 3:
            return n // p, p - 1
    raise ValueError(f"no Hadamard matrix of order {n} is built here "
                     "(orders 2^k and 2^k * (q + 1), q a prime = 3 mod 4)")


def hadamard_any(n: int) -> torch.Tensor:
    """A normalised Hadamard matrix of order n: :func:`hadamard_matrix` for a power of two,
    else kron(H_{2^k}, Paley_{q+1}) (:func:`hadamard_factors`). Orthogonal, |entries| = 1/sqrt(n)."""
    two, q = hadamard_factors(n)
    if q is None:
        return hadamard_matrix(n)
    return torch.kron(hadamard_matrix(two), paley_hadamard(q))


def block_hadamard_matrix(n: int, block: int) -> torch.Tensor:
    """Block-diagonal Hadamard kron(I_{n/block}, H_block): mixes channels only inside
    each aligned block of ``block`` channels (one quantisation group); H_block from
    :func:`hadamard_any` (Sylvester when ``block`` is a power of two)."""
    if block < 1 or n % block:
        raise ValueError(f"block {block} does not divide {n}")
    eye = torch.eye(n // block, dtype=torch.float64)
    return torch.kron(eye, hadamard_any(block))


def bit_reversal_permutation(n: int) -> torch.Tensor:
    """perm[i] = i with its log2(n) bits reversed (an involution)."""
    _check_power_of_two(n, "bit-reversal size")
    bits = n.bit_length() - 1
    idx = torch.arange(n)
    rev = torch.zeros_like(idx)
    for b in range(bits):
        rev |= ((idx >> b) & 1) << (bits - 1 - b)
    return rev


def dealing_permutation(n: int) -> torch.Tensor:
    """The bit reversal generalised to n = 2^k * m (m odd): perm[j] = bitrev_k(j // m) + 2^k (j % m).

    For a power of two it is :func:`bit_reversal_permutation`. Like it, ``x[..., perm]``
    deals ranks round-robin over any 2^s aligned blocks of n / 2^s channels: block b holds
    the ranks r with r = bitrev_s(b) mod 2^s (for 96: 4 key groups of 24, 2 halves of 48).
    """
    if n < 1:
        raise ValueError(f"permutation size must be >= 1, got {n}")
    two = n & -n  # the largest power of two dividing n
    m = n // two
    j = torch.arange(n)
    return bit_reversal_permutation(two)[j // m] + two * (j % m)


def permutation_matrix(perm: torch.Tensor) -> torch.Tensor:
    """P with ``(x @ P)[..., i] == x[..., perm[i]]``, i.e. P[perm[i], i] = 1."""
    n = perm.numel()
    p = torch.zeros(n, n, dtype=torch.float64)
    p[perm, torch.arange(n)] = 1
    return p
