"""The attention shape of a model, read from its HF config (dict or config object)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        cfg = config if isinstance(config, dict) else config.to_dict()
        cfg = cfg.get("text_config") or cfg
        archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        return cls(
            architecture=str(archs[0]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_q_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
        )


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
