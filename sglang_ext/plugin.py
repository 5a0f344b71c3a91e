"""The ``sglang.srt.plugins`` entry point ``oscar = sglang_ext.plugin:register``.

SGLang's ``load_plugins()`` runs every installed ``sglang.srt.plugins`` entry point
(all of them unless ``SGLANG_PLUGINS`` names a subset: then it must include ``oscar``)
and then applies the registered hooks. It runs before argument parsing in
``python -m sglang.launch_server`` / ``sglang serve`` / ``sgl.Engine`` and again at the
start of every (spawned) scheduler process, so installing the package is all it takes:
``pip install oscar-sglang`` (or ``pip install -e .`` in a checkout; a checkout that is
only on ``PYTHONPATH`` needs its ``*.egg-info``/``*.dist-info`` there too, see
:func:`write_entry_point_metadata`).

``register()`` (idempotent) adds the --oscar-* ServerArgs fields, registers the ``oscar``
attention backend (also among SGLang's deterministic backends) and the ``--warmups`` function
``oscar_prefix_read`` (:mod:`sglang_ext.warmup`, which the oscar_int2 defaults add), and
installs :func:`hooks` through :mod:`sglang_ext.sglang_bridge` (SGLang's HookRegistry): the KV
dtype and its INT2 bytes per token; the KV budget less the fixed reserve (rings, sink store,
rotations, sink index; with an EAGLE-family draft -- STANDALONE, EAGLE, EAGLE3, NEXTN -- its BF16 KV
beside the INT2 cells) and at
most the reserved request rows; the :class:`OscarKVPool` (the target's only: a draft model's
runner gets SGLang's ordinary pool; for a
Gated DeltaNet hybrid, inside SGLang's hybrid linear pool, over the full-attention layers; for a
hybrid sliding-window model (gpt-oss), inside SGLang's SWAKVPool beside its BF16 SWA pool, the
full-attention layers charged at INT2 bytes in SGLang's HybridSWAPoolConfigurator); SGLang's
gpt-oss backend check told that its sliding layers run on SGLang's Triton backend; no
fused RoPE+store kernel (it would write BF16 into the packed buffers); prompt chunks aligned
under --enable-deterministic-inference (:mod:`sglang_ext.chunk_alignment`); the flags,
defaults and refusals (:mod:`sglang_ext.server_args_hooks`, also SGLang's NGRAM argument handler,
whose refusal of tree drafts on paged backends other than flashinfer the oscar verify does not
need); the INT2 HiCache host tier
(:mod:`sglang_ext.host_pool`). Every hook passes through unchanged when the server is not
serving ``oscar_int2``.
"""
from __future__ import annotations

import logging
import os

from . import chunk_alignment, host_pool, server_args_hooks, warmup
from .settings import FLAGS, OSCAR_ATTENTION_BACKEND, OSCAR_KV_DTYPE, is_oscar
from .sglang_bridge import (ATTENTION_BACKEND_CHOICES, ATTENTION_BACKENDS,
                            DETERMINISTIC_ATTENTION_BACKEND_CHOICES, HOOK_TARGETS, Hook,
                            HookType, add_attention_backend_choices,
                            add_deterministic_attention_backend_choices,
                            add_server_args_fields, apply_hooks, get_token_to_kv_pool,
                            install_hooks, register_attention_backend)

logger = logging.getLogger(__name__)

_registered = False


def create_oscar_backend(runner):
    from .backend import OscarAttnBackend, OscarSWAAttnBackend
    from .pool import OscarSWAKVPool

    if isinstance(runner.token_to_kv_pool, OscarSWAKVPool):
        return OscarSWAAttnBackend.from_model_runner(runner)
    return OscarAttnBackend.from_model_runner(runner)


def configure_kv_cache_dtype_hook(original, *args, **kwargs):
    if kwargs.get("server_args_kv_cache_dtype") != OSCAR_KV_DTYPE:
        return original(*args, **kwargs)
    if kwargs.get("is_draft_worker"):
        # an EAGLE-family draft (STANDALONE, EAGLE, EAGLE3, NEXTN: every draft runner is a
        # TpModelWorker(is_draft_worker=True)) keeps its own KV in SGLang's ordinary pool, in the model's
        # dtype (what --kv-cache-dtype auto gives it): build_token_to_kv_pool_hook's doc says why
        resolved, dtype = original(*args, **{**kwargs, "server_args_kv_cache_dtype": "auto"})
        return resolved or "auto", dtype
    import torch

    model_dtype = kwargs.get("model_dtype")
    if model_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"--kv-cache-dtype {OSCAR_KV_DTYPE} needs a bf16 or fp16 model, "
                         f"got {model_dtype}")
    return OSCAR_KV_DTYPE, torch.bfloat16


def is_draft(kvc) -> bool:
    """The configurator of a speculative draft model's runner (SGLang's ordinary pool)."""
    return bool(getattr(kvc, "is_draft_worker", False))


_DRAFT_GEOMETRY: dict = {}


def draft_kv_geometry(kvc):
    """(KV heads on this attention-TP rank, K head_dim, V head_dim) of the draft model whose
    runner SGLang builds beside this target (--speculative-draft-model-path, read as SGLang reads
    it: ModelConfig.from_server_args(is_draft_model=True), which names a NEXTN draft's MTP
    architecture), or None when there is no draft path or its config cannot be read (the target's
    geometry is then charged, SGLang's own assumption). Once per process and draft."""
    sa = kvc.server_args
    path = getattr(sa, "speculative_draft_model_path", None)
    if path is None:
        return None
    tp = kvc.ps.attn_tp_size
    key = (str(path), getattr(sa, "speculative_draft_model_revision", None), tp)
    if key not in _DRAFT_GEOMETRY:
        try:
            from .sglang_bridge import ModelConfig

            mc = ModelConfig.from_server_args(sa, model_path=key[0], model_revision=key[1], is_draft_model=True)
            _DRAFT_GEOMETRY[key] = (int(mc.get_num_kv_heads(tp)), int(mc.head_dim),
                                    int(getattr(mc, "v_head_dim", None) or mc.head_dim))
        except Exception as e:  # SGLang's own draft runner reports a config it cannot read
            logger.warning("oscar: cannot read the draft model's KV geometry from %s (%s: %s); charging "
                           "its KV at the target's", path, type(e).__name__, e)
            _DRAFT_GEOMETRY[key] = None
    return _DRAFT_GEOMETRY[key]


def draft_kv_bytes_per_token(kvc, plan) -> int:
    """Bytes per token of the target's EAGLE-family draft's own KV pool (STANDALONE, EAGLE,
    EAGLE3, NEXTN: SpeculativeAlgorithm.is_eagle() or is_standalone(), as SGLang's pool
    configurator tests it), which SGLang sizes to the target's token count (kv_cache_configurator:
    the draft runner reuses the target's MemoryPoolConfig): the draft's layers
    (spec_aux_config.eagle_draft_num_layers; num_nextn_predict_layers for an MTP draft) at BF16
    with the draft's own K/V geometry (:func:`draft_kv_geometry`; the target's when unknown,
    SGLang's assumption when it scales the target's cell size for the draft,
    DefaultPoolConfigurator.__init__). 0 without a draft model."""
    algo = getattr(kvc, "spec_algorithm", None)
    if is_draft(kvc) or algo is None or not (algo.is_eagle() or algo.is_standalone()):
        return 0
    from .memory import BF16_BYTES

    layers = int(getattr(getattr(kvc, "spec_aux_config", None), "eagle_draft_num_layers", None) or 0)
    heads, k_dim, v_dim = draft_kv_geometry(kvc) or (plan.num_kv_heads, plan.head_dim, plan.head_dim)
    return layers * heads * (k_dim + v_dim) * BF16_BYTES


def compute_cell_size_hook(original, configurator, kvc, num_layers):
    if not is_oscar(kvc.server_args) or is_draft(kvc):
        return original(configurator, kvc, num_layers)
    from .pool import plan_for_configurator

    return plan_for_configurator(kvc).bytes_per_token


def profile_available_bytes_hook(result, kvc, *args, **kwargs):
    """AFTER: turn SGLang's KV budget into (oscar tokens) x (INT2 bytes per token); for a hybrid
    sliding-window model, the budget less the INT2 reserve (:func:`_hybrid_swa_budget`)."""
    if not is_oscar(kvc.server_args) or is_draft(kvc):
        return None
    from .pool import plan_for_configurator

    plan = plan_for_configurator(kvc)
    if kvc.is_hybrid_swa:
        return _hybrid_swa_budget(result, plan)
    draft = draft_kv_bytes_per_token(kvc, plan)
    tokens = plan.max_total_tokens(result, draft)
    if tokens <= 0:
        raise _reserve_does_not_fit(result, plan)
    gib = 1 << 30
    logger.info("oscar_int2 pool plan: budget %.2f GiB, reserve %.2f GiB (rings %.2f, sinks %.2f,"
                " rotations %.3f), %d B/token (INT2 groups: keys %s, values %d; %s scales)%s -> %d tokens",
                result / gib, plan.fixed_bytes / gib, plan.ring_bytes / gib, plan.sink_store_bytes / gib,
                plan.rotation_bytes / gib, plan.bytes_per_token, key_groups_text(plan.key_group_sizes),
                plan.value_group_size,
                plan.scale_dtype, f" + {draft} B/token of the draft model's BF16 KV" if draft else "", tokens)
    return tokens * (plan.bytes_per_token + draft)  # DefaultPoolConfigurator's cell: default_pool_sizing_hook


def key_groups_text(groups) -> str:
    """'16', or per layer 'per layer: 8 x4, 16 x18, 32 x8' (cache layers' key group sizes)."""
    sizes = sorted(set(groups))
    if len(sizes) == 1:
        return str(sizes[0])
    return "per layer: " + ", ".join(f"{g} x{list(groups).count(g)}" for g in sizes)


def _reserve_does_not_fit(result, plan) -> ValueError:
    """The one-line error of a KV budget too small for the INT2 pool's fixed reserve."""
    gib = 1 << 30
    return ValueError(
        f"oscar_int2: the KV budget of {result / gib:.2f} GiB cannot hold the fixed reserve "
        f"({plan.fixed_bytes / gib:.2f} GiB: rings for {plan.num_rows} request rows x "
        f"W={plan.recent_window}, {plan.num_sink_slots} sink slots, rotations) plus one page;"
        f" lower --max-running-requests or the recent window, or raise --mem-fraction-static")


def _hybrid_swa_budget(result, plan):
    """A hybrid sliding-window model: SGLang's HybridSWAPoolConfigurator splits the budget
    between the full-attention tokens (INT2 bytes, :func:`swa_pool_sizing_hook`) and the SWA
    pool (its BF16 bytes, --swa-full-tokens-ratio of the full tokens): it gets the budget less
    the INT2 pool's fixed reserve and its padding page."""
    from .memory import INDEX_BYTES

    left = result - plan.fixed_bytes - plan.page_size * plan.bytes_per_token - INDEX_BYTES
    if left <= 0:
        raise _reserve_does_not_fit(result, plan)
    gib = 1 << 30
    logger.info("oscar_int2 pool plan (hybrid sliding-window): budget %.2f GiB, INT2 reserve %.2f GiB, "
                "%d B/token over %d full-attention layers; SGLang splits the rest %.2f GiB with its SWA pool",
                result / gib, plan.fixed_bytes / gib, plan.bytes_per_token, plan.num_layers, left / gib)
    return left


def swa_pool_sizing_hook(result, configurator, kvc, *args, **kwargs):
    """HybridSWAPoolConfigurator.__init__, after: the full-attention layers cost INT2 bytes per
    token (codes + scales + the sink index's 4 bytes per page), the SWA layers what SGLang
    charges (BF16 K/V, --swa-full-tokens-ratio of the full tokens); one cell of both, as SGLang
    forms it."""
    if not is_oscar(kvc.server_args) or is_draft(kvc):
        return None
    from .memory import INDEX_BYTES
    from .pool import plan_for_configurator

    c = configurator
    if c._draft_full_layers_num or c._draft_swa_full_layers_num:
        raise ValueError("oscar_int2 does not support draft-model layers (speculative decoding)")
    plan = plan_for_configurator(kvc)
    if plan.num_layers != c._full_layers_num:
        raise ValueError(f"oscar_int2: the INT2 plan holds {plan.num_layers} full-attention layers, "
                         f"SGLang's SWA configurator {c._full_layers_num}")
    c._full_per_token = (plan.bytes_per_token + INDEX_BYTES / plan.page_size) / plan.num_layers
    c._cell_size = (c._full_per_token * c._full_layers_num
                    + c._swa_full_tokens_ratio * c._swa_per_token * c._swa_layers_num)
    return None


def default_pool_sizing_hook(result, configurator, kvc, *args, **kwargs):
    """DefaultPoolConfigurator.__init__, after: the cell is the INT2 bytes per token plus, with an
    EAGLE-family draft model, its BF16 KV (:func:`draft_kv_bytes_per_token`), not SGLang's
    INT2 cell x (1 + draft layers / target layers), which would charge the draft's BF16 layers at
    INT2 bytes (and overrun the budget by the difference)."""
    if not is_oscar(kvc.server_args) or is_draft(kvc) or kvc.is_hybrid_swa:
        return None
    from .pool import plan_for_configurator

    plan = plan_for_configurator(kvc)
    configurator._cell_size = plan.bytes_per_token + draft_kv_bytes_per_token(kvc, plan)
    return None


def resolve_max_num_reqs_hook(result, kvc, *args, **kwargs):
    """AFTER: never more running requests than request rows the rings were reserved for."""
    if not is_oscar(kvc.server_args) or is_draft(kvc):
        return None
    from .pool import plan_for_configurator

    return min(result, plan_for_configurator(kvc).num_rows - 1)


def build_token_to_kv_pool_hook(original, kvc, *args, **kwargs):
    """The oscar pool for the target model; a speculative draft's runner (the EAGLE family)
    gets SGLang's ordinary pool in the model's dtype (configure_kv_cache_dtype_hook), which its
    ordinary attention backend (--speculative-draft-attention-backend, refusals) reads: the draft
    is small, its KV is written at speculative positions by every draft step (no ring/sink
    protocol to commit) and it would need rotations of its own to be INT2."""
    if not is_oscar(kvc.server_args) or is_draft(kvc):
        return original(kvc, *args, **kwargs)
    from .refusals import hybrid_linear_problem, hybrid_swa_problem

    hybrid = kvc.mambaish_config is not None
    unsupported = [name for name, on in (
        ("MLA", kvc.use_mla_backend),
        ("DeepSeek sparse attention", kwargs.get("is_dsa_model") or kwargs.get("is_dsv4_model")),
    ) if on]
    if unsupported:
        raise ValueError(f"--kv-cache-dtype oscar_int2 serves MHA/GQA models, Gated DeltaNet and "
                         f"sliding-window hybrids only, this model uses {unsupported[0]}")
    problem = hybrid_swa_problem(kvc.model_config) if kvc.is_hybrid_swa else \
        hybrid_linear_problem(kvc.model_config) if hybrid else None
    if problem:
        raise ValueError(problem)
    from .pool import (build_hybrid_linear_pool_for_configurator, build_hybrid_swa_pool_for_configurator,
                       build_pool_for_configurator)

    sizes, req_to_token_pool = kwargs["sizes"], kwargs["req_to_token_pool"]
    if kvc.is_hybrid_swa:
        return build_hybrid_swa_pool_for_configurator(kvc, sizes, req_to_token_pool)
    build = build_hybrid_linear_pool_for_configurator if hybrid else build_pool_for_configurator
    return build(kvc, sizes.max_total_num_tokens, req_to_token_pool)


def enable_fused_set_kv_buffer_hook(original, *args, **kwargs):
    from .pool import oscar_pool_of

    if oscar_pool_of(get_token_to_kv_pool()) is not None:
        return False
    return original(*args, **kwargs)


def deterministic_truncation_hook(result, scheduler, *args, **kwargs):
    """Scheduler.init_deterministic_inference_config, after: for oscar_int2, cut prompts into
    chunks only at multiples of --chunked-prefill-size (page-aligned), so no prompt is split
    differently under load (why: sglang_ext.chunk_alignment)."""
    sa = scheduler.server_args
    if not (getattr(sa, "enable_deterministic_inference", False) and is_oscar(sa)):
        chunk_alignment.set_alignment(None)
        return result
    page = sa.page_size or 1
    chunk = sa.chunked_prefill_size or 0
    aligned = chunk // page * page if chunk > 0 else 0
    scheduler.truncation_align_size = aligned or None  # None: no chunking (or chunks under a page)
    chunk_alignment.set_alignment(scheduler.truncation_align_size)
    return result


def hooks() -> list[Hook]:
    """Every hook the plugin installs on SGLang (targets: sglang_bridge.HOOK_TARGETS)."""
    t, around, after = HOOK_TARGETS, HookType.AROUND, HookType.AFTER
    return [
        Hook(t["kv_cache_dtype"], configure_kv_cache_dtype_hook, around),
        Hook(t["cell_size"], compute_cell_size_hook, around),
        Hook(t["swa_cell_size"], swa_pool_sizing_hook, after),
        Hook(t["default_cell_size"], default_pool_sizing_hook, after),
        Hook(t["kv_budget"], profile_available_bytes_hook, after),
        Hook(t["max_num_reqs"], resolve_max_num_reqs_hook, after),
        Hook(t["build_pool"], build_token_to_kv_pool_hook, around),
        Hook(t["fused_rope_store"], enable_fused_set_kv_buffer_hook, around),
        Hook(t["deterministic_chunks"], deterministic_truncation_hook, after),
        Hook(t["ignore_eos_chunk"], chunk_alignment.ignore_eos_hook, around),
        Hook(t["chunked_req"], chunk_alignment.chunked_req_hook, around),
        Hook(t["cli_args"], server_args_hooks.add_cli_args, after),
        Hook(t["server_args_init"], server_args_hooks.init, around),
        Hook(t["server_args_post_init"], server_args_hooks.post_init, around),
        Hook(t["check_server_args"], server_args_hooks.check_server_args, after),
        Hook(t["model_specific_adjustments"], server_args_hooks.model_specific_adjustments, around),
        Hook(t["ngram_args"], server_args_hooks.handle_ngram, around),
        Hook(t["host_pool_cls"], host_pool.get_mha_host_pool_cls_hook, around),
        Hook(t["hicache_storage_config"], host_pool.storage_config_hook, after),
    ]


def register() -> None:
    """Entry point: the oscar ServerArgs fields, the ``oscar`` backend and the hooks
    (idempotent; a hook target missing from the installed SGLang raises SglangBridgeError
    before anything is registered). The hooks take effect when ``load_plugins()`` applies
    them after all plugins registered; outside it, use :func:`activate`."""
    global _registered
    if _registered:
        return
    install_hooks(hooks())
    warmup.register()
    add_server_args_fields([(flag.field, flag.type) for flag in FLAGS])
    if OSCAR_ATTENTION_BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(OSCAR_ATTENTION_BACKEND)(create_oscar_backend)
    if OSCAR_ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([OSCAR_ATTENTION_BACKEND])
    if OSCAR_ATTENTION_BACKEND not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        # batch-invariant decode and prefill (OscarAttnBackend); not among SGLang's radix
        # deterministic backends, so --enable-deterministic-inference turns the radix cache off
        add_deterministic_attention_backend_choices([OSCAR_ATTENTION_BACKEND])
    _registered = True


def activate() -> None:
    """register() and apply the hooks now (for callers outside ``load_plugins()``)."""
    register()
    apply_hooks()


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
