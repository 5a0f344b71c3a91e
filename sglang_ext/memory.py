"""Byte arithmetic of the hybrid INT2/BF16 KV pool (pure functions, no sglang import).

Per token of SGLang's pool (L layers: the rank's attention layers, for a Gated DeltaNet hybrid
its full-attention layers only, whose Mamba state SGLang sizes and charges before this budget;
H KV heads on this rank, head_dim D, keys' group size G_K, values' group size G_V, scale element
size e bytes, shared by K and V):

    INT2 cell   = L * H * (2 * D/4 + (D/G_K + D/G_V) * 2 * e)   codes + (scale, min), K and V
    sink index  = 4 bytes per page (int32 sink_slot_of_page), i.e. 4/P per token

Fixed reserve, independent of the token count (R request rows, C sink slots):

    rings       = R * W * L * H * D * 2 * 2  + R * 20      BF16 K/V ring + per-row state
    sink store  = C * S * L * H * D * 2 * 2  + 12 * C       BF16 K/V sinks + page_of_sink_slot
                                                            + sink_generation (int64)
    rotations   = L * (2 * H * D * D + 4 * H * D) * 4        float32 R_K, R_V and clips

The pool allocates ``size + P`` slots (page 0 is SGLang's padding page), so a budget B
buys ``size = (floor((B - reserve) / (P * cell + 4)) - 1) * P`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from oscar_kernels.contract.layout import SCALE_DTYPES, KVLayout

# Defaults of the oscar runtime (used when the server arguments leave them open).
DEFAULT_MAX_RUNNING_REQUESTS = 256  # ring rows are reserved up front: cap them
# round-robin sink slots per request row: one for the running request, the others keep the
# BF16 sinks of finished (radix-cached) sequences for later prefix hits. 3, not 4: 0.6 GB
# less reserve on the Qwen3-8B shape (+28k tokens at 74 B per token and KV head)
SINK_SLOTS_PER_ROW = 3

BF16_BYTES = 2
INDEX_BYTES = 4  # int32 entries of the sink index
GENERATION_BYTES = 8  # int64 sink_generation, per sink slot
ROW_STATE_BYTES = 4 + 8 + 8  # ring_valid_from int32, ring_owner int64, ring_end int64
ROTATION_BYTES = 4  # float32


def bf16_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """What SGLang's BF16 MHA pool spends per token (K and V of one head_dim, all layers)."""
    return num_layers * num_kv_heads * 2 * head_dim * BF16_BYTES


def default_sink_slots(num_rows: int) -> int:
    return SINK_SLOTS_PER_ROW * num_rows


def planned_request_rows(max_running_requests: int | None, attn_dp_size: int = 1) -> int:
    """Requests per worker the ring reserve is planned for (SGLang splits
    --max-running-requests over attention-DP workers)."""
    if max_running_requests is None:
        return DEFAULT_MAX_RUNNING_REQUESTS
    per_worker = max_running_requests // max(attn_dp_size, 1)
    if per_worker < 1:
        raise ValueError(f"--max-running-requests {max_running_requests} leaves no request per "
                         f"attention-DP worker (dp size {attn_dp_size})")
    return per_worker


@dataclass(frozen=True)
class OscarMemoryPlan:
    """Everything that decides the bytes of one rank's OscarKVPool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int  # the keys' INT2 group size
    scale_dtype: str  # "float16" | "bfloat16" | "float32" | "float8_e4m3fn" (the rotations file's)
    sink_tokens: int
    recent_window: int
    page_size: int
    num_rows: int  # request rows = max running requests + 1 (row 0 is SGLang's padding row)
    num_sink_slots: int
    value_group_size: int | None = None  # the values' INT2 group size; None: group_size
    key_group_sizes: tuple[int, ...] | None = None  # the keys' group size per layer; None: group_size

    def __post_init__(self):
        if self.value_group_size is None:
            object.__setattr__(self, "value_group_size", self.group_size)
        groups = (self.group_size,) * self.num_layers if self.key_group_sizes is None else tuple(self.key_group_sizes)
        if len(groups) != self.num_layers:
            raise ValueError(f"oscar pool: {len(groups)} key group sizes for {self.num_layers} layers")
        object.__setattr__(self, "key_group_sizes", groups)
        if self.sink_tokens > self.page_size:
            raise ValueError(f"oscar sink tokens S={self.sink_tokens} exceed the page size "
                             f"{self.page_size}: positions < S must lie on a sequence's first page "
                             f"(use --page-size >= {self.sink_tokens})")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"unknown oscar scale dtype {self.scale_dtype!r}")
        if self.num_rows < 2 or self.num_sink_slots < 1:
            raise ValueError(f"oscar pool needs >= 2 request rows and >= 1 sink slot, got "
                             f"{self.num_rows} rows and {self.num_sink_slots} sink slots")

    def layer_layouts(self) -> list[KVLayout]:
        """The INT2 layout of each cache layer (the keys' groups may differ per layer)."""
        return [KVLayout(g, self.value_group_size, self.scale_dtype) for g in self.key_group_sizes]

    @property
    def bytes_per_token(self) -> int:
        """INT2 codes + scales of one token, all layers (SGLang's cell size for oscar)."""
        return self.num_kv_heads * sum(x.bytes_per_token_per_head(self.head_dim) for x in self.layer_layouts())

    def _bf16_layer_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * BF16_BYTES

    @property
    def ring_bytes(self) -> int:
        return self.num_rows * (self.recent_window * self._bf16_layer_token() + ROW_STATE_BYTES)

    @property
    def sink_store_bytes(self) -> int:
        return self.num_sink_slots * (self.sink_tokens * self._bf16_layer_token() + INDEX_BYTES
                                      + GENERATION_BYTES)

    @property
    def rotation_bytes(self) -> int:
        h, d = self.num_kv_heads, self.head_dim
        return self.num_layers * (2 * h * d * d + 4 * h * d) * ROTATION_BYTES

    @property
    def fixed_bytes(self) -> int:
        """Bytes that do not grow with the token count; reserved before sizing."""
        return self.ring_bytes + self.sink_store_bytes + self.rotation_bytes

    def pool_bytes(self, max_total_num_tokens: int) -> int:
        """Exact bytes OscarKVPool allocates for ``max_total_num_tokens`` tokens."""
        slots = max_total_num_tokens + self.page_size
        pages = -(-slots // self.page_size)
        return slots * self.bytes_per_token + pages * INDEX_BYTES + self.fixed_bytes

    def max_total_tokens(self, budget_bytes: int, extra_bytes_per_token: int = 0) -> int:
        """The largest page-aligned token count whose pool fits in ``budget_bytes``, beside
        ``extra_bytes_per_token`` of other per-token KV sized to the same count (a draft
        model's BF16 pool under EAGLE-family speculation: plugin.draft_kv_bytes_per_token)."""
        p = self.page_size
        per_page = p * (self.bytes_per_token + extra_bytes_per_token) + INDEX_BYTES
        pages = (budget_bytes - self.fixed_bytes) // per_page
        return max(int(pages) - 1, 0) * p
