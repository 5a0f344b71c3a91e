"""Start-up defaults and refusals for ``--kv-cache-dtype oscar_int2`` (SGLang 0.5.17).

Every SGLang feature that cannot carry the hybrid INT2/BF16 pool is refused with one line
that names the flag (OscarConfigError), never run with a silently corrupted cache (the
README's table of refused features says why each one breaks).

:func:`apply_oscar_defaults` runs before ``ServerArgs.__post_init__`` resolves anything;
:func:`check_oscar_server_args` runs on the resolved ServerArgs (after ``__post_init__``
and again in ``check_server_args``). Both only read/write ServerArgs attributes, so they
are testable on CPU with a ServerArgs built without ``__post_init__``.

Speculative decoding (issue 49): NGRAM, and SGLang's EAGLE-family worker with chain drafts
(--speculative-eagle-topk 1) for STANDALONE, EAGLE, EAGLE3 and NEXTN. What SGLang 0.5.17 does
for EAGLE / EAGLE3 / NEXTN beside STANDALONE, on the paths that touch the target's pool and
backend (files under sglang/srt/):

- NEXTN is an alias: arg_groups/speculative_hook.py:52 resolves it (and EAGLE) to EAGLE in
  ``__post_init__`` (to FROZEN_KV_MTP for a Gemma-4 assistant draft, refused here); for the MTP
  architectures (GLM-4.x MoE, DeepSeek-V3, Bailing, ...) it sets --speculative-draft-model-path
  to the target's own folder (:562-577), which configs/model_config.py:577-691 loads as the
  target's MTP layer(s) (Glm4MoeForCausalLMNextN, ..., Qwen3NextForCausalLMMTP). Steps, topk and
  draft tokens default to (3, 1, 4), but to a tree (5, 4, 8) for Llama and Grok targets (:795-825):
  :func:`apply_oscar_defaults` picks the chain when none of the three is given.
- Worker: spec_info.py:256-302 builds EAGLEWorkerV2 for EAGLE/EAGLE3 (V2 always, overlap or
  not; MultiLayerEagleWorkerV2 under --enable-multi-layer-eagle, which overrides.py:682/1385 turn
  on for MiMo-V2 and Step-3.5), StandaloneWorkerV2 (a subclass: standalone_worker_v2.py:138) for
  STANDALONE. Both verify through the one ``run_eagle_verify`` (eagle_worker_v2.py:1495,
  eagle_worker_common.py:461): the same TARGET_VERIFY forward (eagle_utils.py:490, planned in
  the forward when no graph runs), the same ``clear_unaccepted_c128_draft_states`` pool call after
  eagle_sample (eagle_worker_common.py:590) and, for topk > 1 only, a KV move of the tree's
  accepted path after that call (:630): the protocol the oscar backend serves for STANDALONE
  (backend.OscarAttnBackend.commit_chain) serves EAGLE's chains unchanged.
- What differs is the draft and the hidden states: the target's prefill and verify capture
  hidden states (CaptureHiddenMode.FULL, eagle_worker_v2.py:1111, eagle_utils.py:545; NULL for
  STANDALONE), and for EAGLE3 the aux hidden states of the layers its draft names
  (model_executor/model_runner_components/spec_aux_hidden_state.py:81, the model's
  set_eagle3_layers_to_capture): both are taken from the decoder layers' outputs by the model and
  the logits processor, outside the attention backend, so the oscar backend neither sees nor
  changes them (the hidden states are those of the INT2 cache's attention, like the tokens).
  EAGLE/NEXTN drafts share the target's embedding and LM head (eagle_worker_v2.py:272-310:
  weights, no KV); a NextN layer is a decoder layer of its own (layer_id 0 of the draft,
  models/glm4_moe_nextn.py:69).
- The draft runner is a TpModelWorker(is_draft_worker=True) in both workers, so the plugin's
  hooks give it SGLang's ordinary pool in the model's dtype (plugin.configure_kv_cache_dtype_hook,
  build_token_to_kv_pool_hook), sized to the target's token count and charged to the target's
  budget at BF16 (plugin.draft_kv_bytes_per_token: SpeculativeAlgorithm.is_eagle() covers EAGLE
  and EAGLE3; the layers are spec_aux_config.eagle_draft_num_layers, num_nextn_predict_layers for
  an MTP draft, spec_aux_hidden_state.py:71; the K/V geometry the draft's own config's, which an
  EAGLE3 draft need not share with the target, plugin.draft_kv_geometry). Its attention backends
  come from --speculative-draft-attention-backend (speculative/draft_utils.py:43, as for STANDALONE). The
  draft prefill and the draft extend after each verify (DRAFT_EXTEND_V2,
  eagle_worker_common.py:176) run on the draft runner over the verify's slots in the draft's own
  pool: the target's pool is not touched.
- Refused: trees (topk > 1, as for STANDALONE), --speculative-adaptive (EAGLEWorkerV2 builds one
  target attention backend per step count, eagle_worker_v2.py:1321, each of which would stage
  its own verify while the pool commits through one), --enable-multi-layer-eagle (a draft worker
  with one runner per MTP layer, not checked here; its MiMo-V2 / Step-3.5 targets are
  sliding-window hybrids, configs/model_config.py:1993-2003, whose speculation is refused) and
  speculation on hybrid models (a Qwen3-Next / Qwen3.5 MTP draft included).
"""
from __future__ import annotations

import logging
import os

from .settings import (
    BATCH_INVARIANT_EXTEND_PREFIX,
    DEFAULT_PAGE_SIZE,
    OSCAR_ATTENTION_BACKEND,
    OSCAR_KV_DTYPE,
    OscarConfigError,
    WARMUP_NAME,
    given_flags,
    is_oscar,
    oscar_settings,
)

logger = logging.getLogger(__name__)

# CUDA-graph backends the oscar attention backend supports, per phase. Prefill graphs
# (tc_piecewise custom-op capture, breakable, full) are off in v1.
PREFILL_GRAPH_BACKENDS = ("disabled",)
DECODE_GRAPH_BACKENDS = ("full", "disabled")
# Under speculative decoding SGLang's decode graph runner captures the TARGET_VERIFY forward
# instead of decode (runner/decode_cuda_graph_runner.py:278), and HybridAttention.plan_verify
# allocates (the verify's virtual decode batch): decode graphs are off with NGRAM.
SPECULATIVE_DECODE_GRAPH_BACKENDS = ("disabled",)

# --speculative-algorithm values served with oscar_int2 (issue 49; module doc): NGRAM (no draft
# model; its verify is HybridAttention.plan_verify / verify, its acceptance the pool's move_kv_cache)
# and SGLang's EAGLE-family worker with chain drafts (DRAFT_MODEL_ALGORITHMS: a draft model of its
# own, EAGLE/EAGLE3 drafts fed the target's hidden states, NEXTN the target's MTP layers, which
# SGLang resolves to EAGLE): the same verify, the acceptance the pool's
# clear_unaccepted_c128_draft_states, the one pool call of that worker after a chain verify. The
# draft keeps its KV in SGLang's ordinary pool in the model's dtype behind an ordinary backend
# (DRAFT_ATTENTION_BACKEND unless --speculative-draft-attention-backend names another): it is
# small, and INT2 would need rotations calibrated for it.
DRAFT_MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3", "NEXTN")
SPECULATIVE_ALGORITHMS = ("NGRAM",) + DRAFT_MODEL_ALGORITHMS
# SGLang's own defaults for a chain (arg_groups/speculative_hook.py:_auto_choose_speculative_params):
# --speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens
CHAIN_DEFAULTS = (3, 1, 4)
# Triton: built wherever the oscar kernels run (no flashinfer needed); flashinfer or fa3 may be named.
DRAFT_ATTENTION_BACKEND = "triton"
_OTHER_ALGORITHM_WHY = (
    "oscar_int2 serves NGRAM and the EAGLE-family chain drafts (STANDALONE, EAGLE, EAGLE3, NEXTN); the "
    "other draft workers (DFLASH, DSPARK, FROZEN_KV_MTP) are not wired to the 2-bit verify and commit or "
    "checked against it yet")

_TRUE = ("1", "true", "yes", "on")

# (field, refused-when, flag as the user typed it, why). Checked in this order.
_FLAG_RULES = (
    ("enable_lmcache", bool, "--enable-lmcache", "LMCache assumes a uniform KV layout"),
    ("enable_flexkv", bool, "--enable-flexkv", "FlexKV assumes a uniform KV layout"),
    ("disaggregation_mode", lambda v: v not in (None, "null"), "--disaggregation-mode",
     "PD disaggregation transfers only k/v buffers (the BF16 ring cannot be transferred)"),
    ("disaggregation_decode_enable_offload_kvcache", bool,
     "--disaggregation-decode-enable-offload-kvcache", "KV offload copies only k/v buffers"),
    ("enable_page_major_kv_layout", bool, "--enable-page-major-kv-layout",
     "the page-major layout assumes one uniform KV itemsize"),
    ("enable_unified_memory", bool, "--enable-unified-memory",
     "the unified memory pool assumes one uniform KV itemsize"),
    ("enable_hisparse", bool, "--enable-hisparse", "HiSparse uses its own host KV layout"),
    ("dcp_size", lambda v: (v or 1) > 1, "--dcp-size", "decode context parallelism is not supported"),
    ("enable_prefill_cp", bool, "--enable-prefill-cp", "prefill context parallelism is not supported"),
    ("attn_cp_size", lambda v: (v or 1) > 1, "--attn-cp-size",
     "attention context parallelism is not supported"),
    ("enable_two_batch_overlap", bool, "--enable-two-batch-overlap", "two-batch overlap is not supported"),
    ("enable_pdmux", bool, "--enable-pdmux", "PD multiplexing is not supported"),
    ("dllm_algorithm", lambda v: v is not None, "--dllm-algorithm", "diffusion LLM inference is not supported"),
    ("prefill_only_disable_kv_cache", bool, "--prefill-only-disable-kv-cache",
     "it replaces the KV pool with a no-op pool"),
    ("kv_canary", lambda v: v not in (None, "none"), "--kv-canary",
     "the KV canary attaches only to SGLang's own pool types"),
)

_ENV_RULES = (
    ("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING",
     "post-capture KV sizing resizes the pool after graph capture, which the hybrid pool cannot follow"),
    ("SGLANG_USE_HND_KVCACHE", "the HND layout assumes one uniform KV layout"),
)


def _refuse(flag: str, why: str) -> OscarConfigError:
    return OscarConfigError(f"{flag} is not supported with --kv-cache-dtype {OSCAR_KV_DTYPE}: {why}")


# ---------------------------------------------------------------------------- defaults


def apply_oscar_defaults(server_args) -> None:
    """Before resolution: pick the oscar attention backend, a page size that holds the
    sinks, no prefill CUDA graph and the oscar_prefix_read warm-up, unless the user chose otherwise (an explicit
    non-oscar attention backend is refused here, before SGLang resolves anything)."""
    check_stray_oscar_flags(server_args)
    if not is_oscar(server_args):
        return
    oscar_settings(server_args)  # fail fast on a missing rotations file / bad integers
    _check_flags(server_args)  # before SGLang's own checks can fail with another message
    _check_attention_backends(server_args)
    if server_args.attention_backend is None:
        server_args.attention_backend = OSCAR_ATTENTION_BACKEND
        logger.info("oscar: --kv-cache-dtype %s uses --attention-backend %s",
                    OSCAR_KV_DTYPE, OSCAR_ATTENTION_BACKEND)
    if server_args.page_size is None:
        server_args.page_size = DEFAULT_PAGE_SIZE
        logger.info("oscar: --page-size not given, using %d", DEFAULT_PAGE_SIZE)
    # lowest-precedence switch: --cuda-graph-backend-prefill / --cuda-graph-config still win
    # (and are checked after resolution)
    server_args.disable_prefill_cuda_graph = True
    if speculative_algorithm(server_args) is not None:  # SPECULATIVE_DECODE_GRAPH_BACKENDS says why
        # SGLang's draft worker captures its own graphs under the same decode switch: off too
        server_args.disable_decode_cuda_graph = True
        logger.info("oscar: --speculative-algorithm %s runs its verify without CUDA graphs "
                    "(HybridAttention.plan_verify allocates)", speculative_algorithm(server_args))
    if speculative_algorithm(server_args) in DRAFT_MODEL_ALGORITHMS:
        _apply_draft_defaults(server_args)
    warmups = [w for w in (server_args.warmups or "").split(",") if w]
    if WARMUP_NAME not in warmups and not server_args.skip_server_warmup:  # sglang_ext.warmup
        server_args.warmups = ",".join(warmups + [WARMUP_NAME])


def _apply_draft_defaults(sa) -> None:
    """An EAGLE-family algorithm: the draft on DRAFT_ATTENTION_BACKEND unless named, and chain
    drafts (CHAIN_DEFAULTS) when no step, width or draft count is given (SGLang would pick a tree
    for Llama and Grok targets, which the refusals then refuse)."""
    algo = speculative_algorithm(sa)
    if getattr(sa, "speculative_draft_attention_backend", None) is None:
        sa.speculative_draft_attention_backend = DRAFT_ATTENTION_BACKEND
        logger.info("oscar: the %s draft keeps its KV in SGLang's ordinary pool, read by "
                    "--speculative-draft-attention-backend %s", algo, DRAFT_ATTENTION_BACKEND)
    fields = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    if not getattr(sa, "speculative_adaptive", False) and all(getattr(sa, f, None) is None for f in fields):
        for f, v in zip(fields, CHAIN_DEFAULTS):
            setattr(sa, f, v)
        logger.info("oscar: --speculative-algorithm %s drafts chains (--speculative-num-steps %d "
                    "--speculative-eagle-topk %d --speculative-num-draft-tokens %d)", algo, *CHAIN_DEFAULTS)


# ---------------------------------------------------------------------------- checks


def _check_flags(sa) -> None:
    for field, refused, flag, why in _FLAG_RULES:
        if refused(getattr(sa, field, None)):
            raise _refuse(flag, why)
    _check_speculative(sa)
    _check_hicache(sa)
    for env, why in _ENV_RULES:
        if os.environ.get(env, "").strip().lower() in _TRUE:
            raise _refuse(f"{env}=1", why)


def speculative_algorithm(sa) -> str | None:
    """--speculative-algorithm as SGLang resolves it (upper case), or None."""
    algo = getattr(sa, "speculative_algorithm", None)
    return None if algo is None else str(algo).upper()


def _check_speculative(sa) -> None:
    """NGRAM and the EAGLE-family algorithms are served (SPECULATIVE_ALGORITHMS); every other
    algorithm is refused in one line (_OTHER_ALGORITHM_WHY), and so is a draft-model path without
    an EAGLE-family algorithm. Under the EAGLE family (module doc): chain drafts only (SGLang
    moves a tree's accepted path through the target's pool after the acceptance call that commits
    a chain; SGLang resolves the width after __post_init__, so it is checked whenever set), a
    draft attention backend that reads SGLang's ordinary pool (not oscar), no adaptive steps and
    no multi-layer EAGLE worker."""
    algo = speculative_algorithm(sa)
    if algo is not None and algo not in SPECULATIVE_ALGORITHMS:
        raise _refuse(f"--speculative-algorithm {algo}", _OTHER_ALGORITHM_WHY)
    if getattr(sa, "speculative_draft_model_path", None) is not None and algo not in DRAFT_MODEL_ALGORITHMS:
        raise _refuse(f"--speculative-draft-model-path with --speculative-algorithm {algo}",
                      f"a draft model is served with --speculative-algorithm {', '.join(DRAFT_MODEL_ALGORITHMS)}")
    if algo not in DRAFT_MODEL_ALGORITHMS:
        return
    topk = getattr(sa, "speculative_eagle_topk", None)
    if topk is not None and topk > 1:
        raise _refuse(f"--speculative-eagle-topk {topk} with {algo}",
                      "tree drafts of a draft model are not served (SGLang 0.5.17 moves their accepted "
                      "path after the acceptance call that commits a chain); use --speculative-eagle-topk 1")
    if getattr(sa, "speculative_draft_attention_backend", None) == OSCAR_ATTENTION_BACKEND:
        raise _refuse(f"--speculative-draft-attention-backend {OSCAR_ATTENTION_BACKEND}",
                      "the draft model's KV is SGLang's ordinary pool, read by an ordinary backend "
                      f"(default {DRAFT_ATTENTION_BACKEND}; flashinfer or fa3 also work)")
    if getattr(sa, "speculative_adaptive", False) and algo != "STANDALONE":  # SGLang drops it for STANDALONE
        raise _refuse(f"--speculative-adaptive with {algo}",
                      "SGLang 0.5.17 builds one target attention backend per step count, each of which "
                      "would stage its own verify while the pool commits through one")
    if getattr(sa, "enable_multi_layer_eagle", False):
        raise _refuse(f"--enable-multi-layer-eagle with {algo}",
                      "the multi-layer EAGLE worker (one draft runner per MTP layer) is not checked with "
                      "the 2-bit verify and commit")


def _check_hicache(sa) -> None:
    """HiCache (--enable-hierarchical-cache, a storage tier): served by the INT2 host tier
    (sglang_ext.host_pool) for the io backend, layouts and storage it carries; the rest is
    refused in one line (host_pool.hicache_refusal says why)."""
    if not (getattr(sa, "enable_hierarchical_cache", False)
            or getattr(sa, "hicache_storage_backend", None) is not None):
        return
    from .host_pool import hicache_refusal  # imports SGLang (through the bridge)

    why = hicache_refusal(sa)
    if why:
        raise OscarConfigError(why)


def _check_attention_backends(sa) -> None:
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        value = getattr(sa, field, None)
        if value not in (None, OSCAR_ATTENTION_BACKEND):
            raise _refuse(f"--{field.replace('_', '-')} {value}",
                          f"it needs --attention-backend {OSCAR_ATTENTION_BACKEND} (the default for it)")


def _phase_backend(sa, phase: str):
    """Resolved CUDA-graph backend of one phase (CudaGraphConfig after __post_init__,
    else the per-phase flag / disable switch)."""
    cfg = getattr(sa, "cuda_graph_config", None)
    resolved = getattr(getattr(cfg, phase, None), "backend", None)
    if resolved is not None:
        return resolved, f"--cuda-graph-backend-{phase}"
    if isinstance(cfg, dict) and isinstance(cfg.get(phase), dict) and cfg[phase].get("backend"):
        return cfg[phase]["backend"], "--cuda-graph-config"
    explicit = getattr(sa, f"cuda_graph_backend_{phase}", None)
    if explicit is not None:
        return explicit, f"--cuda-graph-backend-{phase}"
    if getattr(sa, f"disable_{phase}_cuda_graph", False) or getattr(sa, "disable_cuda_graph", False):
        return "disabled", f"--disable-{phase}-cuda-graph"
    return None, ""


def _check_cuda_graphs(sa) -> None:
    spec = speculative_algorithm(sa) is not None
    decode = SPECULATIVE_DECODE_GRAPH_BACKENDS if spec else DECODE_GRAPH_BACKENDS
    for phase, allowed in (("prefill", PREFILL_GRAPH_BACKENDS), ("decode", decode)):
        backend, flag = _phase_backend(sa, phase)
        if backend is not None and backend not in allowed:
            extra = (" under --speculative-algorithm, whose decode graph is the verify (a verify plan "
                     "allocates, not capturable yet)") if spec and phase == "decode" else ""
            raise _refuse(f"{flag} {backend}", f"use {' or '.join(allowed)} "
                          f"(--cuda-graph-backend-{phase} or --cuda-graph-config){extra}")


def _check_page_size(sa, settings) -> None:
    page = getattr(sa, "page_size", None) or 1
    if settings.sink_tokens > page:
        # the default page size, or the next power of two that holds the sinks
        fits = max(DEFAULT_PAGE_SIZE, 1 << (settings.sink_tokens - 1).bit_length())
        raise OscarConfigError(
            f"--oscar-sink-tokens {settings.sink_tokens} exceeds --page-size {page}: "
            f"--kv-cache-dtype {OSCAR_KV_DTYPE} keeps the sinks on a sequence's first page "
            f"(use --page-size {fits}, or --oscar-sink-tokens {page} or fewer)")


def _check_deterministic(sa, settings) -> None:
    """--enable-deterministic-inference needs a prefix read that is batch-invariant, and no
    mixed batches: a request decoded inside a prefill batch goes through the extend kernel
    (its last token read fresh, a window one token longer), whose numbers differ from the
    decode step it takes when no prompt is being prefilled."""
    if not getattr(sa, "enable_deterministic_inference", False):
        return
    if settings.extend_prefix not in BATCH_INVARIANT_EXTEND_PREFIX:
        raise OscarConfigError(
            f"--oscar-extend-prefix {settings.extend_prefix} is not batch-invariant: with "
            "--enable-deterministic-inference use int2 (what auto picks then)")
    if getattr(sa, "enable_mixed_chunk", False):
        raise _refuse("--enable-mixed-chunk with --enable-deterministic-inference",
                      "a request decoded inside a prefill batch would give other numbers than its "
                      "own decode step (drop --enable-mixed-chunk)")


def _model_config(sa):
    if str(getattr(sa, "model_path", "")).lower() in ("", "none", "dummy"):
        return None
    return sa.get_model_config()


# Gated DeltaNet hybrids served with their full-attention layers in the INT2 pool (the
# architectures SGLang 0.5.17 builds through HybridLinearKVPool + HybridLinearAttnBackend with
# GDNAttnBackend; other hybrid_gdn_config models, e.g. JetNemotron and Intern-S2, are not checked)
HYBRID_LINEAR_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
                               "Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForCausalLM",
                               "Qwen3_5MoeForCausalLM")


def _sglang_version() -> str:
    from .sglang_bridge import SGLANG_VERSION

    return SGLANG_VERSION


def _architecture(model_config) -> str:
    return (getattr(model_config.hf_config, "architectures", None) or ["unknown"])[0]


def hybrid_linear_problem(model_config) -> str | None:
    """Why --kv-cache-dtype oscar_int2 cannot serve this hybrid Mamba / linear-attention
    model (one line), or None: Gated DeltaNet hybrids of HYBRID_LINEAR_ARCHITECTURES whose
    full-attention layers SGLang can name are served (the Mamba state stays SGLang's)."""
    from .sglang_bridge import SGLANG_VERSION, hybrid_gdn_config, mambaish_config

    hybrid = mambaish_config(model_config)
    if hybrid is None:
        return None
    arch = _architecture(model_config)
    if hybrid_gdn_config(model_config) is None or arch not in HYBRID_LINEAR_ARCHITECTURES:
        return (f"--kv-cache-dtype {OSCAR_KV_DTYPE} does not support the hybrid Mamba/linear-attention "
                f"model {arch}: of the hybrids it serves Gated DeltaNet ones only "
                f"({', '.join(HYBRID_LINEAR_ARCHITECTURES)})")
    try:
        ids = list(hybrid.full_attention_layer_ids)
    except AttributeError as e:  # e.g. a Qwen3-Next config.json without full_attention_interval
        return (f"--kv-cache-dtype {OSCAR_KV_DTYPE}: SGLang {SGLANG_VERSION} cannot read the "
                f"full-attention layers of {arch} from its config ({e})")
    if not ids:
        return f"--kv-cache-dtype {OSCAR_KV_DTYPE}: {arch} has no full-attention layer to cache"
    return None


# Hybrid sliding-window models served with their full-attention layers in the INT2 pool and their
# sliding-window layers in SGLang's BF16 SWA pool, run by SGLang's Triton backend (the architectures
# whose SGLang 0.5.17 path -- SWAKVPool, its Triton backend with sinks -- is checked here)
HYBRID_SWA_ARCHITECTURES = ("GptOssForCausalLM",)


def hybrid_swa_problem(model_config) -> str | None:
    """Why --kv-cache-dtype oscar_int2 cannot serve this model that SGLang runs with its hybrid
    sliding-window memory (one line), or None (HYBRID_SWA_ARCHITECTURES with full-attention
    layers and one head geometry for both kinds of layer)."""
    if not getattr(model_config, "is_hybrid_swa", False):
        return None
    arch = _architecture(model_config)
    if arch not in HYBRID_SWA_ARCHITECTURES:
        return (f"--kv-cache-dtype {OSCAR_KV_DTYPE} does not support the hybrid sliding-window model {arch}: "
                f"of those it serves {', '.join(HYBRID_SWA_ARCHITECTURES)} only")
    if getattr(model_config, "is_hybrid_swa_compress", False):
        return (f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve {arch}: its sliding-window layers have "
                "their own head geometry (SGLang's compressed SWA pool)")
    if not list(getattr(model_config, "full_attention_layer_ids", None) or []):
        return f"--kv-cache-dtype {OSCAR_KV_DTYPE}: {arch} has no full-attention layer to cache"
    return None


def _served_full_layers(model_config) -> tuple[int, ...]:
    """The full-attention layers SGLang runs: its hybrid sliding-window layer split, or its
    hybrid Mamba/linear config's."""
    from .sglang_bridge import mambaish_config

    if getattr(model_config, "is_hybrid_swa", False):
        return tuple(model_config.full_attention_layer_ids)
    return tuple(mambaish_config(model_config).full_attention_layer_ids)


def _check_hybrid_layers(model_config, shape, arch: str) -> None:
    """The full-attention layers SGLang serves (its hybrid config) are the ones the model
    config names (ModelShape.attention_layers, which the rotations file must cover)."""
    from .sglang_bridge import SGLANG_VERSION

    served = _served_full_layers(model_config)
    if served != tuple(shape.attention_layers):
        from oscar_kernels.contract.model_shape import format_layers

        raise OscarConfigError(
            f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve {arch}: SGLang {SGLANG_VERSION} runs full "
            f"attention at layers {format_layers(served)} but the config's layer pattern names "
            f"{format_layers(shape.attention_layers)} (its layer_types and full_attention_interval disagree)")


def _check_hybrid_features(sa, arch: str, sliding: bool = False) -> None:
    """Features SGLang 0.5.17 cannot combine with an OscarKVPool inside its hybrid linear pool
    (``sliding``: its hybrid sliding-window pool)."""
    from .sglang_bridge import is_blackwell

    algo = speculative_algorithm(sa)
    if algo is not None:
        raise _refuse(f"--speculative-algorithm {algo} on {arch}",
                      "speculative decoding is served on full-attention models only (the hybrid's "
                      f"{'sliding-window' if sliding else 'Gated DeltaNet'} layers verify outside the "
                      "oscar backend, untested with its verify and commit)")
    if not sliding and getattr(sa, "device", None) in (None, "cuda") and is_blackwell():
        # attention_registry.attn_backend_wrapper asserts this for hybrid GDN models on Blackwell
        raise OscarConfigError(f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve {arch} on this Blackwell GPU: "
                               f"SGLang {_sglang_version()} runs Gated DeltaNet hybrids there with the "
                               "triton, trtllm_mha, fa4 or flashinfer attention backends only, not oscar")
    if getattr(sa, "enable_hierarchical_cache", False) or getattr(sa, "hicache_storage_backend", None):
        raise _refuse("--enable-hierarchical-cache" if getattr(sa, "enable_hierarchical_cache", False)
                      else "--hicache-storage-backend",
                      f"the INT2 host tier carries plain MHA pools, and SGLang's hybrid host pool for "
                      f"{arch} copies the full-attention KV as one uniform layout")


def _check_sliding_layers_pooled(sa, shape, arch: str) -> None:
    """A model with sliding-window (or other non-full) layers that SGLang runs without a hybrid
    pool keeps every layer in the one token pool: under oscar_int2 that pool is INT2 with no
    attention window, so refuse in one line."""
    from oscar_kernels.contract.model_shape import format_layers

    others = [l for l in range(shape.num_layers) if l not in set(shape.attention_layers)]
    if getattr(sa, "disable_hybrid_swa_memory", False) and arch in HYBRID_SWA_ARCHITECTURES:
        why = "--disable-hybrid-swa-memory puts them in the one full-size KV pool (drop it)"
    else:
        why = (f"SGLang {_sglang_version()} runs {arch} without its hybrid sliding-window memory, so they "
               "would share the one full-size KV pool")
    raise OscarConfigError(f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve {arch}: its sliding-window layers "
                           f"{format_layers(others)} need SGLang's BF16 SWA pool, but {why}, which would "
                           "be INT2 with no attention window")


def _check_model(sa, settings) -> None:
    """Refuse MLA, hybrid sliding-window models other than gpt-oss (and sliding-window models
    SGLang runs without its SWA pool, e.g. Gemma-3), hybrid Mamba / linear-attention models other
    than Gated DeltaNet ones, and attention geometries the kernels cannot serve; check the rotations file
    against the model's attention shape and layer pattern and the tensor-parallel split."""
    model_config = _model_config(sa)
    if model_config is None:
        return
    from .sglang_bridge import AttentionArch, mambaish_config

    arch = _architecture(model_config)
    if model_config.attention_arch == AttentionArch.MLA:
        raise OscarConfigError(f"--kv-cache-dtype {OSCAR_KV_DTYPE} serves MHA/GQA models only; "
                               f"{arch} uses MLA")
    sliding = bool(getattr(model_config, "is_hybrid_swa", False))
    if sliding:
        problem = hybrid_swa_problem(model_config)
        if problem:
            raise OscarConfigError(problem)
        _check_hybrid_features(sa, arch, sliding=True)
    hybrid = mambaish_config(model_config) is not None
    if hybrid:
        problem = hybrid_linear_problem(model_config)
        if problem:
            raise OscarConfigError(problem)
        _check_hybrid_features(sa, arch)
    from oscar_kernels.contract.model_shape import ModelShape

    try:
        shape = ModelShape.from_hf_config(model_config.hf_config)
    except (KeyError, TypeError, ValueError) as e:
        raise OscarConfigError(f"--kv-cache-dtype {OSCAR_KV_DTYPE}: cannot read the attention shape "
                               f"of {sa.model_path} ({type(e).__name__}: {e})") from None
    if hybrid or sliding:
        _check_hybrid_layers(model_config, shape, arch)
    elif shape.is_hybrid:
        _check_sliding_layers_pooled(sa, shape, arch)
    # before the rotations file: a file can be calibrated for a model the kernels cannot serve
    _check_kernel_geometry(shape, model_config, arch)
    _check_rotations_file(sa, settings, shape)


def kernel_head_dim_problem(head_dim: int) -> str | None:
    """Why the Triton attention kernels cannot run ``head_dim`` (a phrase), or None: decode
    and extend need a power of two >= 64 (triton_decode.check_decode_inputs, triton_extend;
    the store's multiple of 16 >= 32 is laxer)."""
    if head_dim >= 64 and not head_dim & (head_dim - 1):
        return None
    return f"head_dim {head_dim} (the Triton kernels need a power-of-two head_dim >= 64)"


def _check_kernel_geometry(shape, model_config, arch: str) -> None:
    """Refuse an attention geometry the kernels cannot serve (one line naming the limit)."""
    cannot = f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve {arch}"
    why = kernel_head_dim_problem(shape.head_dim)
    if why:
        raise OscarConfigError(f"{cannot}: {why}")
    v_dim = getattr(model_config, "v_head_dim", None)
    if v_dim is not None and v_dim != shape.head_dim:  # one head_dim for codes, rotations and kernels
        raise OscarConfigError(f"{cannot}: value head_dim {v_dim} differs from the key head_dim "
                               f"{shape.head_dim} (the INT2 cache needs one head_dim)")
    text = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap:  # Gemma-2's tanh cap on q.k (SGLang passes it as RadixAttention.logit_cap)
        raise OscarConfigError(f"{cannot}: attention logit soft-capping ({cap}), which the OSCAR kernels "
                               "do not apply")
    if shape.num_q_heads % shape.num_kv_heads:  # query head h reads KV head h // (Hq / H)
        raise OscarConfigError(f"{cannot}: {shape.num_q_heads} query heads are not a multiple of "
                               f"{shape.num_kv_heads} KV heads")


_VALIDATED_FILES: set = set()


def attention_tp_size(sa) -> int:
    """The attention tensor-parallel size: --tp-size, divided by --dp-size under DP attention."""
    tp = getattr(sa, "tp_size", 1) or 1
    if getattr(sa, "enable_dp_attention", False):
        tp = max(tp // (getattr(sa, "dp_size", 1) or 1), 1)
    return tp


def check_tp_split(shape, tp: int) -> None:
    """The heads of ``shape`` over ``tp`` attention-TP ranks, as SGLang's QKVParallelLinear
    splits them (query heads in equal blocks; KV heads in blocks, or each replicated on
    tp / H ranks), or ValueError with a one-line reason."""
    from oscar_kernels.contract.model_shape import kv_heads_for_rank

    if shape.num_q_heads % tp:
        raise ValueError(f"{shape.num_q_heads} query heads cannot be split over tp_size {tp}")
    kv_heads_for_rank(shape.num_kv_heads, tp, 0)


def _check_rotations_file(sa, settings, shape) -> None:
    from oscar_kernels.contract.rotations_file import RotationsFileError, load_rotations

    key = (settings.rotations_path, os.path.getmtime(settings.rotations_path), shape)
    if key not in _VALIDATED_FILES:  # __post_init__ and check_server_args both check
        try:
            load_rotations(settings.rotations_path, expect=shape)
        except RotationsFileError as e:
            raise OscarConfigError(f"--oscar-rotations: {e}") from None
        _VALIDATED_FILES.add(key)
    try:
        check_tp_split(shape, attention_tp_size(sa))
    except ValueError as e:
        raise OscarConfigError(f"--tp-size {sa.tp_size}: {e}") from None


def check_stray_oscar_flags(server_args) -> None:
    """--oscar-* fields given while the KV cache is not oscar_int2: refuse rather than
    silently serve another KV cache."""
    if is_oscar(server_args):
        return
    given = given_flags(server_args)
    if given:
        raise OscarConfigError(
            f"{given[0]} given but --kv-cache-dtype is {server_args.kv_cache_dtype!r}; "
            f"add --kv-cache-dtype {OSCAR_KV_DTYPE}")


def check_oscar_server_args(server_args) -> None:
    """All start-up refusals for oscar_int2 on resolved ServerArgs (no-op otherwise)."""
    check_stray_oscar_flags(server_args)
    if not is_oscar(server_args):
        return
    settings = oscar_settings(server_args)  # rotations given and present, ints valid
    _check_flags(server_args)
    _check_attention_backends(server_args)
    _check_cuda_graphs(server_args)
    _check_page_size(server_args, settings)
    _check_deterministic(server_args, settings)
    _check_model(server_args, settings)
