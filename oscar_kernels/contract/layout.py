"""The INT2 cache layout: keys' group size, values' group size and scale dtype.

This is the one place where their defaults live (oscar-calibrate, the benchmarks, the
simulator and the server read them here) and where a token's INT2 bytes are counted.
Torch is imported only to map a scale dtype name to its torch dtype, so the byte
arithmetic and a command's --help need none.
"""
from __future__ import annotations

from dataclasses import dataclass

CODES_PER_BYTE = 4  # 2-bit codes
# bytes of one scale or min element; float8_e4m3fn: groups of 64 cost what float16 groups
# of 128 do (72 B per token and KV head at head_dim 128), scale and min round to
# nearest-even on 3 mantissa bits
SCALE_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
SCALE_DTYPES = tuple(SCALE_DTYPE_BYTES)

# The default layout: keys in groups of head_dim/4 (one per plane), values in one group of
# min(128, head_dim), float8_e4m3fn (scale, min): 74 B per token and KV head at head_dim 128.
# The keys carry the accuracy (server passkey at 8k: benchmarks/RESULTS.md).
DEFAULT_SCALE_DTYPE = "float8_e4m3fn"
DEFAULT_MAX_VALUE_GROUP = 128


def packed_dim(head_dim: int) -> int:
    """Bytes per token per head for the codes of one of K or V."""
    if head_dim % CODES_PER_BYTE:
        raise ValueError(f"head_dim {head_dim} is not a multiple of {CODES_PER_BYTE}")
    return head_dim // CODES_PER_BYTE


def group_bytes(head_dim: int, group_size: int, scale_dtype: str) -> int:
    """INT2 bytes per token and head of one of K or V: its codes and a (scale, min) per group."""
    return packed_dim(head_dim) + (head_dim // group_size) * 2 * SCALE_DTYPE_BYTES[scale_dtype]


def _whole_planes(head_dim: int) -> tuple[int, ...]:
    """D/4, D/2, D for a head_dim that is a multiple of 4 but not a power of two (96), else ():
    groups of whole D/4-wide planes of int2's plane-major packing."""
    d = head_dim
    return (d // 4, d // 2, d) if d > 0 and d & (d - 1) and d % CODES_PER_BYTE == 0 else ()


def group_size_problem(head_dim: int, group_size) -> str | None:
    """Why ``group_size`` cannot store ``head_dim`` (a phrase "must be ..."), or None: allowed
    are the powers of two dividing head_dim and, when head_dim is not a power of two, whole planes."""
    g, planes = group_size, _whole_planes(head_dim)
    if isinstance(g, int) and g >= 1 and head_dim % g == 0 and (not g & (g - 1) or g in planes):
        return None
    if planes:
        return (f"must be a power of two dividing head_dim {head_dim}, "
                f"or {planes[0]}, {planes[1]} or {planes[2]} (whole D/4 planes)")
    return f"must be a power of two dividing head_dim {head_dim}"


def check_group_size(head_dim: int, group_size: int) -> None:
    why = group_size_problem(head_dim, group_size)
    if why:
        raise ValueError(f"group size {group_size} {why}")


def check_group_sizes(head_dim: int, key_group_size: int,
                      value_group_size: int | None = None) -> tuple[int, int]:
    """(keys' group, values' group), checked; the values take the keys' size when None."""
    gv = key_group_size if value_group_size is None else value_group_size
    check_group_size(head_dim, key_group_size)
    try:
        check_group_size(head_dim, gv)
    except ValueError as e:
        raise ValueError(f"value {e}") from None
    return key_group_size, gv


def check_scale_dtype(name: str) -> None:
    if name not in SCALE_DTYPE_BYTES:
        raise ValueError(f"unknown scale dtype {name!r} (choose from {', '.join(SCALE_DTYPES)})")


def torch_scale_dtype(name: str):
    """The torch dtype of scale dtype ``name`` (one of SCALE_DTYPES)."""
    import torch

    check_scale_dtype(name)
    return getattr(torch, name)


@dataclass(frozen=True)
class KVLayout:
    """How one token's K and V are stored in INT2: keys in groups of ``key_group_size``
    channels, values in groups of ``value_group_size``, (scale, min) of every group in
    ``scale_dtype`` (a name in SCALE_DTYPES), shared by K and V."""

    key_group_size: int
    value_group_size: int
    scale_dtype: str

    @classmethod
    def resolve(cls, head_dim: int, key_group_size: int | None = None,
                value_group_size: int | None = None, scale_dtype: str | None = None) -> "KVLayout":
        """The default layout (keys head_dim/4, values min(128, head_dim), float8_e4m3fn
        scales) with what is given in place; a key group given without a value group applies
        to both (not checked: see :meth:`check`)."""
        if key_group_size is None:
            key_group_size = max(1, head_dim // CODES_PER_BYTE)
            if value_group_size is None:
                value_group_size = min(DEFAULT_MAX_VALUE_GROUP, head_dim)
        return cls(key_group_size, key_group_size if value_group_size is None else value_group_size,
                   DEFAULT_SCALE_DTYPE if scale_dtype is None else scale_dtype)

    def check(self, head_dim: int) -> "KVLayout":
        """Itself, or ValueError with a one-line reason when it cannot store head_dim."""
        check_group_sizes(head_dim, self.key_group_size, self.value_group_size)
        check_scale_dtype(self.scale_dtype)
        return self

    @property
    def torch_scale_dtype(self):
        return torch_scale_dtype(self.scale_dtype)

    def bytes_per_token_per_head(self, head_dim: int) -> int:
        """INT2 bytes one token costs per KV head for K and V together (codes + scale + min)."""
        self.check(head_dim)
        return (group_bytes(head_dim, self.key_group_size, self.scale_dtype)
                + group_bytes(head_dim, self.value_group_size, self.scale_dtype))
