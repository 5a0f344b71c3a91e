"""OscarAttnBackend: SGLang attention over OscarKVPool's hybrid INT2/BF16 cache.

A thin caller of :class:`oscar_kernels.hybrid_attention.HybridAttention` (where the store ->
attend -> ring protocol lives): ``init_forward_metadata`` plans each forward batch,
``forward_extend`` / ``forward_decode`` run one layer. What it adds is SGLang's side: the
live requests' rows, whose sink slots new sequences must not take (a long request keeps its
BF16 sinks however many start after it; page 0, SGLang's padding page, never gets sinks);
each request's rid hash as the ring owner (hybrid_cache.update_ring_validity); and the one
attention scale of the model's RadixAttention layers.

Decode plans from the batch's static tensors only, in ``init_forward_metadata_in_graph``,
as device ops: a CUDA-graph decode needs no host synchronisation and allocates nothing
outside the graph.

Speculative decoding (NGRAM, issue 49). SGLang runs a verify as a TARGET_VERIFY forward
(ngram_worker.py:353): B requests of T = ``spec_info.draft_token_num`` drafts, draft i of
request b at ``positions`` (prefix ``seq_lens[b]`` + depth) in slot ``out_cache_loc``
(req_to_token[row, seq_len + i]), its tree in ``spec_info.custom_mask``. The backend plans
HybridAttention.plan_verify (parents from the mask: :func:`verify_parents`) and runs
HybridAttention.verify per layer (through ``forward_extend``: TARGET_VERIFY is an extend
mode). After sampling, SGLang moves the accepted path to the front slots with the pool's
``move_kv_cache`` (spec_utils.py:687), for chains and trees: :meth:`commit_accepted` reads the
acceptance off that move, moves the INT2 cells and commits the BF16 sinks and ring, once per
verify. The verify plan allocates, so verify runs without CUDA graphs (the refusals turn the
decode graph, which SGLang captures as the verify under speculation, off).

SGLang's EAGLE-family V2 worker -- STANDALONE (a draft model), EAGLE and EAGLE3 (drafts fed the
target's hidden states) and NEXTN (the target's MTP layers, resolved to EAGLE): one verify path for
all four, refusals' module doc -- verifies the same way, a chain (--speculative-eagle-topk 1: the
refusals serve no draft-model trees), but SGLang accepts a chain with no ``move_kv_cache``: the
one call it makes on the target's pool after every EAGLE-family verify is
``clear_unaccepted_c128_draft_states(req_pool_indices, seq_lens, accept_lens, num_draft_tokens)``
(eagle_worker_common.run_eagle_verify, after eagle_sample; only DeepSeek-V4's pool defines it
upstream), so the pool defines it and :meth:`commit_chain` commits the first ``accept_lens[b]``
drafts there. The draft's own KV is SGLang's ordinary BF16 pool behind an
ordinary backend (plugin.build_token_to_kv_pool_hook, refusals' draft attention backend); the
hidden states EAGLE's target forwards capture for the draft (CaptureHiddenMode.FULL, EAGLE3's aux
layers) are the model's layer outputs, taken outside this backend.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Optional, Sequence

import torch

from oscar_kernels.hybrid_attention import HybridAttention, flashinfer_import_error, use_triton
from oscar_kernels.hybrid_cache import move_int2_cells

from .pool import OscarSWAKVPool, oscar_pool_of
from .settings import DEFAULT_EXTEND_PREFIX, oscar_settings, resolve_extend_prefix
from .sglang_bridge import (ATTENTION_BACKENDS, SWA_LAYER_BACKEND, AttentionBackend, AttentionType,
                            ForwardMode, RadixAttention)

logger = logging.getLogger(__name__)

PADDING_PAGE = 0  # SGLang's padding page (padded batches write slot 0): never a sink page


def rid_hash(rid: Optional[str]) -> int:
    """Signed 64-bit hash of a request id (0 for the id-less dummy batches of warmup)."""
    if rid is None:
        return 0
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little",
                          signed=True)


def rows_in_use(req_to_token_pool) -> Optional[list[int]]:
    """The req_to_token rows SGLang's pool has handed out (row 0 is its padding row), from
    its host free list; None for a pool without one."""
    free = getattr(req_to_token_pool, "free_slots", None)
    if free is None:
        return None
    free = set(free)
    return [r for r in range(1, req_to_token_pool.req_to_token.shape[0]) if r not in free]


def choose_prefix_read(choice: str, device: torch.device, deterministic: bool = False,
                       key_debias: bool = False) -> str:
    """Resolve --oscar-extend-prefix (settings.resolve_extend_prefix) on ``device``:
    "int2" | "bf16" | "flashinfer" (the last only where flashinfer imports, on CUDA)."""
    cuda = torch.device(device).type == "cuda"
    error = flashinfer_import_error() if cuda else None
    read = resolve_extend_prefix(choice, cuda, error is None, deterministic, key_debias)
    if read == "flashinfer" and error is not None:
        raise RuntimeError(f"--oscar-extend-prefix flashinfer needs flashinfer ({error})")
    if error is not None and choice == "auto" and read == "int2":
        logger.warning("oscar: flashinfer does not import (%s); prefill reads cached prefixes as INT2", error)
    return read


def verify_parents(custom_mask: torch.Tensor, seq_lens: torch.Tensor, batch: int, num_drafts: int) -> torch.Tensor:
    """int64 [B, T]: each draft's parent draft (-1: the prefix) from SGLang's verify mask, as
    ngram_worker._derive_tree_links reads it: mask[b, i, j] marks draft j as draft i or an
    ancestor of it, so i's parent is the largest such j < i. ``custom_mask`` bool, flat: per
    request T rows of seq_lens[b] prefix columns then T draft columns (the CUDA layout,
    ngram_worker.py:332, the Triton backend's mask_indptr) or, on SGLang's CPU path, T x T
    per request. ``seq_lens`` int [B] (>= B entries); device ops, no host sync."""
    b, t = batch, num_drafts
    dev = custom_mask.device
    j = torch.arange(t, device=dev)
    if custom_mask.numel() == b * t * t:
        m = custom_mask.view(b, t, t)
    else:
        n = seq_lens[:b].long()
        size = t * (n + t)
        start = torch.cumsum(size, 0) - size
        at = start[:, None, None] + j[None, :, None] * (n + t)[:, None, None] + n[:, None, None] + j[None, None, :]
        m = custom_mask[at]
    below = m.bool() & (j[None, None, :] < j[None, :, None])
    return torch.where(below, j[None, None, :], -1).amax(-1)


def accept_index_from_move(tgt_loc: torch.Tensor, src_loc: torch.Tensor, draft_slots: torch.Tensor,
                           batch: int, num_drafts: int) -> torch.Tensor:
    """int64 [B, T]: the accepted drafts of each request in path order, -1 after the last
    (HybridAttention.commit's accept_index), read off SGLang's move of a verify's accepted
    path: src_loc [M] the accepted drafts' slots (each request's run in path order, requests
    in order, then zero padding: spec_utils.move_accept_tokens_to_target_kvcache),
    draft_slots [B*T] the verify's slots (out_cache_loc). A draft slot is never 0 (SGLang's
    padding page), so a padding entry matches no draft. Device ops, no host sync."""
    b, t = batch, num_drafts
    src = src_loc.long()
    match = src[:, None] == draft_slots.long()[None, :]  # [M, B*T]
    hit = match.any(1)
    tok = match.to(torch.int8).argmax(1)
    req, draft = tok // t, tok % t
    counts = torch.zeros(b + 1, dtype=torch.int64, device=src.device)
    counts.scatter_add_(0, torch.where(hit, req, b), torch.ones_like(req))
    first = torch.cumsum(counts, 0) - counts  # each request's first entry
    k = torch.arange(src.shape[0], device=src.device) - first[torch.where(hit, req, b)]
    out = torch.full((b + 1, t + 1), -1, dtype=torch.int64, device=src.device)  # row b / column t: padding
    out.index_put_((torch.where(hit, req, b), torch.where(hit, k.clamp(0, t), t)), torch.where(hit, draft, -1))
    return out[:b, :t]


def model_attention_scale(model) -> float:
    """The attention scale of every RadixAttention layer of ``model`` (one value)."""
    scales = {float(m.scaling) for m in model.modules() if isinstance(m, RadixAttention)}
    if len(scales) != 1:
        raise NotImplementedError("oscar backend: the model's attention layers use "
                                  f"{'no' if not scales else 'several'} attention scales "
                                  f"({sorted(scales)}); one scale for every layer is supported")
    return scales.pop()


class OscarAttnBackend(AttentionBackend):
    """The ``--attention-backend oscar`` backend (needs ``--kv-cache-dtype oscar_int2``).

    The oscar kernels read ``req_to_token`` directly, so no kv-index metadata or CUDA-graph
    index buffers are built; SGLang's graph runners see the AttentionBackend interface
    (metadata out of and in the graph, ``init_cuda_graph_state``, the padding fill value)."""

    # extend batches read their host length lists; decode reads no host sequence lengths
    needs_cpu_seq_lens: bool = False

    @classmethod
    def from_model_runner(cls, model_runner) -> "OscarAttnBackend":
        """The backend SGLang's registry builds for a model runner (model loaded, pools
        built), with the oscar settings of its server arguments."""
        sa, mc = model_runner.server_args, model_runner.model_config
        settings = oscar_settings(sa)
        spec = getattr(sa, "speculative_algorithm", None) is not None  # NGRAM, the EAGLE family (refusals)
        # the most drafts a verify may hold (more than --speculative-num-draft-tokens under
        # --speculative-adaptive: ServerArgs.max_speculative_num_draft_tokens)
        drafts = max(int(getattr(sa, name, None) or 0) for name in
                     ("speculative_num_draft_tokens", "max_speculative_num_draft_tokens")) if spec else 0
        return cls(model_runner.token_to_kv_pool, model_runner.req_to_token_pool,
                   num_q_heads=mc.get_max_num_attention_heads() // model_runner.ps.attn_tp_size,
                   sm_scale=model_attention_scale(model_runner.model),
                   extend_prefix=settings.extend_prefix, key_debias=settings.key_debias,
                   deterministic=bool(sa.enable_deterministic_inference), context_len=mc.context_len,
                   learned_sinks=bool(getattr(mc, "has_attention_sinks", False)), max_draft_tokens=drafts)

    def __init__(self, pool, req_to_token_pool, *, num_q_heads: int, sm_scale: float,
                 extend_prefix: str = DEFAULT_EXTEND_PREFIX, deterministic: bool = False,
                 context_len: int = 0, learned_sinks: bool = False, key_debias: bool = False,
                 max_draft_tokens: int = 0):
        """``pool``: the model runner's KV pool, an OscarKVPool or (a Gated DeltaNet hybrid) the
        hybrid linear pool holding one, whose full-attention layers this backend serves (SGLang's
        HybridLinearAttnBackend sends it those layers only, with their model layer ids);
        ``req_to_token_pool``: SGLang's request pool (its host free list gives the rows of
        live requests); ``num_q_heads``: query heads on this rank; ``extend_prefix``:
        --oscar-extend-prefix; ``deterministic`` (--enable-deterministic-inference):
        batch-invariant decode splits for ``context_len`` tokens and the INT2 prefix read;
        ``learned_sinks``: the model passes per-head sink logits (``sinks=``, gpt-oss), which join
        the softmax of the full-attention layers (the "flashinfer" prefix read becomes "bf16");
        ``key_debias``: --oscar-key-debias (HybridAttention's key_debias); ``max_draft_tokens``:
        --speculative-num-draft-tokens of a speculative server (0: none), which sizes the verify's
        staging workspace (HybridAttention) and makes this backend the pool's ``verify_commit``."""
        oscar_pool = oscar_pool_of(pool)
        if oscar_pool is None:
            raise ValueError("--attention-backend oscar needs --kv-cache-dtype oscar_int2 "
                             f"(the KV pool is {type(pool).__name__})")
        # SGLang's forward context reads the runner's pool from the backend (get_token_to_kv_pool)
        self.token_to_kv_pool = pool
        self.pool = pool = oscar_pool
        self.req_to_token_pool = req_to_token_pool
        self._checked_layers: set[int] = set()
        device = pool.req_to_token.device
        self.prefix_read = choose_prefix_read(extend_prefix, device, deterministic, key_debias)
        rows = pool.req_to_token.shape[0]  # decode batches: at most one request per row
        config = None
        if deterministic and use_triton(pool.req_to_token):
            from oscar_kernels.triton_decode import batch_invariant_config
            config = batch_invariant_config(context_len, rows, num_q_heads, pool.head_dim)
        self.attention = HybridAttention(pool.cache, num_q_heads, sm_scale, max_batch=rows,
                                         prefix_read=self.prefix_read, decode_config=config,
                                         padding_page=PADDING_PAGE, learned_sinks=learned_sinks,
                                         key_debias=key_debias, max_draft_tokens=max_draft_tokens)
        self.learned_sinks = learned_sinks
        # SGLang's EAGLE-family worker sizes the verify tree mask it builds for the target's
        # backend with bs * max_context_len tokens when the batch carries no seq_lens_sum
        # (eagle_worker_common.build_eagle_verify_input), as for its own backends
        self.max_context_len = context_len
        # (slots int [B*T], B, T, chain) of the planned verify whose acceptance has not been
        # committed; chain: planned without parents (an EAGLE-family topk-1 verify)
        self._pending_verify: Optional[tuple[torch.Tensor, int, int, bool]] = None
        if max_draft_tokens:
            pool.verify_commit = self.commit_accepted
            pool.verify_commit_chain = self.commit_chain
        if device.type == "cuda":  # SGLang's own warm-up request never reads a cached prefix
            logger.info("oscar: compiled the attention kernels (prefill, %s prefix read, decode) in %.1f s",
                        self.prefix_read, self.attention.warm_up())

    def _live_rows(self) -> Optional[torch.Tensor]:
        rows = rows_in_use(self.req_to_token_pool) if self.req_to_token_pool is not None else None
        if rows is None:
            return None
        return torch.tensor(rows, dtype=torch.int64).to(self.pool.req_to_token.device, non_blocking=True)

    # -- metadata ---------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return
        if mode.is_decode():
            self.init_forward_metadata_in_graph(forward_batch)
            return
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            self._plan_extend(forward_batch)
            return
        if mode.is_target_verify() and self.attention.max_draft_tokens:
            self._plan_verify(forward_batch)
            return
        raise NotImplementedError(f"oscar backend: forward mode {mode.name} is not supported "
                                  "(of speculative decoding, oscar_int2 serves the NGRAM and EAGLE-family verify)")

    def _plan_verify(self, fb) -> None:
        """Reads ``req_pool_indices, seq_lens, positions, out_cache_loc`` and ``spec_info``'s
        ``draft_token_num, custom_mask`` of a TARGET_VERIFY forward batch (module doc)."""
        spec = fb.spec_info
        t = int(spec.draft_token_num)
        bs = fb.req_pool_indices.shape[0]
        # A new plan replaces one whose acceptance never came: a dummy TARGET_VERIFY forward
        # (SGLang's autotune warm-up, base_runner._dummy_run) samples nothing and moves nothing;
        # it wrote INT2 cells of its own slots only. A mask-less batch is a chain, and so is an
        # EAGLE-family verify of topk 1 (EagleVerifyInput.topk), whose mask is not read.
        mask = getattr(spec, "custom_mask", None)
        chain = mask is None or getattr(spec, "topk", None) == 1
        parents = None if chain else verify_parents(mask, fb.seq_lens, bs, t)
        # private copies of what the commit reads after sampling: SGLang advances the batch's
        # seq_lens (and may filter its rows) between this verify and the next
        slots = fb.out_cache_loc[:bs * t].clone()
        self.attention.plan_verify(fb.req_pool_indices[:bs].clone().long(), fb.seq_lens[:bs].clone(),
                                   fb.positions[:bs * t], slots, num_draft_tokens=t, parents=parents)
        self._pending_verify = (slots, bs, t, chain)

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """SGLang's EAGLE-family worker (with SGLANG_ENABLE_OVERLAP_PLAN_STREAM) calls this after
        the draft, to refresh what a verify planned early read of the mask and positions. Nothing
        is planned early here: the verify plan is made in the forward (init_forward_metadata),
        after the draft, and never inside a CUDA graph (the refusals keep verify graphs off)."""

    def commit_accepted(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """The pool's ``move_kv_cache`` after the planned verify (tgt_loc, src_loc int [M]:
        pool.OscarKVPool.move_kv_cache): every layer's INT2 cells move from src to tgt (a
        no-op for a chain, whose drafts already sit in their final slots), then
        HybridAttention.commit writes the accepted drafts' BF16 sinks and ring cells and ends
        the rows' rings at prefix + accepted. The acceptance is read off the move
        (:func:`accept_index_from_move`)."""
        if self._pending_verify is None:
            raise NotImplementedError("moving KV slots is supported with --kv-cache-dtype oscar_int2 only "
                                      "right after a speculative verify (it would copy INT2 codes without their "
                                      "BF16 sinks and ring cells)")
        slots, b, t, _ = self._pending_verify
        accept_index = accept_index_from_move(tgt_loc, src_loc, slots, b, t)
        move_int2_cells(self.pool.layers, tgt_loc, src_loc)
        self.attention.commit(accept_index)
        self._pending_verify = None

    def commit_chain(self, accept_lens: torch.Tensor, num_draft_tokens: int) -> None:
        """The pool's ``clear_unaccepted_c128_draft_states`` after an EAGLE-family verify (module
        doc): ``accept_lens`` int [>= B] accepted drafts per request, draft 0 (the last sampled
        token) included, as SGLang's eagle_sample counts them (seq_lens += accept_lens);
        ``num_draft_tokens`` the verify's T. The accepted drafts of a chain are its first
        accept_lens[b], already in their final slots (req_to_token[row, n + i]): no INT2 cell
        moves, HybridAttention.commit writes their BF16 sinks and ring cells and ends the rows'
        rings at prefix + accepted. Once per verify; device ops, no host sync."""
        if self._pending_verify is None:
            raise NotImplementedError("an EAGLE-family acceptance is supported with --kv-cache-dtype oscar_int2 "
                                      "only right after an EAGLE-family chain verify (one commit per verify)")
        slots, b, t, chain = self._pending_verify
        if not chain or int(num_draft_tokens) != t:
            raise NotImplementedError(f"oscar_int2 commits an EAGLE-family acceptance of a chain verify only "
                                      f"(this verify: {'a chain' if chain else 'a tree'} of {t} drafts, the "
                                      f"acceptance names {num_draft_tokens}); use --speculative-eagle-topk 1")
        self.attention.commit(accept_lens=accept_lens[:b])
        self._pending_verify = None

    def _plan_extend(self, fb) -> None:
        """Reads ``batch_size, req_pool_indices, extend_prefix_lens, extend_seq_lens,
        extend_*_lens_cpu, out_cache_loc, positions, rids`` of the forward batch."""
        bs = fb.batch_size
        prefix_cpu, ext_cpu = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
        if prefix_cpu is None or ext_cpu is None:  # gpu-only batches carry no host lists
            prefix_cpu, ext_cpu = fb.extend_prefix_lens[:bs].tolist(), fb.extend_seq_lens[:bs].tolist()
        prefix_cpu, ext_cpu = list(prefix_cpu)[:bs], list(ext_cpu)[:bs]
        num_tokens = sum(ext_cpu)
        positions = fb.positions[:num_tokens]
        if positions.dim() != 1:
            raise NotImplementedError("oscar backend: multi-axis (M-RoPE) positions are not supported")
        rids: Sequence[Optional[str]] = fb.rids if fb.rids is not None else [None] * bs
        owners = torch.tensor([rid_hash(r) for r in list(rids)[:bs]], dtype=torch.int64)
        device = fb.out_cache_loc.device
        self.attention.plan_extend(
            fb.req_pool_indices[:bs].long(), fb.extend_prefix_lens[:bs], fb.extend_seq_lens[:bs], positions,
            fb.out_cache_loc[:num_tokens], prefix_lens_host=prefix_cpu, extend_lens_host=ext_cpu,
            owners=owners.to(device, non_blocking=True),
            live_rows=self._live_rows() if 0 in prefix_cpu else None)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError("oscar backend: CUDA graphs are supported for decode only "
                                      "(use the default breakable prefill graphs or disable them)")

    def init_forward_metadata_in_graph(self, forward_batch):
        if forward_batch.forward_mode.is_decode():
            # static graph buffers in, persistent tensors out: recordable, no sync
            self.attention.plan_decode(forward_batch.req_pool_indices, forward_batch.seq_lens,
                                       forward_batch.positions, forward_batch.out_cache_loc)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        """Nothing to pre-allocate: decode reads the runner's static batch buffers."""

    def get_cuda_graph_seq_len_fill_value(self):
        """Padded graph rows decode one token of SGLang's padding row (row 0, slot 0)."""
        return 1

    # -- forward ----------------------------------------------------------------------

    def _check_layer(self, layer, kwargs, save_kv_cache: bool, k) -> None:
        for name in ("score_mod", "aux_tensors", "q_rope", "k_rope"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"oscar backend: attention with {name} is not supported")
        sinks = kwargs.get("sinks")
        if sinks is not None and (not self.learned_sinks or tuple(sinks.shape) != (layer.tp_q_head_num,)):
            raise NotImplementedError(
                f"oscar backend: layer {layer.layer_id} passes sinks of shape {tuple(sinks.shape)} "
                + ("(one logit per query head of this rank is supported)" if self.learned_sinks
                   else "but the model config declares no attention sinks"))
        if k is None or not save_kv_cache:
            raise NotImplementedError("oscar backend: the model must hand k and v to the "
                                      "backend to store (save_kv_cache=False is not supported)")
        if layer.layer_id in self._checked_layers:
            return
        problem = None
        if layer.logit_cap and layer.logit_cap > 0:
            problem = "logit capping"
        elif layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            problem = "sliding-window attention"
        elif layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            problem = f"{layer.attn_type.value} / cross attention"
        elif layer.k_scale is not None or layer.v_scale is not None:
            problem = "per-layer k/v scales"
        elif layer.qk_head_dim != self.pool.head_dim or layer.v_head_dim != self.pool.head_dim:
            problem = f"head dims {layer.qk_head_dim}/{layer.v_head_dim} != {self.pool.head_dim}"
        elif float(layer.scaling) != self.attention.sm_scale:
            problem = f"attention scale {layer.scaling} (the others use {self.attention.sm_scale})"
        if problem:
            raise NotImplementedError(f"oscar backend: layer {layer.layer_id} uses {problem}, "
                                      "which the OSCAR kernels do not support")
        self._checked_layers.add(layer.layer_id)

    def _run(self, run, q, k, v, layer, out, kwargs, save_kv_cache):
        self._check_layer(layer, kwargs, save_kv_cache, k)
        hq, h, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        t = q.numel() // (hq * d)
        o = out if out is not None else q.new_empty((t, hq * d))
        cache_layer = self.pool.cache_layer(layer.layer_id)  # model layer -> the pool's layer (and rotation)
        if self.pool.layer_transfer_counter is not None:  # HiCache: this layer's load from host is done
            self.pool.layer_transfer_counter.wait_until(cache_layer)
        run(cache_layer, q.reshape(t, hq, d), k.view(t, h, d), v.view(t, h, d), out=o.view(t, hq, d),
            sinks=kwargs.get("sinks"))
        return o

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        # the output buffer SGLang's RadixAttention pre-allocates for this call, if any
        out = getattr(forward_batch, "_attn_output", None)
        run = self.attention.verify if forward_batch.forward_mode.is_target_verify() else self.attention.extend
        return self._run(run, q, k, v, layer, out, kwargs, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._run(self.attention.decode, q, k, v, layer, None, kwargs, save_kv_cache)


class OscarSWAAttnBackend(AttentionBackend):
    """The ``oscar`` backend of a hybrid sliding-window model (gpt-oss): the full-attention
    layers through :class:`OscarAttnBackend` over the INT2 pool (learned sinks passed on), the
    sliding-window layers through SGLang's own SWA-capable backend (``SWA_LAYER_BACKEND``, its
    Triton backend) over SGLang's BF16 SWA pool, exactly as SGLang runs them. Both plan every
    batch (SGLang's backend builds its window indices and full->SWA write slots; the oscar one
    its INT2/sink/ring plan); each layer goes to one of them by the pool's layer map."""

    @classmethod
    def from_model_runner(cls, model_runner) -> "OscarSWAAttnBackend":
        pool = model_runner.token_to_kv_pool
        swa = ATTENTION_BACKENDS[SWA_LAYER_BACKEND](model_runner)
        if getattr(swa, "swa_v_head_dim", None) is None:
            # SGLang reads the value width off layer 0's buffer, which is packed when layer 0 is a
            # full-attention (INT2) layer; the SWA layers' value head dim is the model's
            swa.v_head_dim = model_runner.model_config.v_head_dim
        return cls(OscarAttnBackend.from_model_runner(model_runner), swa, pool)

    def __init__(self, full: OscarAttnBackend, swa: AttentionBackend, pool: OscarSWAKVPool):
        if not isinstance(pool, OscarSWAKVPool) or oscar_pool_of(pool) is not full.pool:
            raise ValueError("oscar backend: a hybrid sliding-window model needs the oscar_int2 SWA pool "
                             f"holding the backend's INT2 pool (got {type(pool).__name__})")
        super().__init__()
        self.full, self.swa, self.pool = full, swa, pool
        self.backends = (full, swa)
        self.token_to_kv_pool = pool  # SGLang's forward context reads the runner's pool from the backend
        self.req_to_token_pool = full.req_to_token_pool
        self.needs_cpu_seq_lens = any(getattr(b, "needs_cpu_seq_lens", True) for b in self.backends)
        fills = {b.get_cuda_graph_seq_len_fill_value() for b in self.backends}
        if len(fills) != 1:
            raise ValueError(f"oscar backend: the two backends pad CUDA-graph batches differently ({fills})")
        self._fill = fills.pop()

    def backend_of(self, layer) -> AttentionBackend:
        return self.swa if self.pool.is_swa_layer(layer.layer_id) else self.full

    # -- metadata: both backends plan every batch -------------------------------------

    def init_forward_metadata(self, forward_batch):
        for b in self.backends:
            b.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        for b in self.backends:
            b.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        for b in self.backends:
            b.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        for b in self.backends:
            b.init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)

    def get_cuda_graph_seq_len_fill_value(self):
        return self._fill

    def on_after_cuda_graph_warmup(self):
        for b in self.backends:
            b.on_after_cuda_graph_warmup()

    # -- forward: one layer, one backend ----------------------------------------------

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.backend_of(layer).forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.backend_of(layer).forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
