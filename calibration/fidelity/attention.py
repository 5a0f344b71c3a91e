"""Route an HF model's attention through a KV simulator (transformers AttentionInterface).

The model is called with ``use_cache=False`` and ``oscar_sim=<simulator>``; the registered
function receives each layer's post-RoPE q/k/v of the *new* tokens only and lets the
simulator store them and attend over its cache (see sim_cache). Positions are passed
explicitly, so a chunk or a decoded token continues the sequence the simulator holds.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "oscar_fidelity"


def simulated_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                        **kwargs):
    sim = kwargs.get("oscar_sim")
    if sim is None:
        raise RuntimeError(f"attn_implementation {ATTN_IMPLEMENTATION!r} needs model(..., oscar_sim=...)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return sim.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTN_IMPLEMENTATION, simulated_attention)


def use_simulated_attention(model) -> None:
    """Switch a loaded model to the simulated attention (idempotent)."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


@torch.no_grad()
def forward_step(model, sim, input_ids: torch.Tensor, **model_kwargs) -> torch.Tensor:
    """Run ``input_ids`` [B, T] as the next T positions of the sim's B sequences; returns
    the logits [B, T, V] (``logits_to_keep=k``: the last k) and advances the simulator."""
    b, t = input_ids.shape
    if b != sim.batch:
        raise ValueError(f"{b} input rows but the simulator holds {sim.batch} sequences")
    sim.check_step(t)
    pos = torch.arange(sim.length, sim.length + t, device=input_ids.device).expand(b, t)
    logits = model(input_ids=input_ids, position_ids=pos, use_cache=False, oscar_sim=sim,
                   **model_kwargs).logits
    sim.advance(t)
    return logits
