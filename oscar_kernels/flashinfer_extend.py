"""Extend attention through FlashInfer's BF16 prefill over the materialised hybrid prefix.

For request b (prefix length L_b, new tokens i = 0..e_b-1 at positions L_b + i) and query
head hq, in the rotated space (q' = q R_K, keys and values as the read rule gives them):

    (o_pre, lse_pre)   = softmax attention of q'_i over the BF16 prefix rows
                         kpre/vpre[off_b : off_b + L_b]  (triton_materialize; no mask)
    (o_new, lse_new)   = softmax attention of q'_i over the new k'_j, v'_j, j <= i (causal)
    o'_i               = (2^lse_pre o_pre + 2^lse_new o_new) / (2^lse_pre + 2^lse_new)
                         (flashinfer.merge_state; an empty prefix has lse = -inf)
    o_i                = o'_i R_V^T

the split SGLang's own FlashInfer backend uses for extend with a cached prefix (ragged
causal part + prefix part, merged by log-sum-exp). FlashInfer (a dependency of sglang,
GPU only) does both attentions; the rotations and the materialisation are ours. The
PyTorch twin is reference.reference_extend (same math, float32).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

from .hybrid_cache import HybridCacheIndex, HybridLayerCache, LayerRotation
from .triton_decode import rotate_tokens
from .triton_materialize import MAX_MATERIALIZED_TOKENS, triton_materialize_prefix

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferExtend:
    """Two FlashInfer ragged prefill wrappers (prefix, new tokens) sharing one workspace;
    ``plan`` once per batch, ``run`` per layer."""

    def __init__(self, device, workspace_bytes: int = WORKSPACE_BYTES):
        import flashinfer

        self._merge_state = flashinfer.merge_state
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.prefix = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.new = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.prefix_lens_host: list[int] = []
        self.fits = False  # the planned batch's prefixes fit the scratch cap (else: not used)
        self.k_prefix = self.v_prefix = None  # bf16 [sum L_b, H, D] materialised prefixes of the batch

    @property
    def has_prefix(self) -> bool:
        return sum(self.prefix_lens_host) > 0

    def plan(self, prefix_lens_host: Sequence[int], extend_lens_host: Sequence[int], num_q_heads: int,
             num_kv_heads: int, head_dim: int, sm_scale: float) -> None:
        """Plan a batch from host lengths (FlashInfer plans on the host: no device sync) and
        allocate its prefix scratch, shared by every layer's run."""
        def indptr(lens):
            return torch.tensor([0, *accumulate(lens)], dtype=torch.int32)

        self.prefix_lens_host = [int(n) for n in prefix_lens_host]
        self.fits = sum(self.prefix_lens_host) <= MAX_MATERIALIZED_TOKENS
        self.k_prefix = self.v_prefix = None
        if not self.fits:
            return
        qo = indptr(extend_lens_host)
        common = dict(num_qo_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
                      sm_scale=sm_scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        self.new.plan(qo, qo, causal=True, **common)
        if self.has_prefix:
            self.prefix.plan(qo, indptr(self.prefix_lens_host), causal=False, **common)
            self.k_prefix = torch.empty(sum(self.prefix_lens_host), num_kv_heads, head_dim, dtype=torch.bfloat16,
                                        device=self.workspace.device)
            self.v_prefix = torch.empty_like(self.k_prefix)

    def run(self, q: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor, layer: HybridLayerCache,
            index: HybridCacheIndex, rotation: LayerRotation, req_to_token: torch.Tensor, rows: torch.Tensor,
            prefix_lens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """o [T, Hq, D] (HybridAttention.extend's attention) for the planned batch."""
        t, hq, d = q.shape
        if out is None:
            out = torch.empty_like(q)
        if t == 0:
            return out
        q_rot = rotate_tokens(q, rotation.k_rot.contiguous(),
                              torch.empty(t, hq, d, dtype=torch.bfloat16, device=q.device))
        o_rot, lse = self.new.run(q_rot, k_rot, v_rot, return_lse=True)
        if self.has_prefix:
            k_pre, v_pre = triton_materialize_prefix(layer, index, req_to_token, rows, prefix_lens,
                                                     self.prefix_lens_host, self.k_prefix, self.v_prefix)
            o_pre, lse_pre = self.prefix.run(q_rot, k_pre, v_pre, return_lse=True)
            o_rot, lse = self._merge_state(o_pre, lse_pre, o_rot, lse)
        return rotate_tokens(o_rot, rotation.v_rot.contiguous(), out, transpose=True)
