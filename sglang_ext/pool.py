"""OscarKVPool: SGLang's MHA token pool holding the hybrid INT2/BF16 OSCAR cache.

SGLang's allocator, req_to_token table, radix cache and eviction stay untouched: one
token = one slot, and every slot holds the token's INT2 K/V. ``cache``
(:class:`oscar_kernels.hybrid_cache.HybridCache`: per layer the INT2 buffers and the BF16
sinks and rings, one shared index) is written only by the oscar attention backend.

``k_buffer``/``v_buffer`` are the packed uint8 codes and ``k_scale_buffer``/
``v_scale_buffer`` the scales, so SGLang code that inspects those names sees real
tensors; every path that would copy only part of the state (CPU offload, PD transfer,
prefix-valid commits) raises instead of corrupting it.

Speculative decoding (NGRAM): after each verify SGLang moves the accepted drafts' KV to
their final slots with ``move_kv_cache`` (spec_utils.move_accept_tokens_to_target_kvcache,
for chains and trees alike); that call is where the pool learns the acceptance, so it goes
to the attention backend that planned the verify (``verify_commit``, set by
OscarAttnBackend), which moves the INT2 cells and commits the BF16 sinks and ring. Without
a planned verify a move is refused. SGLang's EAGLE-family worker (STANDALONE, EAGLE, EAGLE3,
NEXTN: one verify path, refusals' module doc) moves nothing after a chain verify; its one pool
call after every verify, ``clear_unaccepted_c128_draft_states`` (a DeepSeek-V4 pool method
upstream), carries the acceptance to the backend instead (``verify_commit_chain``). The draft's
own KV is SGLang's ordinary BF16 pool, not this one: the draft prefill and the draft extend
after each verify run on the draft runner, over its own pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import torch

from oscar_kernels.contract.layout import DEFAULT_SCALE_DTYPE, torch_scale_dtype
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import Rotations, RotationsMeta, load_rotations
from oscar_kernels.hybrid_cache import HybridCache, LayerRotation, allocate_index, allocate_layer

from .memory import OscarMemoryPlan, default_sink_slots, planned_request_rows
from .settings import oscar_settings
from .sglang_bridge import GPU_MEMORY_TYPE_KV_CACHE, HybridLinearKVPool, MHATokenToKVPool, SWAKVPool


@dataclass(frozen=True)
class RankLayout:
    """Where one rank's pool sits in the model (read from SGLang's configurator)."""

    start_layer: int
    num_layers: int
    num_kv_heads: int  # KV heads this attention-TP rank holds
    head_dim: int
    page_size: int
    tp_rank: int
    tp_size: int
    # the model layers (SGLang layer_id) whose KV this rank's pool holds, cache layer i = layer_ids[i];
    # None: start_layer .. start_layer + num_layers - 1 (every layer of a full-attention model)
    layer_ids: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        ids = tuple(range(self.start_layer, self.start_layer + self.num_layers)) if self.layer_ids is None \
            else tuple(self.layer_ids)
        if len(ids) != self.num_layers:
            raise ValueError(f"RankLayout: {len(ids)} layer ids for {self.num_layers} layers")
        object.__setattr__(self, "layer_ids", ids)


@lru_cache(maxsize=4)
def _load_validated(path: str, shape: ModelShape) -> Rotations:
    return load_rotations(path, expect=shape)


def load_rank_rotations(path: str, hf_config, layout: RankLayout
                        ) -> tuple[list[LayerRotation], RotationsMeta]:
    """The rotations of this rank's layers (``layout.layer_ids``, looked up by model layer
    index, never by position in the file) and KV heads, validated against the model (the
    loader refuses a file for another model with a one-line reason). Loaded once per
    process: pool sizing and pool construction share it."""
    rot = _load_validated(path, ModelShape.from_hf_config(hf_config))
    rot = rot.for_tp_rank(layout.tp_rank, layout.tp_size)
    try:
        layers = rot.for_model_layers(layout.layer_ids)
    except ValueError as e:
        raise ValueError(f"oscar rotations file {path}: {e} (this rank's pool holds those)") from None
    if len(layers) != layout.num_layers or rot.meta.num_kv_heads != layout.num_kv_heads:
        raise ValueError(f"oscar rotations file {path}: holds {len(layers)} layers x "
                         f"{rot.meta.num_kv_heads} KV heads for this rank, the pool needs "
                         f"{layout.num_layers} x {layout.num_kv_heads}")
    return layers, rot.meta


def memory_plan(layout: RankLayout, meta: RotationsMeta, sink_tokens: int, recent_window: int,
                num_rows: int, sink_slots: Optional[int]) -> OscarMemoryPlan:
    return OscarMemoryPlan(
        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        group_size=meta.group_size, scale_dtype=meta.scale_dtype, sink_tokens=sink_tokens,
        recent_window=recent_window, page_size=layout.page_size, num_rows=num_rows,
        num_sink_slots=sink_slots or default_sink_slots(num_rows), value_group_size=meta.value_group_size,
        key_group_sizes=meta.key_groups_of(layout.layer_ids))


def _refuse(what: str):
    raise NotImplementedError(f"{what} is not supported with --kv-cache-dtype oscar_int2 "
                              f"(it would copy the INT2 codes without the scales, sinks and rings)")


class OscarKVPool(MHATokenToKVPool):
    """Hybrid INT2/BF16 KV pool (see module doc). ``rotations``: this rank's layers
    (float32, [H, D, D] and [H, D] clips), ``rotations[i]`` for model layer ``layer_ids[i]``
    (default: start_layer + i); ``req_to_token``: SGLang's table, whose row count sizes the
    rings. SGLang's ``layer_id`` (a model layer) reaches cache layer ``cache_layer(layer_id)``."""

    def __init__(self, size: int, page_size: int, head_num: int, head_dim: int,
                 layer_num: int, device: str, *, rotations: Sequence[LayerRotation],
                 req_to_token: torch.Tensor, sink_tokens: int, recent_window: int,
                 group_size: int, scale_dtype: str = DEFAULT_SCALE_DTYPE,
                 num_sink_slots: Optional[int] = None, start_layer: Optional[int] = None,
                 end_layer: Optional[int] = None, enable_memory_saver: bool = False,
                 enable_alt_stream: bool = True, value_group_size: Optional[int] = None,
                 layer_ids: Optional[Sequence[int]] = None, key_group_sizes: Optional[Sequence[int]] = None):
        num_rows = req_to_token.shape[0]
        first = start_layer or 0
        self.layer_ids = tuple(range(first, first + layer_num)) if layer_ids is None else tuple(layer_ids)
        if len(self.layer_ids) != layer_num:
            raise ValueError(f"oscar pool: {len(self.layer_ids)} layer ids for {layer_num} layers")
        self.cache_layer_of = {l: i for i, l in enumerate(self.layer_ids)}  # model layer -> cache layer
        self.plan = OscarMemoryPlan(
            num_layers=layer_num, num_kv_heads=head_num, head_dim=head_dim,
            group_size=group_size, scale_dtype=scale_dtype, sink_tokens=sink_tokens,
            recent_window=recent_window, page_size=page_size, num_rows=num_rows,
            num_sink_slots=num_sink_slots or default_sink_slots(num_rows),
            value_group_size=value_group_size, key_group_sizes=key_group_sizes)
        if len(rotations) != layer_num:
            raise ValueError(f"oscar pool: {len(rotations)} layer rotations for {layer_num} layers")
        for r in rotations:
            if tuple(r.k_rot.shape) != (head_num, head_dim, head_dim):
                raise ValueError(f"oscar pool: rotation shape {tuple(r.k_rot.shape)} does not fit "
                                 f"{head_num} KV heads of dim {head_dim}")
        self.req_to_token = req_to_token
        self._rotations_host = list(rotations)
        # OscarAttnBackend.commit_accepted(tgt_loc, src_loc) of a backend that runs speculative
        # verifies (move_kv_cache's doc), else None
        self.verify_commit = None
        # OscarAttnBackend.commit_chain(accept_lens, num_draft_tokens), the same backend's
        # commit of an EAGLE-family chain verify (clear_unaccepted_c128_draft_states' doc)
        self.verify_commit_chain = None
        super().__init__(size, page_size, torch.bfloat16, head_num, head_dim, layer_num, device,
                         enable_memory_saver, v_head_dim=head_dim, start_layer=start_layer,
                         end_layer=end_layer, enable_alt_stream=enable_alt_stream,
                         enable_kv_cache_copy=False)

    # -- buffers ---------------------------------------------------------------------

    def _create_buffers(self):
        if self.post_capture_active:
            raise NotImplementedError("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING is not supported "
                                      "with --kv-cache-dtype oscar_int2")
        if self.kv_cache_layout != "nhd":
            raise NotImplementedError(f"KV layout {self.kv_cache_layout!r} (SGLANG_USE_HND_KVCACHE "
                                      f"or an AITER layout) is not supported with oscar_int2")
        p = self.plan
        num_slots = self.size + self.page_size
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.layers = [
                allocate_layer(num_slots, p.num_kv_heads, p.head_dim, gk,
                               p.sink_tokens, p.recent_window, p.num_sink_slots, p.num_rows,
                               torch_scale_dtype(p.scale_dtype), self.device,
                               value_group_size=p.value_group_size)
                for gk in p.key_group_sizes]
            self.index = allocate_index(num_slots, self.page_size, p.num_sink_slots, p.num_rows,
                                        self.device)
        # The rotations are weights, not cache: outside the memory-saver region.
        self.rotations = [r.to(self.device) for r in self._rotations_host]
        del self._rotations_host
        self.cache = HybridCache(self.layers, self.rotations, self.index, self.req_to_token)
        self.store_dtype = torch.uint8
        self.k_buffer = [lc.k_packed for lc in self.layers]
        self.v_buffer = [lc.v_packed for lc in self.layers]
        self.k_scale_buffer = [lc.k_scales for lc in self.layers]
        self.v_scale_buffer = [lc.v_scales for lc in self.layers]
        self.dq_k_buffer = self.dq_v_buffer = None

    def _clear_buffers(self):
        for name in ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer", "layers",
                     "index", "cache"):
            if hasattr(self, name):
                delattr(self, name)

    def cache_layer(self, layer_id: int) -> int:
        """The cache layer (index into ``layers`` / ``rotations``) of SGLang's model ``layer_id``."""
        i = self.cache_layer_of.get(layer_id)
        if i is None:
            raise ValueError(f"oscar pool: model layer {layer_id} has no INT2 cache here (this pool holds "
                             f"layers {', '.join(map(str, self.layer_ids))})")
        return i

    def _get_key_buffer(self, layer_id: int):  # packed codes, never a dtype view
        return self.k_buffer[self.cache_layer(layer_id)]

    def _get_value_buffer(self, layer_id: int):
        return self.v_buffer[self.cache_layer(layer_id)]

    def get_kv_size_bytes(self):
        """True bytes (K half, V half): codes, scales, sinks, rings and rotations of each,
        the shared index and row state counted with K."""

        def nbytes(*ts):
            return sum(t.numel() * t.element_size() for t in ts)

        k = v = 0
        for lc, rot in zip(self.layers, self.rotations):
            k += nbytes(lc.k_packed, lc.k_scales, lc.k_sink, lc.k_ring, rot.k_rot,
                        rot.k_clip_min, rot.k_clip_max)
            v += nbytes(lc.v_packed, lc.v_scales, lc.v_sink, lc.v_ring, rot.v_rot,
                        rot.v_clip_min, rot.v_clip_max)
        idx = self.index
        k += nbytes(idx.sink_slot_of_page, idx.page_of_sink_slot, idx.sink_generation,
                    idx.ring_valid_from, idx.ring_owner, idx.ring_end)
        return k, v

    def set_kv_buffer(self, *args, **kwargs):
        raise RuntimeError("the OSCAR KV cache is written inside attention by the 'oscar' attention "
                           "backend only (--attention-backend oscar), not through set_kv_buffer")

    # -- paths that would move part of the state: refuse --------------------------------

    def get_cpu_copy(self, indices, mamba_indices=None):
        _refuse("KV offload to CPU")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        _refuse("KV offload to CPU")

    def get_contiguous_buf_infos(self):
        _refuse("KV transfer (PD disaggregation)")

    def set_kv_buffer_prefix_valid(self, *args, **kwargs):
        _refuse("prefix-valid commit (speculative decoding)")

    def move_kv_cache(self, tgt_loc, src_loc):
        """SGLang's move of the accepted drafts after a speculative verify: tgt_loc, src_loc int
        [M] slots (the accepted path's final slots and the verify's, each request's run in
        path order, zero-padded). The backend that planned the verify moves every layer's INT2
        cells and commits the accepted tokens' BF16 sinks and ring cells (module doc)."""
        if self.verify_commit is None:
            _refuse("moving KV slots outside a speculative verify")
        self.verify_commit(tgt_loc, src_loc)

    def clear_unaccepted_c128_draft_states(self, req_pool_indices, seq_lens, accept_lens, num_draft_tokens):
        """SGLang 0.5.17's one pool call after every EAGLE-family verify (STANDALONE, EAGLE,
        EAGLE3, NEXTN alike: eagle_worker_common.run_eagle_verify, right after eagle_sample, before any KV move; named
        for DeepSeek-V4's compressed states, which this pool has none of). req_pool_indices,
        seq_lens int [B] (the prefix before the verify), accept_lens int [B] (accepted drafts,
        draft 0 included), num_draft_tokens the verify's T. A chain's accepted drafts already
        sit in their final slots; the backend that planned the verify commits their BF16 sinks
        and ring cells (OscarAttnBackend.commit_chain)."""
        if self.verify_commit_chain is None:
            _refuse("an EAGLE-family acceptance outside a speculative server")
        self.verify_commit_chain(accept_lens, num_draft_tokens)


class OscarHybridLinearKVPool(HybridLinearKVPool):
    """SGLang's pool of a hybrid linear-attention model (Qwen3-Next, Qwen3.5) whose
    full-attention KV is an :class:`OscarKVPool` over the full-attention layers; the Gated
    DeltaNet state stays SGLang's ``MambaPool`` (the request pool's, with its radix-cache
    snapshots), untouched.

    SGLang's own hybrid pool translates a model layer id to a dense index (0..n-1) before it
    calls its full pool; the OscarKVPool is keyed by model layer id itself
    (:meth:`OscarKVPool.cache_layer`), so the translation here only checks that the layer is
    a full-attention one and passes the model layer id on: one layer map, the pool's."""

    def __init__(self, full_kv_pool: OscarKVPool, mamba_pool, start_layer: Optional[int] = None):
        super().__init__(size=full_kv_pool.size, dtype=torch.bfloat16, page_size=full_kv_pool.page_size,
                         head_num=full_kv_pool.head_num, head_dim=full_kv_pool.head_dim,
                         full_attention_layer_ids=list(full_kv_pool.layer_ids), device=full_kv_pool.device,
                         mamba_pool=mamba_pool, start_layer=start_layer, full_kv_pool=full_kv_pool)

    def _transfer_full_attention_id(self, layer_id: int) -> int:
        self.full_kv_pool.cache_layer(layer_id)  # one-line ValueError for a linear-attention layer
        return layer_id

    def get_v_head_dim(self):  # the packed value buffers are D/4 wide: the head dim itself
        return self.full_kv_pool.head_dim


class OscarSWAKVPool(SWAKVPool):
    """SGLang's pool of a hybrid sliding-window model (gpt-oss) whose full-attention KV is an
    :class:`OscarKVPool` over the full-attention layers; the sliding-window layers' KV stays
    SGLang's BF16 ``MHATokenToKVPool`` (``swa_kv_pool``, ``size_swa`` slots, reached through
    the allocator's ``full_to_swa_index_mapping``), built and sized exactly as SGLang's
    ``_build_hybrid_swa_kv_pool`` builds it.

    SWAKVPool's ``layers_mapping`` sends a model layer id to (dense index, is_swa); for the
    full-attention layers it holds the model layer id itself, since the OscarKVPool is keyed
    by model layer id (:meth:`OscarKVPool.cache_layer`): one layer map, the pool's."""

    def __init__(self, full_kv_pool: OscarKVPool, size_swa: int, swa_attention_layer_ids: Sequence[int]):
        full_ids = list(full_kv_pool.layer_ids)
        if set(full_ids) & set(swa_attention_layer_ids):
            raise ValueError(f"oscar pool: layers {sorted(set(full_ids) & set(swa_attention_layer_ids))} "
                             "are both full-attention and sliding-window layers")

        def build(*, allocation_label, layer_num, **kwargs):
            if allocation_label == "Full":  # SWAKVPool's full pool: the one built above
                if layer_num != full_kv_pool.layer_num:
                    raise ValueError(f"oscar pool: SWAKVPool wants {layer_num} full-attention layers, "
                                     f"the INT2 pool holds {full_kv_pool.layer_num}")
                return full_kv_pool
            return MHATokenToKVPool(allocation_label=allocation_label, layer_num=layer_num, **kwargs)

        super().__init__(size=full_kv_pool.size, size_swa=size_swa, page_size=full_kv_pool.page_size,
                         dtype=torch.bfloat16, head_num=full_kv_pool.head_num, head_dim=full_kv_pool.head_dim,
                         swa_attention_layer_ids=list(swa_attention_layer_ids),
                         full_attention_layer_ids=full_ids, device=full_kv_pool.device,
                         token_to_kv_pool_class=build, enable_kv_cache_copy=False)
        for layer_id in full_ids:
            self.layers_mapping[layer_id] = (layer_id, False)

    def is_swa_layer(self, layer_id: int) -> bool:
        """True for a sliding-window layer (SGLang's BF16 SWA pool), False for a full-attention
        layer (the INT2 pool); a one-line ValueError for a layer this pool does not hold."""
        entry = self.layers_mapping.get(layer_id)
        if entry is None:
            raise ValueError(f"oscar pool: model layer {layer_id} is neither a full-attention layer "
                             f"({', '.join(map(str, self.full_kv_pool.layer_ids))}) nor a sliding-window one")
        return entry[1]


def oscar_pool_of(pool) -> Optional[OscarKVPool]:
    """The OscarKVPool SGLang's model runner holds: the pool itself, or the full-attention
    pool inside a hybrid linear-attention or hybrid sliding-window pool; None for any other pool."""
    if isinstance(pool, (OscarHybridLinearKVPool, OscarSWAKVPool)):
        pool = pool.full_kv_pool
    return pool if isinstance(pool, OscarKVPool) else None


# -- construction from SGLang's KVCacheConfigurator (the plugin's sizing and pool hooks) --

def full_attention_layer_ids(kvc) -> Optional[tuple[int, ...]]:
    """The model layers of this pipeline stage whose KV SGLang keeps in a token pool: for a
    hybrid linear-attention model its full-attention layers (as SGLang's
    ``_build_hybrid_linear_kv_pool`` and ``DefaultPoolConfigurator`` take them); None for a
    model whose every layer is attention."""
    if kvc.is_hybrid_swa:  # SGLang's SWAKVPool holds every full-attention layer of the model
        return tuple(kvc.model_config.full_attention_layer_ids)
    hybrid = kvc.mambaish_config
    if hybrid is None:
        return None
    li = kvc.layer_info
    return tuple(i for i in hybrid.full_attention_layer_ids if li.start_layer <= i < li.end_layer)


def rank_layout(kvc) -> RankLayout:
    mc, li, ps = kvc.model_config, kvc.layer_info, kvc.ps
    ids = full_attention_layer_ids(kvc)
    return RankLayout(start_layer=li.start_layer,
                      num_layers=li.num_effective_layers if ids is None else len(ids),
                      num_kv_heads=mc.get_num_kv_heads(ps.attn_tp_size), head_dim=mc.head_dim,
                      page_size=kvc.pool_page_size, tp_rank=ps.attn_tp_rank,
                      tp_size=ps.attn_tp_size, layer_ids=ids)


def plan_for_configurator(kvc) -> OscarMemoryPlan:
    """The memory plan of this rank for the planned request rows (--max-running-requests per
    attention-DP worker, or the oscar default, + SGLang's padding row); the pool itself uses
    the real req_to_token row count. A hybrid linear-attention model plans its
    full-attention layers only (SGLang charges its Mamba state before the KV budget)."""
    s = oscar_settings(kvc.server_args)
    layout = rank_layout(kvc)
    _, meta = load_rank_rotations(s.rotations_path, kvc.model_config.hf_config, layout)
    num_rows = planned_request_rows(kvc.server_args.max_running_requests, kvc.ps.attn_dp_size) + 1
    return memory_plan(layout, meta, s.sink_tokens, s.recent_window, num_rows, s.sink_slots)


def build_pool_for_configurator(kvc, max_total_num_tokens: int, req_to_token_pool) -> OscarKVPool:
    """OscarKVPool for the configurator's model and rank (what SGLang's
    ``_build_mha_kv_pool`` builds for an MHA model, with the oscar storage); for a hybrid
    linear-attention model, the pool of its full-attention layers."""
    mc = kvc.model_config
    if mc.v_head_dim != mc.head_dim:
        raise ValueError(f"oscar_int2 needs equal K and V head dims, the model has "
                         f"{mc.head_dim} and {mc.v_head_dim}")
    s = oscar_settings(kvc.server_args)
    layout = rank_layout(kvc)
    layers, meta = load_rank_rotations(s.rotations_path, mc.hf_config, layout)
    hybrid = full_attention_layer_ids(kvc) is not None
    return OscarKVPool(
        max_total_num_tokens, page_size=layout.page_size, head_num=layout.num_kv_heads,
        head_dim=layout.head_dim, layer_num=layout.num_layers, device=kvc.device,
        rotations=layers, req_to_token=req_to_token_pool.req_to_token,
        sink_tokens=s.sink_tokens, recent_window=s.recent_window, group_size=meta.group_size,
        scale_dtype=meta.scale_dtype, num_sink_slots=s.sink_slots,
        # a hybrid model's full-attention pool spans its own layers, as SGLang's does
        start_layer=None if hybrid else kvc.layer_info.start_layer,
        end_layer=None if hybrid else kvc.layer_info.end_layer,
        enable_memory_saver=bool(getattr(kvc.server_args, "enable_memory_saver", False)),
        value_group_size=meta.value_group_size, layer_ids=layout.layer_ids,
        key_group_sizes=meta.key_groups_of(layout.layer_ids))


def build_hybrid_linear_pool_for_configurator(kvc, max_total_num_tokens: int,
                                              req_to_token_pool) -> OscarHybridLinearKVPool:
    """What SGLang's ``_build_hybrid_linear_kv_pool`` builds for a hybrid linear-attention
    model, with the full-attention layers in an OscarKVPool: the Mamba state pool is the
    one SGLang's HybridReqToTokenPool already allocated (sized by SGLang)."""
    full = build_pool_for_configurator(kvc, max_total_num_tokens, req_to_token_pool)
    return OscarHybridLinearKVPool(full, req_to_token_pool.mamba_pool, start_layer=kvc.layer_info.start_layer)


def build_hybrid_swa_pool_for_configurator(kvc, sizes, req_to_token_pool) -> OscarSWAKVPool:
    """What SGLang's ``_build_hybrid_swa_kv_pool`` builds for a hybrid sliding-window model,
    with the full-attention layers in an OscarKVPool of ``sizes.full_max_total_num_tokens``
    tokens; the sliding-window layers' BF16 pool of ``sizes.swa_max_total_num_tokens`` tokens
    (as HybridSWAPoolConfigurator sized it; the plugin's pool hook refused what
    refusals.hybrid_swa_problem names)."""
    full = build_pool_for_configurator(kvc, sizes.full_max_total_num_tokens, req_to_token_pool)
    return OscarSWAKVPool(full, sizes.swa_max_total_num_tokens, kvc.model_config.swa_attention_layer_ids)
