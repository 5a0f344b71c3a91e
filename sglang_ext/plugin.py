"""The ``sglang.srt.plugins`` entry point ``oscar = sglang_ext.plugin:register``.

SGLang's ``load_plugins()`` runs every installed ``sglang.srt.plugins`` entry point
(all of them unless ``SGLANG_PLUGINS`` names a subset: then it must include ``oscar``)
and then applies the registered hooks. It runs before argument parsing in
``python -m sglang.launch_server`` / ``sglang serve`` / ``sgl.Engine`` and again at the
start of every (spawned) scheduler process, so installing the package is all it takes:
``pip install oscar-sglang`` (or ``pip install -e .`` in a checkout; a checkout that is
only on ``PYTHONPATH`` needs its ``*.egg-info``/``*.dist-info`` there too, see
:func:`write_entry_point_metadata`).

``register()`` (idempotent) calls the serve-config side's
``settings.install_server_args_hooks()`` (flags, refusals), registers the ``oscar``
attention backend, and hooks (SGLang's HookRegistry, AROUND/AFTER):

1. ``kv_cache_dtype.configure_kv_cache_dtype``: ``oscar_int2`` -> (``"oscar_int2"``, bf16);
2. ``DefaultPoolConfigurator._compute_cell_size``: INT2 bytes per token;
3. ``KVCacheConfigurator._profile_available_bytes``: minus the fixed reserve (rings,
   sink store, rotations) and the sink index, so ``max_total_num_tokens`` is what fits;
4. ``KVCacheConfigurator.resolve_max_num_reqs``: at most the request rows reserved;
5. ``KVCacheConfigurator._build_token_to_kv_pool``: builds :class:`OscarKVPool`;
6. ``models.utils.enable_fused_set_kv_buffer``: False for an OscarKVPool (the fused
   RoPE+store kernel would write BF16 into the packed buffers);
7. ``Scheduler.init_deterministic_inference_config``: with --enable-deterministic-inference,
   prompts are chunked at multiples of --chunked-prefill-size only;
8. ``PrefillAdder.add_one_req_ignore_eos`` / ``add_chunked_req``: the same alignment on the
   two chunking paths SGLang leaves unaligned (:mod:`sglang_ext.chunk_alignment`).
Every hook passes through unchanged when the server is not serving ``oscar_int2``.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

OSCAR_BACKEND = "oscar"
_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_registered = False


def create_oscar_backend(runner):
    from .backend import OscarAttnBackend

    return OscarAttnBackend(runner)


def _is_oscar(server_args) -> bool:
    from .settings import is_oscar

    return is_oscar(server_args)


def configure_kv_cache_dtype_hook(original, *args, **kwargs):
    from .settings import OSCAR_KV_DTYPE

    if kwargs.get("server_args_kv_cache_dtype") != OSCAR_KV_DTYPE:
        return original(*args, **kwargs)
    import torch

    model_dtype = kwargs.get("model_dtype")
    if model_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"--kv-cache-dtype {OSCAR_KV_DTYPE} needs a bf16 or fp16 model, "
                         f"got {model_dtype}")
    return OSCAR_KV_DTYPE, torch.bfloat16


def compute_cell_size_hook(original, configurator, kvc, num_layers):
    if not _is_oscar(kvc.server_args):
        return original(configurator, kvc, num_layers)
    from .pool import plan_for_configurator

    return plan_for_configurator(kvc).bytes_per_token


def profile_available_bytes_hook(result, kvc, *args, **kwargs):
    """AFTER: turn SGLang's KV budget into (oscar tokens) x (INT2 bytes per token)."""
    if not _is_oscar(kvc.server_args):
        return None
    from .pool import plan_for_configurator

    plan = plan_for_configurator(kvc)
    tokens = plan.max_total_tokens(result)
    gib = 1 << 30
    if tokens <= 0:
        raise ValueError(
            f"oscar_int2: the KV budget of {result / gib:.2f} GiB cannot hold the fixed reserve "
            f"({plan.fixed_bytes / gib:.2f} GiB: rings for {plan.num_rows} request rows x "
            f"W={plan.recent_window}, {plan.num_sink_slots} sink slots, rotations) plus one page;"
            f" lower --max-running-requests or the recent window, or raise --mem-fraction-static")
    logger.info("oscar_int2 pool plan: budget %.2f GiB, reserve %.2f GiB (rings %.2f, sinks %.2f,"
                " rotations %.3f), %d B/token (INT2 groups: keys %d, values %d; %s scales) -> %d tokens",
                result / gib, plan.fixed_bytes / gib, plan.ring_bytes / gib, plan.sink_store_bytes / gib,
                plan.rotation_bytes / gib, plan.bytes_per_token, plan.group_size, plan.value_group_size,
                plan.scale_dtype, tokens)
    return tokens * plan.bytes_per_token


def resolve_max_num_reqs_hook(result, kvc, *args, **kwargs):
    """AFTER: never more running requests than request rows the rings were reserved for."""
    if not _is_oscar(kvc.server_args):
        return None
    from .pool import plan_for_configurator

    return min(result, plan_for_configurator(kvc).num_rows - 1)


def build_token_to_kv_pool_hook(original, kvc, *args, **kwargs):
    if not _is_oscar(kvc.server_args):
        return original(kvc, *args, **kwargs)
    unsupported = [name for name, on in (
        ("MLA", kvc.use_mla_backend), ("hybrid sliding-window", kvc.is_hybrid_swa),
        ("hybrid Mamba/linear attention", kvc.mambaish_config is not None),
        ("DeepSeek sparse attention", kwargs.get("is_dsa_model") or kwargs.get("is_dsv4_model")),
    ) if on]
    if unsupported:
        raise ValueError(f"--kv-cache-dtype oscar_int2 serves plain MHA/GQA models only, this "
                         f"model uses {unsupported[0]}")
    from .pool import build_pool_for_configurator

    return build_pool_for_configurator(kvc, kwargs["sizes"].max_total_num_tokens,
                                       kwargs["req_to_token_pool"])


def enable_fused_set_kv_buffer_hook(original, *args, **kwargs):
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    from .pool import OscarKVPool

    if isinstance(get_token_to_kv_pool(), OscarKVPool):
        return False
    return original(*args, **kwargs)


def deterministic_truncation_hook(result, scheduler, *args, **kwargs):
    """Scheduler.init_deterministic_inference_config, after: for oscar_int2, cut prompts into
    chunks only at multiples of --chunked-prefill-size (page-aligned), as SGLang does for its
    own backends' split sizes. Inside a chunk attention reads fresh BF16 keys, across chunks
    the cache; with the cut points fixed per request (and the radix cache off, which SGLang
    does for backends without deterministic radix support) no prompt is split differently
    under load."""
    from . import chunk_alignment

    sa = scheduler.server_args
    if not (getattr(sa, "enable_deterministic_inference", False) and _is_oscar(sa)):
        chunk_alignment.set_alignment(None)
        return result
    page = sa.page_size or 1
    chunk = sa.chunked_prefill_size or 0
    aligned = chunk // page * page if chunk > 0 else 0
    scheduler.truncation_align_size = aligned or None  # None: no chunking (or chunks under a page)
    chunk_alignment.set_alignment(scheduler.truncation_align_size)
    return result


def _hooks():
    from sglang.srt.plugins.hook_registry import HookType

    from .chunk_alignment import chunked_req_hook, ignore_eos_hook

    return [
        ("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype",
         configure_kv_cache_dtype_hook, HookType.AROUND),
        ("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
         compute_cell_size_hook, HookType.AROUND),
        (f"{_CONFIGURATOR}._profile_available_bytes", profile_available_bytes_hook, HookType.AFTER),
        (f"{_CONFIGURATOR}.resolve_max_num_reqs", resolve_max_num_reqs_hook, HookType.AFTER),
        (f"{_CONFIGURATOR}._build_token_to_kv_pool", build_token_to_kv_pool_hook, HookType.AROUND),
        ("sglang.srt.models.utils.enable_fused_set_kv_buffer", enable_fused_set_kv_buffer_hook,
         HookType.AROUND),
        ("sglang.srt.managers.scheduler.Scheduler.init_deterministic_inference_config",
         deterministic_truncation_hook, HookType.AFTER),
        (f"{_ADDER}.add_one_req_ignore_eos", ignore_eos_hook, HookType.AROUND),
        (f"{_ADDER}.add_chunked_req", chunked_req_hook, HookType.AROUND),
    ]


def missing_hooks() -> list[str]:
    """Hook targets not (yet) patched in this process. HookRegistry.apply_hooks logs and
    swallows a failed patch, so the backend checks this before serving."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [target for target, _, _ in _hooks() if target not in HookRegistry._patched]


def register() -> None:
    """Entry point: flags, the ``oscar`` backend and the pool hooks (idempotent).

    The hooks take effect when ``HookRegistry.apply_hooks()`` runs, which
    ``load_plugins()`` does right after all plugins registered; code that calls this
    outside ``load_plugins()`` uses :func:`activate`."""
    global _registered
    if _registered:
        return
    from sglang.srt.layers.attention.attention_registry import (ATTENTION_BACKENDS,
                                                                register_attention_backend)
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .settings import install_server_args_hooks

    install_server_args_hooks()
    if OSCAR_BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(OSCAR_BACKEND)(create_oscar_backend)
    if OSCAR_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([OSCAR_BACKEND])
    for target, hook, kind in _hooks():
        HookRegistry.register(target, hook, kind)
    _registered = True


def activate() -> None:
    """register() and apply the hooks now (for callers outside ``load_plugins()``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()


ENTRY_POINT = "oscar = sglang_ext.plugin:register"


def write_entry_point_metadata(site_dir: str, version: str = "0.1.0") -> str:
    """Write a minimal ``oscar_sglang-<version>.dist-info`` declaring the entry point into
    ``site_dir``; with ``site_dir`` (and the checkout) on ``PYTHONPATH`` SGLang's
    ``load_plugins()`` finds the plugin without installing the package. Returns the
    dist-info path."""
    info = os.path.join(site_dir, f"oscar_sglang-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: oscar-sglang\nVersion: {version}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[sglang.srt.plugins]\n{ENTRY_POINT}\n")
    return info
