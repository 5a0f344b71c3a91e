"""Bookkeeping of speculative decoding on the hybrid cache: draft trees and accepted paths
(device ops only, fixed shapes: recordable in a CUDA graph). The protocol itself (plan_verify /
verify / commit) is HybridAttention's; this module turns the caller's tree and acceptance into
the index tensors it needs.

Layout (SGLang's EAGLE verify): B requests of T draft tokens each, token t = b * T + i. Draft i
of request b sits at position n_b + d_i (n_b = cached prefix, d_i = its depth, 0 for the root)
in pool slot slots[t]. ``parents`` int [B, T]: parent draft of each draft (index in 0..T-1
within its request), -1 for a draft whose parent is the prefix; a chain (topk = 1) is
parents[b, i] = i - 1. Acceptance ``accept_index`` int [B, A]: the accepted drafts of each
request in path order (root first), -1 after the last; the k-th accepted draft ends at
position n_b + k, i.e. its depth must be k (a path from the root).
"""
from __future__ import annotations

import torch


def chain_parents(batch: int, num_drafts: int, device=None) -> torch.Tensor:
    """int64 [B, T]: the parents of a chain of T drafts (i - 1; -1 for the first)."""
    return (torch.arange(num_drafts, device=device) - 1).expand(batch, num_drafts).contiguous()


def draft_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T]: anc[b, i, a] = draft a is draft i or one of its ancestors (the tree
    mask among drafts: what draft i attends to). T rounds of parent lookups on the device."""
    b, t = parents.shape
    parents = parents.long()
    anc = torch.eye(t, dtype=torch.bool, device=parents.device).expand(b, t, t).clone()
    cur = torch.arange(t, device=parents.device).expand(b, t)
    for _ in range(t):
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), cur)
        anc |= torch.nn.functional.one_hot(cur.clamp(min=0), t).bool() & (cur >= 0)[..., None]
    return anc


def accept_index_from_lens(accept_lens: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """int64 [B, T]: accept_index of a chain whose first accept_lens[b] drafts were accepted."""
    i = torch.arange(num_drafts, device=accept_lens.device)
    return torch.where(i[None, :] < accept_lens.long()[:, None], i[None, :], -1)


def commit_tokens(prefix_lens: torch.Tensor, accept_index: torch.Tensor, num_drafts: int,
                  sink_tokens: int, recent_window: int):
    """What commit stores. Returns (tok, positions, seq_ends, new_lens):
        tok       int64 [B*A]  draft token (b * T + accept_index[b, k]) of entry (b, k)
        positions int64 [B*A]  n_b + k for accepted entries; S for padding entries
        seq_ends  int64 [B*A]  n_b + a_b (a_b = accepted count); S + W + 1 for padding, so the
                               store's rules (sink: p < S; ring: p >= seq_end - W) write nothing
        new_lens  int64 [B]    n_b + a_b
    Padding entries (accept_index -1) gather draft 0 of their request."""
    b, a = accept_index.shape
    valid = accept_index >= 0
    count = valid.sum(1)
    n = prefix_lens.long()
    new_lens = n + count
    k = torch.arange(a, device=accept_index.device)
    tok = (torch.arange(b, device=accept_index.device)[:, None] * num_drafts + accept_index.clamp(min=0)).flatten()
    positions = torch.where(valid, n[:, None] + k[None, :], sink_tokens).flatten()
    seq_ends = torch.where(valid, new_lens[:, None], sink_tokens + recent_window + 1).flatten()
    return tok, positions, seq_ends, new_lens
