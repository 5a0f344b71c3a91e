"""The OSCAR serving settings: flag names, defaults, and where the runtime reads them.

Two ways the flags reach SGLang 0.5.17:

- **patched sglang** (``oscar-sglang patch --apply``): ``oscar_rotations``,
  ``oscar_sink_tokens``, ``oscar_recent_window``, ``oscar_sink_slots`` and
  ``oscar_extend_prefix`` are first-class
  ``ServerArgs`` fields (so ``sgl.Engine(..., oscar_rotations=...)`` and ``--config`` YAML
  take them) and ``oscar_int2`` is one of the ``--kv-cache-dtype`` choices;
- **plugin only** (unpatched sglang): :func:`install_server_args_hooks` adds the choice and
  the ``--oscar-*`` options to SGLang's parser and exports the parsed values as
  ``SGLANG_OSCAR_*`` environment variables, which the scheduler subprocesses inherit.
  (``sgl.Engine`` on an unpatched install: set the variables yourself.)

:func:`oscar_settings` reads whichever is present (a non-None field wins over the
environment; a missing value takes the default below). This module imports no sglang.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

OSCAR_KV_DTYPE = "oscar_int2"
OSCAR_ATTENTION_BACKEND = "oscar"

# Defaults (one constant each). Sink size: placeholder until the fidelity sweep settles it.
DEFAULT_SINK_TOKENS = 16
DEFAULT_RECENT_WINDOW = 128
# page size used when --kv-cache-dtype oscar_int2 is given without --page-size; sinks live
# on a sequence's first page, so the page must hold at least the sink tokens.
DEFAULT_PAGE_SIZE = 64
# how extend (prefill) reads a cached prefix (oscar_kernels.triton_extend.PREFIX_READS, or
# FlashInfer over the dequantised prefix); "auto": resolve_extend_prefix. FlashInfer by default:
# on the H200 (e2e_qwen3-8b-shape.json, session 5, Qwen3-8B shape) it cut one request's time to
# first token at 32k / 64k / 128k tokens from 4.03 / 16.02 / 72.62 s (int2) to 1.39 / 3.62 /
# 10.76 s and raised 32 x 32k-token throughput from 61.3 to 169.4 output tok/s.
EXTEND_PREFIX_READS = ("auto", "int2", "bf16", "flashinfer")
DEFAULT_EXTEND_PREFIX = "auto"


# the prefix reads whose result for a request does not depend on the rest of the batch: the
# BF16 read falls back to INT2 when the batch's prefixes exceed its scratch, FlashInfer plans
# its KV splits per batch
BATCH_INVARIANT_EXTEND_PREFIX = ("auto", "int2")


def resolve_extend_prefix(choice: str, cuda: bool, flashinfer_imports: bool, deterministic: bool = False) -> str:
    """The prefix read a server runs: ``choice`` unless "auto", which is "int2" under
    --enable-deterministic-inference, else "flashinfer" on CUDA where flashinfer imports, else
    "int2" (the Triton read, no scratch buffer)."""
    if choice != "auto":
        return choice
    return "flashinfer" if cuda and flashinfer_imports and not deterministic else "int2"


@dataclass(frozen=True)
class OscarFlag:
    """One --oscar-* option: ServerArgs field name, environment variable, parser."""

    field: str
    env: str
    type: type
    help: str

    @property
    def cli(self) -> str:
        return "--" + self.field.replace("_", "-")


FLAGS = (
    OscarFlag("oscar_rotations", "SGLANG_OSCAR_ROTATIONS", str,
              "OSCAR rotations file (made by oscar-calibrate); required with "
              f"--kv-cache-dtype {OSCAR_KV_DTYPE}. The INT2 group sizes (keys', values') and scale dtype are read from it."),
    OscarFlag("oscar_sink_tokens", "SGLANG_OSCAR_SINK_TOKENS", int,
              f"OSCAR: first S tokens of every sequence kept in BF16 (default {DEFAULT_SINK_TOKENS}; "
              "must not exceed --page-size)."),
    OscarFlag("oscar_recent_window", "SGLANG_OSCAR_RECENT_WINDOW", int,
              f"OSCAR: last W tokens of every running request kept in BF16 (default {DEFAULT_RECENT_WINDOW})."),
    OscarFlag("oscar_sink_slots", "SGLANG_OSCAR_SINK_SLOTS", int,
              "OSCAR: number of BF16 sink slots (sequences whose sinks are held at once; "
              "default: chosen by the pool)."),
    OscarFlag("oscar_extend_prefix", "SGLANG_OSCAR_EXTEND_PREFIX", str,
              "OSCAR: how prefill reads a cached prefix: int2 (unpacked inside the attention), "
              "bf16 (dequantised once per layer into a scratch buffer of 4 x prefix tokens x "
              "KV heads x head_dim bytes, then our BF16 attention), flashinfer (the same "
              "buffer, FlashInfer's BF16 prefill; CUDA) or auto (default: flashinfer where it "
              "imports on CUDA, else int2; int2 under --enable-deterministic-inference)."),
)
FLAG_BY_FIELD = {f.field: f for f in FLAGS}


class OscarConfigError(ValueError):
    """A serving configuration that OSCAR cannot carry; the message is one line."""


@dataclass(frozen=True)
class OscarSettings:
    rotations_path: str
    sink_tokens: int
    recent_window: int
    sink_slots: int | None
    extend_prefix: str = DEFAULT_EXTEND_PREFIX


def is_oscar(server_args) -> bool:
    """True when the server runs the OSCAR INT2 KV cache."""
    return getattr(server_args, "kv_cache_dtype", None) == OSCAR_KV_DTYPE


def raw_value(server_args, field: str):
    """The value given for one flag: a non-None ServerArgs field, else its environment
    variable (a string), else None."""
    value = getattr(server_args, field, None)
    if value is not None:
        return value
    env = os.environ.get(FLAG_BY_FIELD[field].env)
    return env if env not in (None, "") else None


def _where(server_args, field: str) -> str:
    """How the user gave ``field``: its --flag when set on ServerArgs, else its variable."""
    flag = FLAG_BY_FIELD[field]
    return flag.cli if getattr(server_args, field, None) is not None else flag.env


def _int(server_args, field: str, default: int | None, minimum: int) -> int | None:
    value = raw_value(server_args, field)
    if value is None:
        return default
    where = _where(server_args, field)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise OscarConfigError(f"{where}={value!r} is not an integer") from None
    if isinstance(value, float) and value != n:
        raise OscarConfigError(f"{where}={value!r} is not an integer")
    if n < minimum:
        raise OscarConfigError(f"{where}={n} must be >= {minimum}")
    return n


def _choice(server_args, field: str, default: str, choices: tuple[str, ...]) -> str:
    value = raw_value(server_args, field)
    if value is None:
        return default
    if value not in choices:
        raise OscarConfigError(f"{_where(server_args, field)}={value!r}: choose from {', '.join(choices)}")
    return value


def oscar_settings(server_args) -> OscarSettings:
    """The validated OSCAR settings of ``server_args`` (one-line OscarConfigError on bad input)."""
    if not is_oscar(server_args):
        raise OscarConfigError(
            f"oscar settings requested but --kv-cache-dtype is {getattr(server_args, 'kv_cache_dtype', None)!r}, "
            f"not {OSCAR_KV_DTYPE!r}")
    path = raw_value(server_args, "oscar_rotations")
    if path is None:
        raise OscarConfigError(
            f"--kv-cache-dtype {OSCAR_KV_DTYPE} needs --oscar-rotations FILE "
            "(make one with oscar-calibrate)")
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise OscarConfigError(f"--oscar-rotations {path}: no such file")
    return OscarSettings(
        rotations_path=path,
        sink_tokens=_int(server_args, "oscar_sink_tokens", DEFAULT_SINK_TOKENS, 0),
        recent_window=_int(server_args, "oscar_recent_window", DEFAULT_RECENT_WINDOW, 1),
        sink_slots=_int(server_args, "oscar_sink_slots", None, 1),
        extend_prefix=_choice(server_args, "oscar_extend_prefix", DEFAULT_EXTEND_PREFIX, EXTEND_PREFIX_READS),
    )


def install_server_args_hooks() -> None:
    """Idempotent: the oscar_int2 choice, the --oscar-* options (plugin-only path) and the
    start-up refusals, installed on sglang's ServerArgs (see server_args_hooks)."""
    from .server_args_hooks import install

    install()
