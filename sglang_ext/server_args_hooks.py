"""The hooks on SGLang's ServerArgs for --kv-cache-dtype oscar_int2 (installed by the plugin).

- ``add_cli_args`` (after): the ``oscar_int2`` --kv-cache-dtype choice and the --oscar-*
  options, which ``from_cli_args`` passes on as the plugin's ServerArgs fields;
- ``__init__`` (around): takes the --oscar-* keywords (``sgl.Engine(..., oscar_rotations=...)``,
  ``from_cli_args``) before SGLang's own ``__init__``, whose ``__post_init__`` reads them;
- ``__post_init__`` (around): :func:`refusals.apply_oscar_defaults` before resolution,
  :func:`refusals.check_oscar_server_args` on the resolved fields after it;
- ``check_server_args`` (after): the same checks again, for a ServerArgs built before the
  plugin was loaded (``Engine(server_args=...)``); they are idempotent;
- ``_handle_model_specific_adjustments`` (around): SGLang asserts that gpt-oss runs on an
  attention backend with learned sinks and sliding windows; under oscar_int2 its sliding layers
  run on SGLang's Triton backend and its full layers on oscar (sinks included), so the check
  sees the Triton backend it names;
- ``_handle_ngram`` (around, ``arg_groups/speculative_hook.py``): SGLang refuses NGRAM's tree
  drafts with --page-size > 1 on every attention backend but flashinfer; under oscar_int2 the
  check runs on a chain and the tree's width is restored after it (:func:`handle_ngram`).
"""
from __future__ import annotations

import argparse

from .refusals import HYBRID_SWA_ARCHITECTURES, apply_oscar_defaults, check_oscar_server_args
from .settings import FLAGS, OSCAR_KV_DTYPE, is_oscar

OPTION_GROUP_TITLE = "OSCAR 2-bit KV cache (oscar-sglang)"
_DTYPE_HELP = (f' "{OSCAR_KV_DTYPE}": OSCAR 2-bit KV cache (INT2 history + BF16 sink/recent '
               "tokens; needs --oscar-rotations; oscar-sglang).")


def extend_parser(parser: argparse.ArgumentParser) -> None:
    """Add the oscar_int2 choice and any --oscar-* option the parser lacks."""
    actions = parser._option_string_actions
    dtype = actions.get("--kv-cache-dtype")
    if dtype is not None and dtype.choices is not None and OSCAR_KV_DTYPE not in dtype.choices:
        dtype.choices.append(OSCAR_KV_DTYPE)
    if dtype is not None and OSCAR_KV_DTYPE not in (dtype.help or ""):
        dtype.help = (dtype.help or "").rstrip().rstrip(".") + "." + _DTYPE_HELP
    missing = [flag for flag in FLAGS if flag.cli not in actions]
    if missing:
        group = parser.add_argument_group(OPTION_GROUP_TITLE)
        for flag in missing:
            group.add_argument(flag.cli, dest=flag.field, type=flag.type, default=None, help=flag.help)


def add_cli_args(result, parser):
    extend_parser(parser)


def init(original, self, *args, **kwargs):
    for flag in FLAGS:
        setattr(self, flag.field, kwargs.pop(flag.field, None))
    original(self, *args, **kwargs)


def post_init(original, self):
    apply_oscar_defaults(self)
    original(self)
    check_oscar_server_args(self)


def check_server_args(result, self):
    check_oscar_server_args(self)


def model_specific_adjustments(original, self):
    if not is_oscar(self) or not _serves_sliding_layers_on_sglang(self):
        return original(self)
    from .sglang_bridge import SWA_LAYER_BACKEND

    object.__setattr__(self, "_resolved_attention_backends", lambda: (SWA_LAYER_BACKEND, SWA_LAYER_BACKEND))
    try:
        return original(self)
    finally:
        object.__delattr__(self, "_resolved_attention_backends")


def _serves_sliding_layers_on_sglang(sa) -> bool:
    if str(getattr(sa, "model_path", "")).lower() in ("", "none", "dummy"):
        return False
    try:
        archs = getattr(sa.get_model_config().hf_config, "architectures", None) or []
    except Exception:  # SGLang's own method reports a config it cannot read
        return False
    return bool(archs) and archs[0] in HYBRID_SWA_ARCHITECTURES


def handle_ngram(original, server_args):
    """SGLang's NGRAM argument handler sets speculative_eagle_topk to
    --speculative-ngram-max-bfs-breadth (the draft tree's width) and refuses a width > 1 with
    --page-size > 1 on every attention backend but flashinfer (arg_groups/speculative_hook.py:736).
    The oscar backend reads each draft's ancestors by their own slots (verify_decode) and the pool
    moves the accepted path's INT2 cells to their final slots before the ring is committed
    (OscarAttnBackend.commit_accepted), so under oscar_int2 the handler runs with width 1 and the
    width is restored after it, with the steps SGLang derives from it
    (num_draft_tokens // width, unless --speculative-num-steps was given)."""
    if not is_oscar(server_args):
        return original(server_args)
    width = server_args.speculative_ngram_max_bfs_breadth
    steps_given = server_args.speculative_num_steps is not None
    server_args.speculative_ngram_max_bfs_breadth = 1
    try:
        original(server_args)
    finally:
        server_args.speculative_ngram_max_bfs_breadth = width
    server_args.speculative_eagle_topk = width
    if not steps_given:
        server_args.speculative_num_steps = server_args.speculative_num_draft_tokens // width
