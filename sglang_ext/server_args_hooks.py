"""Hooks on sglang's ServerArgs (0.5.17) for --kv-cache-dtype oscar_int2.

- ``add_cli_args`` (staticmethod): adds ``oscar_int2`` to the --kv-cache-dtype choices and,
  on an unpatched install, the --oscar-* options (a patched install has them as fields);
- ``from_cli_args`` (classmethod): unpatched install: exports the --oscar-* values as
  SGLANG_OSCAR_* environment variables (inherited by the scheduler subprocesses), since
  it copies only dataclass fields; refuses --oscar-* without --kv-cache-dtype oscar_int2;
- ``__post_init__``: :func:`refusals.apply_oscar_defaults` before resolution,
  :func:`refusals.check_oscar_server_args` on the resolved fields after it (SGLang's
  Engine loads plugins before building ServerArgs for exactly this kind of hook);
- ``check_server_args``: the same checks again, for ServerArgs built before the plugin
  was loaded (``Engine(server_args=...)``); they are idempotent.

The methods are wrapped in place (marked, so installing twice is a no-op) rather than
through HookRegistry, whose apply step logs and swallows failures: a refusal that failed
to install must not pass silently.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os

from .refusals import apply_oscar_defaults, check_oscar_server_args
from .settings import FLAGS, OSCAR_KV_DTYPE, OscarConfigError

_MARK = "_oscar_hook"
OPTION_GROUP_TITLE = "OSCAR 2-bit KV cache (oscar-sglang)"
_DTYPE_HELP = (f' "{OSCAR_KV_DTYPE}": OSCAR 2-bit KV cache (INT2 history + BF16 sink/recent '
               "tokens; needs --oscar-rotations; oscar-sglang).")


def is_patched(server_args_cls=None) -> bool:
    """True when ServerArgs has the oscar fields (sglang patched by oscar-sglang patch)."""
    if server_args_cls is None:
        from sglang.srt.server_args import ServerArgs as server_args_cls
    names = {f.name for f in dataclasses.fields(server_args_cls)}
    return all(flag.field in names for flag in FLAGS)


def extend_parser(parser: argparse.ArgumentParser) -> None:
    """Add the oscar_int2 choice and any --oscar-* option the parser lacks."""
    actions = parser._option_string_actions
    dtype = actions.get("--kv-cache-dtype")
    if dtype is not None and dtype.choices is not None and OSCAR_KV_DTYPE not in dtype.choices:
        dtype.choices.append(OSCAR_KV_DTYPE)
    if dtype is not None and OSCAR_KV_DTYPE not in (dtype.help or ""):
        dtype.help = (dtype.help or "").rstrip().rstrip(".") + "." + _DTYPE_HELP
    group = None
    for flag in FLAGS:
        if flag.cli in actions:  # patched: a dataclass field; show the current defaults
            actions[flag.cli].help = flag.help
            continue
        if group is None:
            group = parser.add_argument_group(OPTION_GROUP_TITLE)
        group.add_argument(flag.cli, dest=flag.field, type=flag.type, default=None, help=flag.help)


def export_oscar_env(args: argparse.Namespace, fields: set[str]) -> None:
    """Unpatched install: put the given --oscar-* values into SGLANG_OSCAR_* variables."""
    for flag in FLAGS:
        value = getattr(args, flag.field, None)
        if value is not None and flag.field not in fields:
            os.environ[flag.env] = str(value)


def _add_cli_args(original, parser):
    original(parser)
    extend_parser(parser)


def _from_cli_args(original, cls, args):
    given = [f.cli for f in FLAGS if getattr(args, f.field, None) is not None]
    if given and getattr(args, "kv_cache_dtype", None) != OSCAR_KV_DTYPE:
        raise OscarConfigError(f"{given[0]} given but --kv-cache-dtype is "
                               f"{getattr(args, 'kv_cache_dtype', None)!r}; add --kv-cache-dtype {OSCAR_KV_DTYPE}")
    export_oscar_env(args, {f.name for f in dataclasses.fields(cls)})
    return original(cls, args)


def _post_init(original, self):
    apply_oscar_defaults(self)
    original(self)
    check_oscar_server_args(self)


def _check_server_args(original, self):
    original(self)
    check_oscar_server_args(self)


def _wrap(cls, name: str, hook) -> None:
    raw = inspect.getattr_static(cls, name)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    func = raw.__func__ if kind else raw
    if getattr(func, _MARK, False):
        return

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return hook(func, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    setattr(cls, name, kind(wrapper) if kind else wrapper)


def install() -> None:
    """Idempotent: wrap ServerArgs.add_cli_args / from_cli_args / __post_init__ /
    check_server_args (see the module docstring); oscar among the deterministic backends."""
    from sglang.srt.server_args import (DETERMINISTIC_ATTENTION_BACKEND_CHOICES, ServerArgs,
                                        add_deterministic_attention_backend_choices)

    from .settings import OSCAR_ATTENTION_BACKEND

    _wrap(ServerArgs, "add_cli_args", _add_cli_args)
    _wrap(ServerArgs, "from_cli_args", _from_cli_args)
    _wrap(ServerArgs, "__post_init__", _post_init)
    _wrap(ServerArgs, "check_server_args", _check_server_args)
    if OSCAR_ATTENTION_BACKEND not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        # batch-invariant decode and prefill (backend._init_oscar); not among SGLang's radix
        # deterministic backends, so --enable-deterministic-inference turns the radix cache off
        add_deterministic_attention_backend_choices([OSCAR_ATTENTION_BACKEND])


def installed() -> bool:
    from sglang.srt.server_args import ServerArgs

    raw = inspect.getattr_static(ServerArgs, "__post_init__")
    return bool(getattr(raw, _MARK, False))
