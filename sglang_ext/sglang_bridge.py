"""The one module of sglang_ext that imports SGLang (0.5.17).

It names every SGLang symbol the extension uses (imported here, re-exported for the other
modules) and every SGLang attribute it hooks (``HOOK_TARGETS``), and installs every hook
through one mechanism, SGLang's plugin ``HookRegistry``, with :func:`install_hooks`.
``HookRegistry.apply_hooks`` logs and skips a target it cannot patch, so
:func:`install_hooks` resolves every target first, when the plugin registers: a symbol
missing from the installed SGLang is one :class:`SglangBridgeError` that names it, and
nothing is half-installed.
"""
from __future__ import annotations

import dataclasses
import pkgutil
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

SGLANG_VERSION = "0.5.17"


class SglangBridgeError(ImportError):
    """The installed SGLang lacks something oscar-sglang uses; the message is one line.
    An ImportError: the bridge's own import raises it, so its class cannot be imported first."""


def installed_sglang_version() -> str:
    try:
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))
    except ImportError:
        return "none"


def _needs(what: str) -> SglangBridgeError:
    return SglangBridgeError(f"needs sglang=={SGLANG_VERSION}, found {installed_sglang_version()}: {what}")


try:
    # KV pool (pool.py)
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    # HiCache host tier (host_pool.py)
    from sglang.srt.mem_cache.pool_host.base import HostKVCache
    from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
    # attention backend (backend.py, plugin.py)
    from sglang.srt.layers.attention.attention_registry import (ATTENTION_BACKENDS,
                                                                register_attention_backend)
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool
    # scheduling (chunk_alignment.py)
    from sglang.srt.managers.schedule_policy import AddReqResult
    # model checks (refusals.py)
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config, mambaish_config
    from sglang.srt.configs.model_config import AttentionArch
    # a speculative draft's config, as SGLang reads it (plugin.draft_kv_geometry)
    from sglang.srt.configs.model_config import ModelConfig
    # server arguments and the launch path (server_args_hooks.py, plugin.py, launcher.py)
    from sglang.launch_server import run_server
    from sglang.srt.server_args import (ATTENTION_BACKEND_CHOICES,
                                        DETERMINISTIC_ATTENTION_BACKEND_CHOICES, ServerArgs,
                                        add_attention_backend_choices,
                                        add_deterministic_attention_backend_choices,
                                        prepare_server_args)
    from sglang.srt.utils import is_blackwell, kill_process_tree
    # the start-up warm-up (warmup.py)
    from sglang.srt.entrypoints.warmup import warmup as _warmup_decorator
    from sglang.srt.managers.io_struct import GenerateReqInput
    # plugin mechanism
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
except ImportError as e:
    raise _needs(str(e)) from None

__all__ = [
    "AddReqResult", "ALLOC_MEMORY_FUNCS", "ATTENTION_BACKEND_CHOICES", "ATTENTION_BACKENDS", "AttentionArch",
    "AttentionBackend", "AttentionType", "DETERMINISTIC_ATTENTION_BACKEND_CHOICES",
    "ForwardMode", "GENERAL_PLUGINS_GROUP", "GenerateReqInput", "GPU_MEMORY_TYPE_KV_CACHE", "HOOK_TARGETS", "Hook",
    "HookType", "HostKVCache", "HybridLinearKVPool", "MHATokenToKVPool", "ModelConfig", "SWAKVPool", "SWA_LAYER_BACKEND", "SGLANG_VERSION", "ServerArgs", "SglangBridgeError",
    "add_attention_backend_choices", "add_deterministic_attention_backend_choices",
    "add_server_args_fields", "apply_hooks", "get_token_to_kv_pool", "install_hooks",
    "hybrid_gdn_config", "is_blackwell", "kill_process_tree", "load_plugins", "mambaish_config", "prepare_server_args", "RadixAttention",
    "register_attention_backend", "register_warmup", "run_server",
]

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"

# The SGLang attention backend (ATTENTION_BACKENDS key) that runs the sliding-window layers of a
# hybrid sliding-window model under oscar_int2, over SGLang's BF16 SWA pool: its Triton backend
# reads SWAKVPool (full->SWA slot translation, window indices) and takes learned sinks
SWA_LAYER_BACKEND = "triton"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

# Every SGLang attribute the plugin hooks, by what the hook is for.
HOOK_TARGETS = {
    "kv_cache_dtype": "sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype",
    "cell_size": "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
    "swa_cell_size": "sglang.srt.model_executor.pool_configurator.HybridSWAPoolConfigurator.__init__",
    "default_cell_size": "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__",
    "kv_budget": f"{_CONFIGURATOR}._profile_available_bytes",
    "max_num_reqs": f"{_CONFIGURATOR}.resolve_max_num_reqs",
    "build_pool": f"{_CONFIGURATOR}._build_token_to_kv_pool",
    "fused_rope_store": "sglang.srt.models.utils.enable_fused_set_kv_buffer",
    "deterministic_chunks": "sglang.srt.managers.scheduler.Scheduler.init_deterministic_inference_config",
    "ignore_eos_chunk": f"{_ADDER}.add_one_req_ignore_eos",
    "chunked_req": f"{_ADDER}.add_chunked_req",
    "cli_args": f"{_SERVER_ARGS}.add_cli_args",
    "server_args_init": f"{_SERVER_ARGS}.__init__",
    "server_args_post_init": f"{_SERVER_ARGS}.__post_init__",
    "check_server_args": f"{_SERVER_ARGS}.check_server_args",
    "model_specific_adjustments": f"{_SERVER_ARGS}._handle_model_specific_adjustments",
    "ngram_args": "sglang.srt.arg_groups.speculative_hook._handle_ngram",
    "host_pool_cls": "sglang.srt.mem_cache.hiradix_cache.get_mha_host_pool_cls",
    "hicache_storage_config": "sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config",
}


@dataclass(frozen=True)
class Hook:
    """One hook: ``fn`` wraps the SGLang attribute ``target`` (a dotted path) as ``kind``
    (HookRegistry's signatures: AROUND ``fn(original, *args)``, AFTER ``fn(result, *args)``)."""

    target: str
    fn: Callable
    kind: HookType


def _resolve_target(target: str) -> None:
    """What HookRegistry._apply_target needs of ``target``: the owner resolves, the
    attribute exists and is not a class (which only REPLACE may hook)."""
    owner_path, _, attr = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_path)
        value = getattr(owner, attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise _needs(f"hook target {target} not found ({type(e).__name__}: {e})") from None
    if isinstance(value, type):
        raise _needs(f"hook target {target} is a class, not a function")


_installed: set[Hook] = set()


def install_hooks(hooks: Sequence[Hook]) -> None:
    """Verify every target, then register every hook with SGLang's HookRegistry (which
    ``load_plugins()`` applies after the plugins ran, or :func:`apply_hooks`). A hook
    installed before is not registered twice."""
    for hook in hooks:
        _resolve_target(hook.target)
    for hook in hooks:
        if hook not in _installed:
            HookRegistry.register(hook.target, hook.fn, hook.kind)
            _installed.add(hook)


def apply_hooks() -> None:
    """Apply the registered hooks now (idempotent: patched targets are skipped)."""
    HookRegistry.apply_hooks()


def register_warmup(name: str, fn: Callable) -> None:
    """Make ``fn(disaggregation_mode, tokenizer_manager)`` (async) the --warmups function
    ``name``: SGLang's warm-up registry, run before the server listens (idempotent)."""
    _warmup_decorator(name)(fn)


def add_server_args_fields(fields: Sequence[tuple[str, type]]) -> None:
    """Make each (name, type) an optional ServerArgs dataclass field, default None (idempotent).

    ``dataclasses.fields(ServerArgs)`` then lists it, so ``from_cli_args`` passes the parsed
    value on and ``asdict``/``replace`` keep it; as an instance attribute it travels with the
    pickled ServerArgs to the scheduler processes. SGLang's generated ``__init__`` predates
    the field: the ``server_args_init`` hook takes the keyword."""
    carrier = dataclasses.make_dataclass(
        "OscarServerArgsFields", [(name, Optional[t], dataclasses.field(default=None)) for name, t in fields])
    own = ServerArgs.__dataclass_fields__
    for f in dataclasses.fields(carrier):
        if f.name not in own:
            own[f.name] = f
            setattr(ServerArgs, f.name, None)
