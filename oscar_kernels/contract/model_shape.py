"""The attention shape of a model, read from its HF config (dict or config object).

Only a model's *full-attention* layers get the INT2 cache and rotations
(``attention_layers``, model layer indices); linear-attention (Gated DeltaNet / Mamba),
sliding-window and chunked layers keep what SGLang gives them. Which layers are full
attention, from the config (``text_config`` if it has one), first rule that applies:

1. ``layer_types``: the layers whose type is ``"full_attention"`` (transformers' name in
   qwen3_next, qwen3_5(_moe), gpt_oss, gemma3, cohere2, llama4, ...) or ``"attention"``
   (the Mamba hybrids: bamba, nemotron_h); ``"linear_attention"``, ``"sliding_attention"``,
   ``"chunked_attention"``, ``"mamba"``, ``"conv"``, ... are not;
2. ``full_attention_interval`` n (Qwen3-Next / Qwen3.5 config.json files without
   ``layer_types``): layer i is full attention when (i + 1) % n == 0, as transformers
   builds ``layer_types``;
3. ``sliding_window_pattern`` n (Gemma-3, Cohere2 config.json files without ``layer_types``):
   the same rule, (i + 1) % n == 0 is full attention, the others slide;
4. otherwise every layer is full attention (Llama, Qwen3, Mistral v0.3, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

# layer_types values that mean full (global, causal) attention over the whole sequence
FULL_ATTENTION_TYPES = ("full_attention", "attention")


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    num_layers: int  # the model's decoder layers, of every kind
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    # the model layer indices (ascending) that are full attention; None: every layer
    attention_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        layers = tuple(range(self.num_layers)) if self.attention_layers is None \
            else tuple(int(l) for l in self.attention_layers)
        object.__setattr__(self, "attention_layers", layers)

    @property
    def is_hybrid(self) -> bool:
        """True when some layers are not full attention."""
        return len(self.attention_layers) != self.num_layers

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        cfg = config if isinstance(config, dict) else config.to_dict()
        cfg = cfg.get("text_config") or cfg
        archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        num_layers = int(cfg["num_hidden_layers"])
        return cls(
            architecture=str(archs[0]),
            num_layers=num_layers,
            num_q_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            attention_layers=full_attention_layers(cfg, num_layers),
        )


def full_attention_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The full-attention model layers of an HF config dict (the rules in the module doc)."""
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"config layer_types names {len(types)} layers, num_hidden_layers is {num_layers}")
        return tuple(i for i, t in enumerate(types) if t in FULL_ATTENTION_TYPES)
    for key in ("full_attention_interval", "sliding_window_pattern"):
        n = cfg.get(key)
        if n:
            return tuple(i for i in range(num_layers) if (i + 1) % int(n) == 0)
    return tuple(range(num_layers))


def format_layers(layers, limit: int = 8) -> str:
    """'3,7,11' (at most ``limit`` numbers, then ',... (N in all)')."""
    layers = list(layers)
    if not layers:
        return "none"
    text = ",".join(str(l) for l in layers[:limit])
    return text + (f",... ({len(layers)} in all)" if len(layers) > limit else "")


def kv_heads_for_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The KV heads that attention-TP rank ``tp_rank`` of ``tp_size`` holds, as in SGLang's
    QKVParallelLinear: tp_size <= H, contiguous blocks of H / tp_size heads; tp_size > H,
    head r // (tp_size / H) (each head replicated tp_size / H times)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over tp_size {tp_size}")
        per = num_kv_heads // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size {tp_size} is not a multiple of {num_kv_heads} KV heads")
    return [tp_rank // (tp_size // num_kv_heads)]
