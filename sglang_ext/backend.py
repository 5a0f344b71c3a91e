"""OscarAttnBackend: SGLang attention over OscarKVPool's hybrid INT2/BF16 cache.

Per layer, all kernels go through :mod:`oscar_kernels.api`:

- extend (prefill, chunked prefill, mixed batches): store the new tokens (INT2 + sinks,
  keeping their rotated BF16 k', v') -> ``extend_attention`` (new tokens attend to the
  hybrid prefix and causally to themselves) -> write the ring cells **after** attention
  (earlier would clobber the prefix window the kernel reads) -> output.
- decode: store (INT2 + sinks + ring) -> ``decode_attention``.

Per forward batch (never per layer), in ``init_forward_metadata``:

- sequences that start at position 0 get a sink slot for their first page
  (:func:`oscar_kernels.hybrid_cache.assign_sink_slots`, host counter, no sync), never one
  that a live request reads (the rows SGLang's req_to_token pool has handed out: its free
  list, a host list), so a long request keeps its BF16 sinks however many start after it;
- each request row's ring validity: ``valid_from`` is reset to the request's prefix
  length when the row's ring belongs to someone else (``ring_owner`` differs from the
  hash of the request id) or does not end where this batch starts (``ring_end`` differs
  from the prefix length: re-admission after a retraction, a radix hit in a reused row).
  A chunked-prefill continuation matches both and keeps its ``valid_from``; a radix hit
  starts its ring at its prefix length, so the shared slots are read as INT2 (and its
  sinks from the shared first page).

Decode uses only the batch's static tensors (``req_pool_indices``, ``seq_lens``,
``positions``, ``out_cache_loc``) and the pool's persistent ones; its only per-batch
state update (``ring_end``) runs in ``init_forward_metadata_in_graph``, so a CUDA-graph
decode needs no host synchronisation and allocates nothing outside the graph.

The oscar settings (the prefix read) come from the server arguments, resolved once when
SGLang builds the backend (:meth:`OscarAttnBackend.from_model_runner`).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from oscar_kernels import api
from oscar_kernels.hybrid_cache import assign_sink_slots, sink_slots_in_use

from .pool import OscarKVPool, OscarWriteMeta
from .settings import DEFAULT_EXTEND_PREFIX, oscar_settings, resolve_extend_prefix
from .sglang_bridge import AttentionBackend, AttentionType, ForwardMode

logger = logging.getLogger(__name__)


def rid_hash(rid: Optional[str]) -> int:
    """Signed 64-bit hash of a request id (0 for the id-less dummy batches of warmup)."""
    if rid is None:
        return 0
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little",
                          signed=True)


@dataclass
class ExtendPlan:
    """Per-batch tensors of an extend batch ([B] per request, [T] per new token)."""

    rows: torch.Tensor  # [B] req_to_token rows
    prefix_lens: torch.Tensor  # [B] cached prefix length L
    qo_indptr: torch.Tensor  # [B+1] new tokens of request b: qo_indptr[b]:qo_indptr[b+1]
    prefix_lens_host: list[int]  # prefix_lens as host ints
    extend_lens_host: list[int]  # new tokens per request, host ints
    slots: torch.Tensor  # [T] pool slot of each new token
    write: OscarWriteMeta  # [T] positions, rows, sequence ends

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens_host, default=0)


def update_ring_validity(pool: OscarKVPool, rows: torch.Tensor, prefix_lens: torch.Tensor,
                         seq_ends: torch.Tensor, owners: torch.Tensor) -> None:
    """Device-side row bookkeeping of one extend batch (see module doc)."""
    vf = pool.index.ring_valid_from
    reset = (pool.ring_owner[rows] != owners) | (pool.ring_end[rows] != prefix_lens)
    vf[rows] = torch.where(reset, prefix_lens.to(vf.dtype), vf[rows])
    pool.ring_owner[rows] = owners
    pool.ring_end[rows] = seq_ends


def rows_in_use(req_to_token_pool) -> Optional[list[int]]:
    """The req_to_token rows SGLang's pool has handed out (row 0 is its padding row), from
    its host free list; None for a pool without one."""
    free = getattr(req_to_token_pool, "free_slots", None)
    if free is None:
        return None
    free = set(free)
    return [r for r in range(1, req_to_token_pool.req_to_token.shape[0]) if r not in free]


def plan_extend(pool: OscarKVPool, fb, live_rows: Optional[Callable[[], Optional[list[int]]]] = None) -> ExtendPlan:
    """Build an extend batch's plan and apply its per-batch state updates (sinks, ring
    validity). Reads ``batch_size, req_pool_indices, extend_prefix_lens,
    extend_seq_lens, extend_*_lens_cpu, out_cache_loc, positions, rids`` of ``fb``;
    ``live_rows()``: the rows of live requests, whose sink slots new sequences must not take
    (None: plain round-robin)."""
    bs = fb.batch_size
    prefix_cpu = fb.extend_prefix_lens_cpu
    ext_cpu = fb.extend_seq_lens_cpu
    if prefix_cpu is None or ext_cpu is None:  # gpu-only batches carry no host lists
        prefix_cpu = fb.extend_prefix_lens[:bs].tolist()
        ext_cpu = fb.extend_seq_lens[:bs].tolist()
    prefix_cpu, ext_cpu = list(prefix_cpu)[:bs], list(ext_cpu)[:bs]
    device = fb.out_cache_loc.device
    num_tokens = sum(ext_cpu)
    rows = fb.req_pool_indices[:bs].long()
    prefix = fb.extend_prefix_lens[:bs].long()
    ext = fb.extend_seq_lens[:bs].long()
    seq_ends = prefix + ext
    qo_indptr = torch.nn.functional.pad(torch.cumsum(ext, 0), (1, 0))
    slots = fb.out_cache_loc[:num_tokens]
    positions = fb.positions[:num_tokens]
    if positions.dim() != 1:
        raise NotImplementedError("oscar backend: multi-axis (M-RoPE) positions are not supported")
    write = OscarWriteMeta(
        positions=positions,
        rows=torch.repeat_interleave(rows, ext, output_size=num_tokens),
        seq_ends=torch.repeat_interleave(seq_ends, ext, output_size=num_tokens))

    # Sinks: every sequence that starts at position 0 here owns a fresh first page.
    starts, first_tokens = 0, []
    for p, e in zip(prefix_cpu, ext_cpu):
        if p == 0 and e > 0:
            first_tokens.append(starts)
        starts += e
    if first_tokens:
        first = torch.tensor(first_tokens, dtype=torch.int64).to(device, non_blocking=True)
        rows_live = live_rows() if live_rows is not None else None
        in_use = None if rows_live is None else sink_slots_in_use(
            pool.index, pool.req_to_token, torch.tensor(rows_live, dtype=torch.int64).to(device, non_blocking=True))
        assign_sink_slots(pool.index, slots[first], pool.plan.num_sink_slots, in_use)
        pool.index.sink_slot_of_page[0] = -1  # page 0 is SGLang's padding page: never a sink

    rids: Sequence[Optional[str]] = fb.rids if fb.rids is not None else [None] * bs
    owners = torch.tensor([rid_hash(r) for r in list(rids)[:bs]], dtype=torch.int64)
    update_ring_validity(pool, rows, prefix, seq_ends, owners.to(device, non_blocking=True))
    return ExtendPlan(rows=rows, prefix_lens=prefix, qo_indptr=qo_indptr,
                      prefix_lens_host=[int(p) for p in prefix_cpu], extend_lens_host=[int(e) for e in ext_cpu],
                      slots=slots, write=write)


def choose_prefix_read(choice: str, device: torch.device, deterministic: bool = False):
    """Resolve --oscar-extend-prefix (settings.resolve_extend_prefix) on ``device`` and build
    FlashInfer's extend where it is the read: ("int2" | "bf16" | "flashinfer", the FlashInfer
    extend or None)."""
    cuda = torch.device(device).type == "cuda"
    fi_extend, fi_error = None, None
    # build FlashInfer's extend where the read would be FlashInfer if it imports
    if resolve_extend_prefix(choice, cuda, True, deterministic) == "flashinfer" and cuda:
        try:
            fi_extend = api.make_flashinfer_extend(device)
        except ImportError as e:
            fi_error = e
    read = resolve_extend_prefix(choice, cuda, fi_extend is not None, deterministic)
    if read == "flashinfer" and cuda and fi_extend is None:
        raise RuntimeError(f"--oscar-extend-prefix flashinfer needs flashinfer ({fi_error})")
    if fi_error is not None:
        logger.warning("oscar: flashinfer does not import (%s); prefill reads cached prefixes as INT2", fi_error)
    return read, fi_extend


class OscarAttnBackend(AttentionBackend):
    """The ``--attention-backend oscar`` backend (needs ``--kv-cache-dtype oscar_int2``).

    The oscar kernels read ``req_to_token`` directly, so no kv-index metadata or CUDA-graph
    index buffers are built; SGLang's graph runners see the AttentionBackend interface
    (metadata out of and in the graph, ``init_cuda_graph_state``, the padding fill value)."""

    # extend batches read their host length lists; decode reads no host sequence lengths
    needs_cpu_seq_lens: bool = False

    @classmethod
    def from_model_runner(cls, model_runner) -> "OscarAttnBackend":
        """The backend SGLang's registry builds for a model runner, with the oscar settings
        of its server arguments."""
        sa, mc = model_runner.server_args, model_runner.model_config
        deterministic = bool(sa.enable_deterministic_inference)
        return cls(model_runner.token_to_kv_pool, model_runner.req_to_token_pool,
                   num_q_heads=mc.get_max_num_attention_heads() // model_runner.ps.attn_tp_size,
                   extend_prefix=oscar_settings(sa).extend_prefix, deterministic=deterministic,
                   context_len=mc.context_len)

    def __init__(self, pool, req_to_token_pool, *, num_q_heads: int,
                 extend_prefix: str = DEFAULT_EXTEND_PREFIX, deterministic: bool = False,
                 context_len: int = 0):
        """``pool``: the OscarKVPool; ``req_to_token_pool``: SGLang's request pool (its host
        free list gives the rows of live requests, whose sink slots new sequences must not
        take; see plan_extend); ``num_q_heads``: query heads on this rank; ``extend_prefix``:
        --oscar-extend-prefix; ``deterministic`` (--enable-deterministic-inference): a
        request's outputs do not depend on the batch around it: batch-invariant decode splits
        for ``context_len`` tokens (triton_decode.batch_invariant_config) and the INT2
        prefix read."""
        if not isinstance(pool, OscarKVPool):
            raise ValueError("--attention-backend oscar needs --kv-cache-dtype oscar_int2 "
                             f"(the KV pool is {type(pool).__name__})")
        # SGLang's forward context reads the pools from the backend (get_token_to_kv_pool)
        self.token_to_kv_pool = self.pool = pool
        self.req_to_token_pool = req_to_token_pool
        self._extend_plan: Optional[ExtendPlan] = None
        self._checked_layers: set[int] = set()
        self.prefix_read, self._fi_extend = choose_prefix_read(
            extend_prefix, pool.req_to_token.device, deterministic)
        # FlashInfer's prefill over the materialised prefix is planned once per extend batch,
        # on its first layer
        self._fi_planned = None
        # Decode scratch for the largest possible batch (one per request row), allocated
        # once here, before CUDA-graph capture: decode then allocates nothing.
        self._decode_workspace = None
        if api.use_triton(pool.req_to_token):
            rows = pool.req_to_token.shape[0]
            config = api.batch_invariant_decode_config(context_len, rows, num_q_heads, pool.head_dim) \
                if deterministic else None
            self._decode_workspace = api.make_decode_workspace(
                rows, num_q_heads, pool.plan.num_kv_heads, pool.head_dim, pool.req_to_token.device, config)

    def _live_rows(self) -> Optional[list[int]]:
        return rows_in_use(self.req_to_token_pool) if self.req_to_token_pool is not None else None

    # -- metadata ---------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return
        if mode.is_decode():
            self.init_forward_metadata_in_graph(forward_batch)
            return
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            self._extend_plan = plan_extend(self.pool, forward_batch, self._live_rows)
            return
        raise NotImplementedError(f"oscar backend: forward mode {mode.name} is not supported "
                                  "(speculative decoding is not supported with oscar_int2)")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError("oscar backend: CUDA graphs are supported for decode only "
                                      "(use the default breakable prefill graphs or disable them)")

    def init_forward_metadata_in_graph(self, forward_batch):
        if forward_batch.forward_mode.is_decode():
            # Static graph buffers in, persistent tensor out: recordable, no sync.
            self.pool.ring_end[forward_batch.req_pool_indices] = forward_batch.seq_lens

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        """Nothing to pre-allocate: decode reads the runner's static batch buffers."""

    def get_cuda_graph_seq_len_fill_value(self):
        """Padded graph rows decode one token of SGLang's padding row (row 0, slot 0)."""
        return 1

    # -- forward ----------------------------------------------------------------------

    def _check_layer(self, layer, kwargs) -> None:
        for name in ("sinks", "score_mod", "aux_tensors", "q_rope", "k_rope"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"oscar backend: attention with {name} is not supported")
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
        if problem:
            raise NotImplementedError(f"oscar backend: layer {layer.layer_id} uses {problem}, "
                                      "which the OSCAR kernels do not support")
        self._checked_layers.add(layer.layer_id)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._check_layer(layer, kwargs)
        if k is None or v is None or not save_kv_cache:
            raise NotImplementedError("oscar backend: the model must hand k and v to the "
                                      "backend to store (save_kv_cache=False is not supported)")
        plan = self._extend_plan
        t, hq, d = q.shape[0], layer.tp_q_head_num, layer.qk_head_dim
        if plan is None or t != plan.slots.shape[0]:
            raise RuntimeError(f"oscar backend: extend with {t} tokens but the batch plan has "
                               f"{None if plan is None else plan.slots.shape[0]}")
        out = getattr(forward_batch, "_attn_output", None)
        o = out if out is not None else q.new_empty((t, hq * d))
        pool = self.pool
        k = k.view(t, layer.tp_k_head_num, d)
        v = v.view(t, layer.tp_v_head_num, d)
        k_rot = torch.empty(k.shape, dtype=torch.bfloat16, device=k.device)
        v_rot = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
        pool.set_kv_buffer(layer, plan.slots, k, v, oscar_meta=plan.write, write_ring=False,
                           rotated_out=(k_rot, v_rot))
        if self._fi_extend is not None and (self._fi_planned is None or self._fi_planned[0] is not plan
                                            or self._fi_planned[1] != layer.scaling):
            self._fi_extend.plan(plan.prefix_lens_host, plan.extend_lens_host, hq, layer.tp_k_head_num, d,
                                 layer.scaling)
            self._fi_planned = (plan, layer.scaling)
        api.extend_attention(q.view(t, hq, d), k_rot, v_rot, pool.layer_cache(layer.layer_id),
                             pool.index, pool.layer_rotation(layer.layer_id), pool.req_to_token,
                             plan.rows, plan.prefix_lens, plan.qo_indptr, plan.max_extend_len,
                             layer.scaling, out=o.view(t, hq, d),
                             prefix_read="int2" if self.prefix_read == "int2" else "bf16",
                             prefix_lens_host=plan.prefix_lens_host, flashinfer=self._fi_extend)
        pool.set_kv_buffer(layer, plan.slots, k, v, oscar_meta=plan.write, write_int2=False,
                           write_ring=True)
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._check_layer(layer, kwargs)
        if k is None or v is None or not save_kv_cache:
            raise NotImplementedError("oscar backend: the model must hand k and v to the "
                                      "backend to store (save_kv_cache=False is not supported)")
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, hq * d)
        bs = q.shape[0]
        o = torch.empty_like(q)
        rows, seq_lens = forward_batch.req_pool_indices, forward_batch.seq_lens
        pool = self.pool
        pool.set_kv_buffer(layer, forward_batch.out_cache_loc,
                           k.view(bs, layer.tp_k_head_num, d), v.view(bs, layer.tp_v_head_num, d),
                           oscar_meta=OscarWriteMeta(forward_batch.positions, rows, seq_lens))
        api.decode_attention(q.view(bs, hq, d), pool.layer_cache(layer.layer_id), pool.index,
                             pool.layer_rotation(layer.layer_id), pool.req_to_token, rows,
                             seq_lens, layer.scaling, out=o.view(bs, hq, d),
                             workspace=self._decode_workspace)
        return o
