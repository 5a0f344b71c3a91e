"""HybridAttention: attention over a hybrid INT2/BF16 cache, planned per batch, run per layer.

In the style of FlashInfer's wrappers::

    attn = HybridAttention(cache, num_q_heads, sm_scale, prefix_read="flashinfer")  # once
    attn.plan_decode(rows, seq_lens, positions, slots)        # once per decode batch
    o = attn.decode(layer, q, k, v)                           # per layer
    attn.plan_extend(rows, prefix_lens, extend_lens, positions, slots,
                     prefix_lens_host=..., extend_lens_host=..., owners=...)  # per extend batch
    o = attn.extend(layer, q, k, v)                           # per layer
    attn.plan_verify(rows, prefix_lens, positions, slots,
                     num_draft_tokens=T, parents=...)          # per speculative verify batch
    o = attn.verify(layer, q, k, v)                           # per layer
    attn.commit(accept_index) / attn.commit(accept_lens=...)  # once, after acceptance

A plan resolves what a batch's layers share (triton_decode.DecodeLaunch,
triton_extend.ExtendLaunch or FlashInfer's plan, the store's per-token metadata) and applies
the batch's bookkeeping to the cache index: sink slots for the sequences that start at
position 0 (never one a live request reads, never on ``padding_page``) and ring validity
(hybrid_cache.update_ring_validity). A layer call then runs the whole protocol:

    decode: store (INT2 + sinks + ring) -> attention over n = seq_len positions
    extend: store (INT2 + sinks, keeping the rotated BF16 k', v') -> attention over the
            hybrid prefix and causally over the new tokens -> store the ring cells
            (after attention: earlier would overwrite the prefix window it reads)
    verify: store INT2 only (no sinks, no ring) and stage the drafts' K/V -> attention of
            each draft as decode would see it (below); commit then writes the accepted
            drafts' sinks and ring cells from the staged K/V

Speculative decoding (issue 49). A verify batch holds T draft tokens per request (a chain or
a tree, :mod:`oscar_kernels.speculative`), some of which will be rejected. Draft i at depth d
attends to what decode at length n + d + 1 would read if its ancestors were accepted: the
prefix by the read rule with that window end (ring from max(n + d + 1 - W, valid_from), so a
prefix position the window has left is read as INT2, as decode would), and its ancestors
(tree mask) as BF16 where decode reads the ring or a sink, else as their INT2.
reference.reference_verify states it exactly. The verify writes the drafts' INT2 cells at
their slots (a cell is per slot: a rejected draft's slot is past the accepted length or freed,
and tree nodes at one position have distinct slots), but no sink and no ring cell: those are
keyed by position, which tree drafts share and rejected drafts would take from the accepted
ones (and the ring still serves the prefix window). The drafts' unrotated K/V are staged per
layer in a workspace sized at construction (max_batch x max_draft_tokens tokens per layer);
``commit`` re-runs the store on the accepted ones (same kernel, same input: the same BF16
copies decode writes) with INT2 off and sinks + ring on, at positions n + k, and advances the
rows' ring end. After a tree verify SGLang moves the accepted nodes' cells to their final
slots (hybrid_cache.move_int2_cells); move and commit commute (slots vs positions). The cache
is then exactly what decode of the accepted tokens writes: the same INT2 at their final
slots, the same sinks, the same ring cells for every position the read rule reads. The Triton
path runs the verify attention through triton_decode, one virtual request per draft
(verify_decode). CUDA graphs: commit, the verify's store and staging are device ops of fixed
shape; plan_verify allocates (tree mask, virtual rows), so a captured verify needs those in a
preallocated workspace first. No host sync anywhere on the Triton path.

Tensors (T new tokens of the batch, B requests, H KV heads, Hq query heads, D head_dim;
integer tensors any int dtype on the cache's device):
  rows [B] req_to_token rows; seq_lens [B] (decode) cached length incl. the new token;
  prefix_lens [B] / extend_lens [B] (extend) cached prefix and new tokens per request;
  positions [T], slots [T] position and pool slot of each new token (request order);
  owners [B] int64, the caller's id of each request (the ring of a row that another id
  wrote restarts); q [T, Hq, D], k/v [T, H, D] bf16, unrotated (last dim contiguous);
  outputs o [T, Hq, D] in q's dtype (or ``out``'s), unrotated.
Cache tensors: hybrid_cache.HybridLayerCache / HybridCacheIndex / LayerRotation.

Dispatch: the Triton kernels (triton_store, triton_decode, triton_extend, flashinfer_extend)
run when the cache is on CUDA, or everywhere when OSCAR_FORCE_TRITON=1 (CPU tests under
TRITON_INTERPRET=1); otherwise every call takes the PyTorch reference (oscar_kernels.reference):
the same protocol and bookkeeping, the oracle of the tests. The Triton modules are imported
only on the Triton path, so the reference path never needs a working Triton.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch

from . import reference as ref
from .hybrid_cache import (HybridCache, allocate_index, allocate_layer, assign_sink_slots, sink_slots_in_use,
                           update_ring_validity)
from .speculative import accept_index_from_lens, chain_parents, commit_tokens, draft_ancestors

PREFIX_READS = ("int2", "bf16", "flashinfer")
def use_triton(t: torch.Tensor) -> bool:
    """True when a cache on ``t``'s device runs the Triton kernels."""
    return t.is_cuda or os.environ.get("OSCAR_FORCE_TRITON", "0") == "1"


def flashinfer_import_error() -> ImportError | None:
    """Why flashinfer (FlashInfer's prefill, a GPU dependency of sglang) does not import, or None."""
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        return e
    return None


WARM_UP_ROWS = 5  # requests of the warm-up's decode: above triton_decode.SPLIT_MERGE_MAX_BATCH (both merges)


@dataclass(frozen=True)
class _DecodeBatch:
    rows: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    launch: object  # triton_decode.DecodeLaunch, None on the reference path


@dataclass(frozen=True)
class _ExtendBatch:
    rows: torch.Tensor
    prefix_lens: torch.Tensor
    qo_indptr: torch.Tensor  # [B+1]
    max_extend_len: int
    slots: torch.Tensor
    positions: torch.Tensor
    token_rows: torch.Tensor  # [T] request row of each new token
    token_seq_ends: torch.Tensor  # [T] its request's length after this batch
    k_rot: torch.Tensor  # bf16 [T, H, D]: the store's rotated k', v' for the attention
    v_rot: torch.Tensor
    launch: object  # triton_extend.ExtendLaunch (Triton path without FlashInfer), else None
    flashinfer: bool  # FlashInfer's prefill, planned for this batch, does the attention


@dataclass(frozen=True)
class _VerifyBatch:
    rows: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # [B*T]
    slots: torch.Tensor  # [B*T]
    num_draft_tokens: int  # T
    ancestors: torch.Tensor  # bool [B, T, T] (speculative.draft_ancestors)
    token_rows: torch.Tensor  # [B*T] request row of each draft
    token_seq_ends: torch.Tensor  # [B*T] position + 1 (the store's seq_end; no ring written)
    k_rot: torch.Tensor  # bf16 [B*T, H, D] views of the workspace: the store's rotated k', v'
    v_rot: torch.Tensor
    view: object  # verify_decode.VerifyView (Triton path), else None
    launch: object  # triton_decode.DecodeLaunch of the B*T virtual decode requests (Triton path), else None


class HybridAttention:
    """See the module doc. ``cache``: the hybrid cache of every layer; ``num_q_heads``: query
    heads (Hq, a multiple of the cache's H); ``sm_scale``: the attention scale of every layer;
    ``max_batch``: most requests of a decode batch (default: the cache's request rows);
    ``prefix_read``: how extend reads cached prefixes ("int2": unpacked inside the attention;
    "bf16" / "flashinfer": materialised, then our BF16 attention / FlashInfer's prefill, which
    off CUDA is "bf16"); ``decode_config``: a triton_decode.DecodeConfig
    (e.g. batch_invariant_config); ``padding_page``: a page that never gets BF16 sinks
    (SGLang's padding page 0, which padded batches write); ``learned_sinks``: the model's layers
    pass learned sink logits to decode/extend (gpt-oss): FlashInfer's prefill has no such term,
    so the "flashinfer" prefix read becomes "bf16"; ``max_draft_tokens``: draft tokens per
    request of a speculative verify (0: no verify), which sizes the staging workspace:
    2 x layers x max_batch x max_draft_tokens x H x D bf16 (plus one layer's rotated copies);
    ``key_debias``: every read of an INT2 key subtracts half its rounding-noise variance from
    its logit (reference module doc; opt-in); FlashInfer's prefill has no such term, so the
    "flashinfer" prefix read becomes "bf16" (whose materialised rows carry the keys' scales)."""

    def __init__(self, cache: HybridCache, num_q_heads: int, sm_scale: float, *, max_batch: int | None = None,
                 prefix_read: str = "int2", decode_config=None, padding_page: int | None = None,
                 learned_sinks: bool = False, max_draft_tokens: int = 0, key_debias: bool = False):
        if prefix_read not in PREFIX_READS:
            raise ValueError(f"prefix_read {prefix_read!r}: choose from {', '.join(PREFIX_READS)}")
        layer = cache.layers[0]
        if num_q_heads % layer.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {layer.num_kv_heads} KV heads")
        self.cache, self.num_q_heads, self.sm_scale = cache, num_q_heads, float(sm_scale)
        self.key_debias = bool(key_debias)
        self.padding_page = padding_page
        device = cache.req_to_token.device
        self.triton = use_triton(cache.req_to_token)
        self.flashinfer = None
        if prefix_read == "flashinfer" and device.type == "cuda" and not learned_sinks and not key_debias:
            from .flashinfer_extend import FlashInferExtend
            self.flashinfer = FlashInferExtend(device)
        self.prefix_read = "int2" if prefix_read == "int2" else "bf16"  # the Triton / reference read
        self.workspace = None
        if self.triton:  # decode scratch for the largest batch, before any CUDA-graph capture
            from .triton_decode import DecodeWorkspace
            self.workspace = DecodeWorkspace(max_batch or cache.req_to_token.shape[0], num_q_heads,
                                             layer.num_kv_heads, layer.head_dim, device, decode_config)
        # tiles only (never numerics): the G = D tiles where every layer has one group per head
        self._groups_span_head = all(min(lc.key_group_size, lc.value_group_size) >= lc.head_dim
                                     for lc in cache.layers)
        self._max_key_groups = max(lc.head_dim // lc.key_group_size for lc in cache.layers)  # keys' groups may differ per layer
        self._decode: _DecodeBatch | None = None
        self._extend: _ExtendBatch | None = None
        self._verify: _VerifyBatch | None = None
        self.max_draft_tokens = int(max_draft_tokens)
        self.max_verify_tokens = (max_batch or cache.req_to_token.shape[0]) * self.max_draft_tokens
        self.draft_kv = self.draft_rot = None
        if self.max_verify_tokens:  # [layer, K/V, token, H, D]: the drafts' unrotated K/V, and their k', v'
            self.draft_kv = torch.empty(len(cache.layers), 2, self.max_verify_tokens, layer.num_kv_heads,
                                        layer.head_dim, dtype=torch.bfloat16, device=device)
            self.draft_rot = torch.empty(2, self.max_verify_tokens, layer.num_kv_heads, layer.head_dim,
                                         dtype=torch.bfloat16, device=device)
        self.verify_workspace = None
        if self.triton and self.max_verify_tokens:  # the verify's virtual decode batch (verify_decode)
            from .triton_decode import DecodeWorkspace
            self.verify_workspace = DecodeWorkspace(self.max_verify_tokens, num_q_heads, layer.num_kv_heads,
                                                    layer.head_dim, device, decode_config)

    # -- plans (once per batch) -------------------------------------------------------

    def plan_decode(self, rows: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """Plan a decode batch (one new token per request). Device ops only (the ring end
        of each row), no host sync: recordable in a CUDA graph with static inputs."""
        b = rows.shape[0]
        launch = self.workspace.launch(b, self._groups_span_head) if self.workspace is not None and b else None
        self._decode = _DecodeBatch(rows, seq_lens, positions, slots, launch)
        self.cache.index.ring_end[rows] = seq_lens.to(self.cache.index.ring_end.dtype)

    def plan_extend(self, rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                    positions: torch.Tensor, slots: torch.Tensor, *, prefix_lens_host: Sequence[int],
                    extend_lens_host: Sequence[int], owners: torch.Tensor,
                    live_rows: torch.Tensor | None = None) -> None:
        """Plan an extend batch and apply its bookkeeping (sinks, ring validity).
        ``*_host``: the same lengths as host ints (no device sync); ``live_rows``: rows of
        the live requests, whose sink slots new sequences must not take (None: round-robin)."""
        cache, index = self.cache, self.cache.index
        layer = cache.layers[0]
        prefix_host, ext_host = [int(n) for n in prefix_lens_host], [int(n) for n in extend_lens_host]
        t = sum(ext_host)
        if slots.shape != (t,) or positions.shape != (t,):
            raise ValueError(f"slots/positions must have shape ({t},) (the extend lengths' sum), got "
                             f"{tuple(slots.shape)}/{tuple(positions.shape)}")
        prefix, ext = prefix_lens.long(), extend_lens.long()
        seq_ends = prefix + ext
        # sinks: every sequence that starts at position 0 here owns a fresh first page
        starts = accumulate(ext_host, initial=0)  # each request's first new token
        firsts = [s for s, p, e in zip(starts, prefix_host, ext_host) if p == 0 and e > 0]
        if firsts:
            first = torch.tensor(firsts, dtype=torch.int64).to(slots.device, non_blocking=True)
            in_use = None if live_rows is None else sink_slots_in_use(index, cache.req_to_token, live_rows)
            assign_sink_slots(index, slots[first], layer.k_sink.shape[0], in_use)
            if self.padding_page is not None:
                index.sink_slot_of_page[self.padding_page] = -1
        update_ring_validity(index, rows.long(), prefix, seq_ends, owners)
        max_ext = max(ext_host, default=0)
        fi = self.flashinfer is not None
        if fi:
            self.flashinfer.plan(prefix_host, ext_host, self.num_q_heads, layer.num_kv_heads, layer.head_dim,
                                 self.sm_scale)
            fi = self.flashinfer.fits
        launch = None
        if self.triton and not fi and t and max_ext:
            from .triton_extend import plan_extend_launch
            launch = plan_extend_launch(prefix, prefix_host, max_ext, t, self.num_q_heads, layer.num_kv_heads,
                                        layer.head_dim, self.prefix_read,
                                        self._max_key_groups if self.key_debias else 0)
        k_rot = torch.empty(t, layer.num_kv_heads, layer.head_dim, dtype=torch.bfloat16, device=slots.device)
        self._extend = _ExtendBatch(
            rows=rows, prefix_lens=prefix, qo_indptr=torch.nn.functional.pad(torch.cumsum(ext, 0), (1, 0)),
            max_extend_len=max_ext, slots=slots, positions=positions,
            token_rows=torch.repeat_interleave(rows, ext, output_size=t),
            token_seq_ends=torch.repeat_interleave(seq_ends, ext, output_size=t),
            k_rot=k_rot, v_rot=torch.empty_like(k_rot), launch=launch, flashinfer=fi)

    def plan_verify(self, rows: torch.Tensor, prefix_lens: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, *, num_draft_tokens: int, parents: torch.Tensor | None = None) -> None:
        """Plan a speculative verify batch: B running requests (prefix_lens[b] >= 1 cached
        positions) with T = ``num_draft_tokens`` drafts each, token t = b * T + i at
        positions[t] = prefix_lens[b] + depth and pool slot slots[t] (positions, slots [B*T]).
        ``parents`` int [B, T]: each draft's parent (speculative module doc), None: a chain.
        Device ops only, no host sync: no sink slot is assigned and the ring is left alone
        until :meth:`commit`. The Triton path also builds the verify's virtual decode batch
        (verify_decode.plan_verify_view: allocates, sized by the batch)."""
        b, t = rows.shape[0], int(num_draft_tokens)
        if positions.shape != (b * t,) or slots.shape != (b * t,):
            raise ValueError(f"positions/slots must have shape ({b * t},) (requests x draft tokens), got "
                             f"{tuple(positions.shape)}/{tuple(slots.shape)}")
        if t > self.max_draft_tokens or b * t > self.max_verify_tokens:
            raise ValueError(f"a verify of {b} requests x {t} drafts exceeds the workspace "
                             f"(max_draft_tokens={self.max_draft_tokens}, {self.max_verify_tokens} tokens)")
        if parents is None:
            parents = chain_parents(b, t, rows.device)
        elif parents.shape != (b, t):
            raise ValueError(f"parents must have shape ({b}, {t}), got {tuple(parents.shape)}")
        ancestors = draft_ancestors(parents)
        view = launch = None
        if self.triton and b * t:
            from .verify_decode import plan_verify_view
            lc = self.cache.layers[0]
            view = plan_verify_view(self.cache.index, self.cache.req_to_token, rows, prefix_lens, positions, slots,
                                    ancestors, lc.sink_tokens, lc.recent_window)
            launch = self.verify_workspace.launch(b * t, self._groups_span_head)
        self._verify = _VerifyBatch(
            rows=rows, prefix_lens=prefix_lens.long(), positions=positions, slots=slots, num_draft_tokens=t,
            ancestors=ancestors, token_rows=rows.repeat_interleave(t, output_size=b * t),
            token_seq_ends=positions.long() + 1, k_rot=self.draft_rot[0, :b * t], v_rot=self.draft_rot[1, :b * t],
            view=view, launch=launch)

    def verify(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store the drafts' INT2 cells of layer ``layer`` (no sinks, no ring), stage their K/V
        for :meth:`commit`, attend (module doc): o [B*T, Hq, D]. ``sinks``: as in :meth:`decode`.
        Triton path: triton_decode over the batch's virtual decode requests (verify_decode),
        after composing this layer's virtual sinks and rings; reference path:
        reference.reference_verify (a per-draft loop with host reads)."""
        plan = self._verify
        if plan is None or q.shape[0] != plan.slots.shape[0]:
            raise RuntimeError(f"verify of {q.shape[0]} tokens, but the planned verify batch has "
                               f"{None if plan is None else plan.slots.shape[0]}")
        lc, rot, index, r2t = self._layer(layer)
        t = q.shape[0]
        self.draft_kv[layer, 0, :t].copy_(k)
        self.draft_kv[layer, 1, :t].copy_(v)
        k_rot, v_rot = self._store(layer, k, v, plan.slots, plan.positions, plan.token_rows, plan.token_seq_ends,
                                   write_ring=False, write_sink=False, rotated_out=(plan.k_rot, plan.v_rot))
        if self.triton:
            from .triton_decode import triton_decode
            from .verify_decode import verify_layer_view
            view = plan.view
            return triton_decode(q, verify_layer_view(view, lc, k_rot, v_rot), view.index, rot, view.req_to_token,
                                 view.rows, view.seq_lens, self.sm_scale, out, launch=plan.launch, sinks=sinks,
                                 key_debias=self.key_debias)
        o_rot = ref.reference_verify(_rotate(q, rot.k_rot), k_rot, v_rot, lc, index, r2t, plan.rows,
                                     plan.prefix_lens, plan.positions, plan.slots, plan.ancestors, self.sm_scale,
                                     sinks, self.key_debias)
        return _output(o_rot, rot, q, out)

    def commit(self, accept_index: torch.Tensor | None = None, *, accept_lens: torch.Tensor | None = None) -> None:
        """After acceptance of the planned verify batch: write the accepted drafts' BF16 sinks
        and ring cells in every layer from the staged K/V, as decode of them would have, and
        set the rows' ring end to prefix + accepted. ``accept_index`` int [B, A]: accepted
        drafts in path order, -1 after the last (speculative module doc); or ``accept_lens``
        int [B] for a chain (its first accept_lens[b] drafts). Device ops only, fixed shapes
        (no host sync): recordable in a CUDA graph. The INT2 cells are the verify's: in place
        for a chain; a tree's are moved to their final slots by hybrid_cache.move_int2_cells
        (before or after this call)."""
        plan = self._verify
        if plan is None:
            raise RuntimeError("commit without a planned verify batch")
        b, t = plan.rows.shape[0], plan.num_draft_tokens
        if accept_index is None:
            if accept_lens is None:
                raise ValueError("commit needs accept_index or accept_lens")
            accept_index = accept_index_from_lens(accept_lens, t)
        if accept_index.shape[0] != b or accept_index.shape[1] > t:
            raise ValueError(f"accept_index must have shape ({b}, <= {t}), got {tuple(accept_index.shape)}")
        lc0 = self.cache.layers[0]
        tok, pos, ends, new_lens = commit_tokens(plan.prefix_lens, accept_index.long(), t, lc0.sink_tokens,
                                                 lc0.recent_window)
        rows = plan.rows.long().repeat_interleave(accept_index.shape[1], output_size=tok.shape[0])
        for layer in range(len(self.cache.layers)):
            k, v = self.draft_kv[layer, 0][tok], self.draft_kv[layer, 1][tok]
            self._store(layer, k, v, pos, pos, rows, ends, write_int2=False, write_ring=True, write_sink=True)
        index = self.cache.index
        index.ring_end[plan.rows.long()] = new_lens.to(index.ring_end.dtype)

    # -- runs (once per layer) --------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store the batch's new tokens in layer ``layer`` and attend: o [B, Hq, D]. ``sinks``:
        the layer's learned sink logits [Hq] (natural units, beside sm_scale * q.k), or None."""
        plan = self._decode
        if plan is None or q.shape[0] != plan.rows.shape[0]:
            raise RuntimeError(f"decode of {q.shape[0]} requests, but the planned decode batch has "
                               f"{None if plan is None else plan.rows.shape[0]}")
        lc, rot, index, r2t = self._layer(layer)
        self._store(layer, k, v, plan.slots, plan.positions, plan.rows, plan.seq_lens)
        if self.triton:
            from .triton_decode import triton_decode
            return triton_decode(q, lc, index, rot, r2t, plan.rows, plan.seq_lens, self.sm_scale, out,
                                 launch=plan.launch, sinks=sinks, key_debias=self.key_debias)
        o_rot = ref.reference_decode(_rotate(q, rot.k_rot), lc, index, r2t, plan.rows, plan.seq_lens, self.sm_scale,
                                     sinks, self.key_debias)
        return _output(o_rot, rot, q, out)

    def extend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store the batch's new tokens in layer ``layer``, attend, write their ring cells:
        o [T, Hq, D]. ``sinks``: as in :meth:`decode`."""
        plan = self._extend
        if plan is None or q.shape[0] != plan.slots.shape[0]:
            raise RuntimeError(f"extend of {q.shape[0]} tokens, but the planned extend batch has "
                               f"{None if plan is None else plan.slots.shape[0]}")
        if sinks is not None and plan.flashinfer:
            raise RuntimeError("learned sinks need HybridAttention(..., learned_sinks=True): FlashInfer's "
                               "prefill has no sink term")
        lc, rot, index, r2t = self._layer(layer)
        meta = (plan.slots, plan.positions, plan.token_rows, plan.token_seq_ends)
        k_rot, v_rot = self._store(layer, k, v, *meta, write_ring=False, rotated_out=(plan.k_rot, plan.v_rot))
        if plan.flashinfer:
            o = self.flashinfer.run(q, k_rot, v_rot, lc, index, rot, r2t, plan.rows, plan.prefix_lens, out=out)
        elif self.triton:
            from .triton_extend import triton_extend
            o = triton_extend(q, k_rot, v_rot, lc, index, rot, r2t, plan.rows, plan.prefix_lens, plan.qo_indptr,
                              plan.max_extend_len, self.sm_scale, out, launch=plan.launch, sinks=sinks,
                              key_debias=self.key_debias)
        else:
            o_rot = ref.reference_extend(_rotate(q, rot.k_rot), k_rot, v_rot, lc, index, r2t, plan.rows,
                                         plan.prefix_lens, plan.qo_indptr, self.sm_scale, sinks, self.key_debias)
            o = _output(o_rot, rot, q, out)
        self._store(layer, k, v, *meta, write_int2=False, write_ring=True)
        return o

    def _store(self, layer: int, k, v, slots, positions, rows, seq_ends, *, write_int2=True, write_ring=True,
               rotated_out=None, write_sink=None):
        """Rotate, clip, quantise, pack new tokens; write sinks and ring cells (the rules of
        reference.reference_store); returns ``rotated_out`` (k', v' unclipped bf16 [T, H, D]) if given."""
        lc, rot, index, r2t = self._layer(layer)
        if self.triton:
            from .triton_store import triton_store
            triton_store(lc, index, rot, r2t, k, v, slots, positions, rows, seq_ends, write_int2, write_ring,
                         rotated_out, write_sink)
        else:
            k_rot, v_rot = ref.reference_store(lc, index, rot, r2t, k, v, slots, positions, rows, seq_ends,
                                               write_int2, write_ring, write_sink)
            if rotated_out is not None:
                rotated_out[0].copy_(k_rot)
                rotated_out[1].copy_(v_rot)
        return rotated_out

    # -- warm-up ----------------------------------------------------------------------

    def warm_up(self) -> float:
        """Run every default kernel path once on a private cache of this cache's layout (one
        layer per distinct INT2 layout, WARM_UP_ROWS requests), so that Triton's and FlashInfer's just-in-time compiles
        happen now, not in a user's first request: a prefill, a second chunk that reads its
        cached prefix, a decode step of every request (the large-batch merge) and of one (the
        small-batch merge). The real cache is not touched. Returns the seconds it took."""
        start = time.perf_counter()
        lc, index = self.cache.layers[0], self.cache.index
        page, s, w = index.page_size, lc.sink_tokens, lc.recent_window
        n = min(WARM_UP_ROWS, self.workspace.max_batch) if self.workspace is not None else WARM_UP_ROWS
        prefix = -(-(s + w + 64) // page) * page  # past the sinks and the ring: an INT2 history to read
        row_len = prefix + max(page, 64)
        dev = self.cache.req_to_token.device
        first_of_groups = {}  # key group size -> the first layer with it (each compiles its own kernels)
        for i, layer in enumerate(self.cache.layers):
            first_of_groups.setdefault(layer.key_group_size, i)
        private = HybridCache(
            [allocate_layer(n * row_len, lc.num_kv_heads, lc.head_dim, gk, s, w, n, n,
                            lc.k_scales.dtype, dev, value_group_size=lc.value_group_size) for gk in first_of_groups],
            [self.cache.rotations[i] for i in first_of_groups.values()], allocate_index(n * row_len, page, n, n, dev),
            torch.arange(n * row_len, dtype=torch.int32, device=dev).view(n, row_len))
        real = self.cache
        self.cache = private
        try:
            g = torch.Generator(device="cpu").manual_seed(0)

            def step(b: int, n0: int, t: int):
                rows = torch.arange(b, device=dev)
                pos = (n0 + torch.arange(t, device=dev)).repeat(b)
                slots = private.req_to_token[rows.repeat_interleave(t), pos]
                q, k, v = (torch.randn(b * t, heads, lc.head_dim, generator=g).to(dev, torch.bfloat16)
                           for heads in (self.num_q_heads, lc.num_kv_heads, lc.num_kv_heads))
                if t == 1:
                    self.plan_decode(rows, torch.full((b,), n0 + 1, device=dev), pos, slots)
                    return [self.decode(i, q, k, v) for i in range(len(private.layers))]
                self.plan_extend(rows, torch.full((b,), n0, device=dev), torch.full((b,), t, device=dev), pos,
                                 slots, prefix_lens_host=[n0] * b, extend_lens_host=[t] * b,
                                 owners=torch.ones(b, dtype=torch.int64, device=dev))
                return [self.extend(i, q, k, v) for i in range(len(private.layers))]

            step(n, 0, prefix)
            step(n, prefix, 32)
            step(n, prefix + 32, 1)
            step(1, prefix + 33, 1)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        finally:
            self.cache, self._decode, self._extend = real, None, None
        return time.perf_counter() - start

    def _layer(self, layer: int):
        c = self.cache
        return c.layers[layer], c.rotations[layer], c.index, c.req_to_token


def _rotate(q: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """q' = q R per query head's KV head (reference path)."""
    return ref.rotate(q, ref.expand_gqa(rot, q.shape[1]))


def _output(o_rot: torch.Tensor, rot, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """o = o' R_V^T in ``out`` (or q's dtype) (reference path)."""
    o = ref.rotate(o_rot, ref.expand_gqa(rot.v_rot, q.shape[1]).transpose(-1, -2))
    if out is None:
        return o.to(q.dtype)
    return out.copy_(o)
