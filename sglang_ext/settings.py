"""The OSCAR serving settings: flag definitions, defaults and the resolved settings.

The --oscar-* flags are ServerArgs fields that the plugin adds (``sgl.Engine(...,
oscar_rotations=...)``, the command line and ``--config`` YAML all set them); they travel
with the ServerArgs object to SGLang's scheduler processes. :func:`oscar_settings` resolves
and validates them once per reader. Plain data: this module imports neither sglang nor
another sglang_ext module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

OSCAR_KV_DTYPE = "oscar_int2"
OSCAR_ATTENTION_BACKEND = "oscar"
WARMUP_NAME = "oscar_prefix_read"  # the --warmups function of sglang_ext.warmup

# Defaults (one constant each).
DEFAULT_SINK_TOKENS = 16
DEFAULT_RECENT_WINDOW = 128
# page size used when --kv-cache-dtype oscar_int2 is given without --page-size; sinks live
# on a sequence's first page, so the page must hold at least the sink tokens.
DEFAULT_PAGE_SIZE = 64
# how prefill reads a cached prefix ("auto": resolve_extend_prefix, FlashInfer where it can:
# the fastest over long cached prefixes, benchmarks/results/e2e_*.json)
EXTEND_PREFIX_READS = ("auto", "int2", "bf16", "flashinfer")
DEFAULT_EXTEND_PREFIX = "auto"


# the prefix reads whose result for a request does not depend on the rest of the batch: the
# BF16 read falls back to INT2 when the batch's prefixes exceed its scratch, FlashInfer plans
# its KV splits per batch
BATCH_INVARIANT_EXTEND_PREFIX = ("auto", "int2")


def resolve_extend_prefix(choice: str, cuda: bool, flashinfer_imports: bool, deterministic: bool = False,
                          key_debias: bool = False) -> str:
    """The prefix read a server runs: ``choice`` unless "auto", which is "int2" under
    --enable-deterministic-inference, else on CUDA "bf16" with the key debias on (FlashInfer's
    prefill has no term for it) and "flashinfer" without it where flashinfer imports, else
    "int2" (the Triton read, no scratch buffer)."""
    if choice != "auto":
        return choice
    if not cuda or deterministic:
        return "int2"
    if key_debias:
        return "bf16"
    return "flashinfer" if flashinfer_imports else "int2"


@dataclass(frozen=True)
class OscarFlag:
    """One --oscar-* option: its ServerArgs field (default None: the oscar default), the
    type its command-line value is parsed as, and its help."""

    field: str
    type: type
    help: str

    @property
    def cli(self) -> str:
        return "--" + self.field.replace("_", "-")


FLAGS = (
    OscarFlag("oscar_rotations", str,
              "OSCAR rotations file (made by oscar-calibrate); required with "
              f"--kv-cache-dtype {OSCAR_KV_DTYPE}. The INT2 group sizes (keys', values') and scale dtype are read from it."),
    OscarFlag("oscar_sink_tokens", int,
              f"OSCAR: first S tokens of every sequence kept in BF16 (default {DEFAULT_SINK_TOKENS}; "
              "must not exceed --page-size)."),
    OscarFlag("oscar_recent_window", int,
              f"OSCAR: last W tokens of every running request kept in BF16 (default {DEFAULT_RECENT_WINDOW})."),
    OscarFlag("oscar_sink_slots", int,
              "OSCAR: number of BF16 sink slots (sequences whose sinks are held at once; "
              "default: chosen by the pool)."),
    OscarFlag("oscar_extend_prefix", str,
              "OSCAR: how prefill reads a cached prefix: int2 (unpacked inside the attention), "
              "bf16 (dequantised once per layer into a scratch buffer of 4 x prefix tokens x "
              "KV heads x head_dim bytes, then our BF16 attention), flashinfer (the same "
              "buffer, FlashInfer's BF16 prefill; CUDA) or auto (default: flashinfer where it "
              "imports on CUDA, else int2; int2 under --enable-deterministic-inference; bf16 on CUDA "
              "with --oscar-key-debias on, which FlashInfer cannot apply)."),
    OscarFlag("oscar_key_debias", str,
              "OSCAR: on or off (default): each INT2 key's logit subtracts half the variance its "
              "rounding adds (from its stored scales), which otherwise weights the INT2 history up "
              "against the exact BF16 sinks and ring: lower perplexity, fewer retrieval (passkey) hits; "
              "on makes auto prefill read bf16 (FlashInfer cannot apply it)."),
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
    key_debias: bool = False


def is_oscar(server_args) -> bool:
    """True when the server runs the OSCAR INT2 KV cache."""
    return getattr(server_args, "kv_cache_dtype", None) == OSCAR_KV_DTYPE


def given_flags(server_args) -> list[str]:
    """The --oscar-* flags set (not None) on ``server_args``."""
    return [f.cli for f in FLAGS if getattr(server_args, f.field, None) is not None]


def _int(server_args, field: str, default: int | None, minimum: int) -> int | None:
    value = getattr(server_args, field, None)
    if value is None:
        return default
    where = FLAG_BY_FIELD[field].cli
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
    value = getattr(server_args, field, None)
    if value is None:
        return default
    if value not in choices:
        raise OscarConfigError(f"{FLAG_BY_FIELD[field].cli}={value!r}: choose from {', '.join(choices)}")
    return value


def oscar_settings(server_args) -> OscarSettings:
    """The validated OSCAR settings of ``server_args`` (one-line OscarConfigError on bad input)."""
    if not is_oscar(server_args):
        raise OscarConfigError(
            f"oscar settings requested but --kv-cache-dtype is {getattr(server_args, 'kv_cache_dtype', None)!r}, "
            f"not {OSCAR_KV_DTYPE!r}")
    path = getattr(server_args, "oscar_rotations", None)
    if path is None:
        raise OscarConfigError(
            f"--kv-cache-dtype {OSCAR_KV_DTYPE} needs --oscar-rotations FILE "
            "(make one with oscar-calibrate)")
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise OscarConfigError(f"--oscar-rotations {path}: no such file")
    key_debias = _choice(server_args, "oscar_key_debias", "off", ("on", "off")) == "on"
    extend_prefix = _choice(server_args, "oscar_extend_prefix", DEFAULT_EXTEND_PREFIX, EXTEND_PREFIX_READS)
    if key_debias and extend_prefix == "flashinfer":
        raise OscarConfigError("--oscar-extend-prefix flashinfer cannot apply --oscar-key-debias on: "
                               "use bf16 (auto picks it) or drop the debias")
    return OscarSettings(
        rotations_path=path,
        sink_tokens=_int(server_args, "oscar_sink_tokens", DEFAULT_SINK_TOKENS, 0),
        recent_window=_int(server_args, "oscar_recent_window", DEFAULT_RECENT_WINDOW, 1),
        sink_slots=_int(server_args, "oscar_sink_slots", None, 1),
        extend_prefix=extend_prefix,
        key_debias=key_debias,
    )
