"""HF model + calibration text -> :class:`~oscar_kernels.contract.rotations_file.Rotations`.

Pipeline (recipe ``oscar``):
  1. stream token windows through the model's decoder, capturing every attention layer
     (:mod:`calibration.capture`) into :class:`~calibration.statistics.AttentionStats`:
     float64 C_Q / C_S per layer and KV head, and a fixed-size K/V reservoir per layer;
  2. eigendecompose C_Q (keys) and C_S (values), compose R per KV head
     (:func:`calibration.compose.compose`, ``variant``);
  3. rotate the reservoir and search clip thresholds (:func:`calibration.clip.search_clip`);
  4. key groups per layer (``key_groups="per-layer"``, the default): steps 2-3 again for the
     key groups G/2 and 2G around the recipe's G (what depends on the group size only: the
     composition and the keys' clips; the eigenbases, key mean and values are shared), the
     per-layer attention KL of each candidate (:mod:`calibration.proxy`) on the first windows
     of the calibration stream with serving's BF16 sinks and recent window, and the exact
     knapsack of :mod:`calibration.layer_groups` at the uniform G layout's mean key bytes:
     every layer takes its chosen group's rotation and clips (``meta.key_group_sizes``).
Only the model's full-attention layers (:attr:`ModelShape.attention_layers`: every layer of a
plain model; one in four of Qwen3-Next, the global layers of gpt-oss / Gemma-3) are captured
and get rotations; the file's ``layers`` field names them.
Recipes ``hadamard`` (R = H) and ``naive`` (R = I) skip step 2 and default to no clip (the
data-free baselines), in which case no forward pass is needed at all; ``--clip`` adds
calibrated thresholds to them.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace
from itertools import islice

import torch

from oscar_kernels.contract.layout import DEFAULT_SCALE_DTYPE, KVLayout, check_scale_dtype
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import RECIPES, Rotations, make_meta
from oscar_kernels.hybrid_cache import LayerRotation

from . import text_sources
from .capture import attention_modules, capture_attention, full_attention_modules
from .clip import GRANULARITIES, OBJECTIVES, search_clip
from .layer_groups import (DEFAULT_MODE as DEFAULT_KEY_GROUPS, METRIC as KEY_GROUPS_METRIC, MODES as KEY_GROUP_MODES,
                           SERVING_RECENT_WINDOW, SERVING_SINK_TOKENS, allocate, candidate_groups, key_bytes)
from .compose import VARIANTS, compose, hadamard_rotation, identity_rotation, sorted_eigh
from .statistics import AttentionStats

DEFAULT_VARIANT = "U-H-P"
# No clipping by default: calibrated clipping (head or channel) lowered the proxy error but
# raised decode-time perplexity on tinylm-A (benchmarks/results/fidelity_clip_ablation_tinylm-A.json).
DEFAULT_CLIP = "none"
DEFAULT_CLIP_OBJECTIVE = "attn"
# Keys minus their calibrated mean (rotated space): softmax-invariant, and it halves the keys'
# INT2 attention error on SmolLM2, whose key mean is ~0.8 of a key's norm (benchmarks/RESULTS.md).
KEY_SHIFTS = ("mean", "none")
DEFAULT_KEY_SHIFT = "mean"
DEFAULT_TOKENS = {"cpu": 32768, "cuda": 262144}  # CPU: < 5 min for tinylm-A on 2 shared cores
# a D x D covariance is full rank from D tokens on; 8 D keeps its relative sampling error (~ sqrt(D / n)) near 1/3
MIN_TOKENS_PER_HEAD_DIM = 8
# the key-groups proxy: the first windows of the calibration stream, this many tokens at most
# (at least one window), every PROXY_QUERY_STRIDE-th query position. With these, tinylm-A and
# SmolLM2-135M get the layouts that benchmarks/RESULTS.md measured (chosen there at 16,384
# tokens, stride 8); stride 16 halves the proxy's attention work and keeps both, 8,192 tokens
# moved two of SmolLM2's layers.
PROXY_TOKENS = 16384
PROXY_QUERY_STRIDE = 16


@dataclass
class CalibrationConfig:
    recipe: str = "oscar"
    variant: str = DEFAULT_VARIANT
    clip: str | None = None  # None: DEFAULT_CLIP for oscar, "none" for the naive / hadamard baselines
    clip_objective: str = DEFAULT_CLIP_OBJECTIVE
    key_shift: str | None = None  # None: DEFAULT_KEY_SHIFT for oscar, "none" for the naive / hadamard baselines
    clip_sample_tokens: int = 4096  # reservoir size per layer
    skip_first: int = 4  # positions of every window left out of the clip sample (BF16 sinks)
    group_size: int | None = None  # keys' INT2 group; None: head_dim / 4 (KVLayout.resolve)
    value_group_size: int | None = None  # values' INT2 group; None: min(128, head_dim), or group_size if given
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    data: list[str] = field(default_factory=list)  # empty: the Python stdlib source
    tokens: int | None = None  # None: DEFAULT_TOKENS of the device
    seq_len: int = 2048
    batch_size: int = 1
    seed: int = 0
    device: str | None = None  # None: cuda if available else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    key_groups: str = DEFAULT_KEY_GROUPS  # "per-layer" (recipe oscar) or "uniform"; hadamard / naive: uniform

    def resolved(self) -> "CalibrationConfig":
        c = CalibrationConfig(**asdict(self))
        if c.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {c.recipe!r} (choose from {', '.join(RECIPES)})")
        if c.variant not in VARIANTS:
            raise ValueError(f"unknown variant {c.variant!r} (choose from {', '.join(VARIANTS)})")
        if c.clip is None:
            c.clip = DEFAULT_CLIP if c.recipe == "oscar" else "none"
        if c.key_shift is None:
            c.key_shift = DEFAULT_KEY_SHIFT if c.recipe == "oscar" else "none"
        if c.key_shift not in KEY_SHIFTS:
            raise ValueError(f"unknown key shift {c.key_shift!r} (choose from {', '.join(KEY_SHIFTS)})")
        if c.clip not in GRANULARITIES:
            raise ValueError(f"unknown clip {c.clip!r} (choose from {', '.join(GRANULARITIES)})")
        if c.clip_objective not in OBJECTIVES:
            raise ValueError(f"unknown clip objective {c.clip_objective!r} (choose from {', '.join(OBJECTIVES)})")
        if c.key_groups not in KEY_GROUP_MODES:
            raise ValueError(f"unknown key groups {c.key_groups!r} (choose from {', '.join(KEY_GROUP_MODES)})")
        if c.recipe != "oscar":
            c.key_groups = "uniform"  # the data-free baselines have no calibration to choose with
        check_scale_dtype(c.scale_dtype)
        c.device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if c.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but CUDA is not available")
        c.dtype = c.dtype or ("bfloat16" if c.device.startswith("cuda") else "float32")
        if c.tokens is None:
            c.tokens = DEFAULT_TOKENS["cuda" if c.device.startswith("cuda") else "cpu"]
        if c.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {c.dtype!r} (float32, bfloat16 or float16)")
        check_at_least_one(tokens=c.tokens, seq_len=c.seq_len, batch_size=c.batch_size)
        return c

    @property
    def needs_forward(self) -> bool:
        return self.recipe == "oscar" or self.clip != "none" or self.key_shift == "mean"


def check_at_least_one(**values: int) -> None:
    """Refuse a count below 1, naming its command-line flag (seq_len -> --seq-len)."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")


def model_shape(model_dir: str) -> ModelShape:
    """The attention shape of the local HF model folder (never a hub download)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir}: not a model folder (no config.json)")
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    if not shape.attention_layers:
        raise ValueError(f"{model_dir}: its config names no full-attention layer among its {shape.num_layers} "
                         f"layers (layer_types), so there is nothing for the INT2 cache to hold")
    return shape


def attn_implementation(config) -> str:
    """``sdpa`` where the model class supports it, else ``eager`` (gpt-oss: learned sinks)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def load_model(model_dir: str, device: str, dtype: str):
    """(model, tokenizer) from a local folder, eval mode, SDPA attention (eager where the
    model has no SDPA path), on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_shape(model_dir)  # a clear error for a wrong path
    impl = attn_implementation(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation=impl, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.to(device).eval(), tok


def min_calibration_tokens(head_dim: int) -> int:
    """Fewest calibration tokens that give the head_dim x head_dim statistics a meaning."""
    return MIN_TOKENS_PER_HEAD_DIM * head_dim


def token_budget(cfg: CalibrationConfig) -> int:
    """Tokens the windows can hold: whole windows of min(seq_len, tokens) within --tokens."""
    window = min(cfg.seq_len, cfg.tokens)
    return cfg.tokens // window * window


def check_token_budget(cfg: CalibrationConfig, head_dim: int) -> None:
    """Refuse a --tokens / --seq-len budget below the minimum before the model loads."""
    need, budget = min_calibration_tokens(head_dim), token_budget(cfg)
    if budget < need:
        held = "" if budget == cfg.tokens else f" (whole windows of --seq-len {cfg.seq_len} hold {budget})"
        raise ValueError(f"--tokens {cfg.tokens}{held} is too few: the head_dim {head_dim} statistics need at "
                         f"least {need} tokens ({MIN_TOKENS_PER_HEAD_DIM} x head_dim)")


def calibration_windows(tokenizer, cfg: CalibrationConfig):
    """The calibration token windows (stdlib source by default, seeded file order)."""
    files = text_sources.expand_paths(cfg.data) if cfg.data else text_sources.stdlib_files()
    files = text_sources.shuffled(files, cfg.seed)
    return text_sources.token_stream(tokenizer, text_sources.read_texts(files), cfg.seq_len, cfg.tokens)


@torch.no_grad()
def collect_stats(model, tokenizer, cfg: CalibrationConfig, progress: bool = True) -> AttentionStats:
    """Run the decoder over the calibration windows and return the accumulated statistics."""
    from tqdm import tqdm

    shape = ModelShape.from_hf_config(model.config)
    acc_device = cfg.device if cfg.device.startswith("cuda") else "cpu"
    stats = AttentionStats(len(shape.attention_layers), shape.num_kv_heads, shape.head_dim, device=acc_device,
                           reservoir_tokens=cfg.clip_sample_tokens if cfg.clip != "none" else 0,
                           skip_first=cfg.skip_first, seed=cfg.seed, layers=shape.attention_layers)
    windows = calibration_windows(tokenizer, cfg)
    decoder = getattr(model, model.base_model_prefix, model)  # no LM head: it is not needed
    total = token_budget(cfg)
    bar = tqdm(total=total, unit="tok", desc="calibrating", disable=not progress, smoothing=0.1)
    with capture_attention(model, stats, layers=shape.attention_layers):
        for batch in text_sources.batched(windows, cfg.batch_size):
            decoder(input_ids=batch.to(cfg.device), use_cache=False)
            bar.update(batch.numel())
    bar.close()
    found, need = stats.tokens[0], min_calibration_tokens(shape.head_dim)
    if found < need:
        raise ValueError(f"too little calibration text: {found} tokens in whole windows of "
                         f"{min(cfg.seq_len, cfg.tokens)} (a shorter rest is dropped), but the head_dim "
                         f"{shape.head_dim} statistics need at least {need} ({MIN_TOKENS_PER_HEAD_DIM} x "
                         f"head_dim): give more text with --data")
    return stats


def o_proj_weights(model, num_kv_heads: int, head_dim: int, layers=None) -> list[torch.Tensor]:
    """Per layer of ``layers`` (model layer indices; None: every attention module) [Hkv, D, D]
    float64: sum over the query heads j of a KV head of W_j^T W_j, W_j = o_proj.weight[:, j*D:(j+1)*D]
    (the residual-stream metric of a value error)."""
    out = []
    for m in attention_modules(model) if layers is None else full_attention_modules(model, layers):
        w = m.o_proj.weight.detach().double().cpu()  # [hidden, Hq*D]
        hq = w.shape[1] // head_dim
        wj = w.reshape(w.shape[0], hq, head_dim).permute(1, 2, 0)  # [Hq, D, hidden]
        g = wj @ wj.transpose(1, 2)  # [Hq, D, D]
        out.append(g.reshape(num_kv_heads, hq // num_kv_heads, head_dim, head_dim).sum(1))
    return out


def eigenbases(stats: AttentionStats) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_K, U_V) [L, Hkv, D, D] float64: the sorted eigenvectors of C_Q and C_S."""
    return sorted_eigh(stats.c_q())[1], sorted_eigh(stats.c_s())[1]


def rotations_for(cfg: CalibrationConfig, shape: ModelShape, stats: AttentionStats | None,
                  bases: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Per full-attention layer (shape.attention_layers) (R_K, R_V) [Hkv, D, D] float64 for the
    recipe; ``bases``: :func:`eigenbases` of ``stats`` when already computed."""
    h, d, n = shape.num_kv_heads, shape.head_dim, len(shape.attention_layers)
    if cfg.recipe == "naive":
        return [(identity_rotation(h, d), identity_rotation(h, d)) for _ in range(n)]
    if cfg.recipe == "hadamard":
        return [(hadamard_rotation(h, d), hadamard_rotation(h, d)) for _ in range(n)]
    u_k, u_v = bases if bases is not None else eigenbases(stats)
    return [(compose(u_k[l], cfg.variant, cfg.group_size), compose(u_v[l], cfg.variant, cfg.value_group_size))
            for l in range(n)]


def hadamard_span(cfg: CalibrationConfig) -> str:
    if cfg.recipe == "hadamard":
        return "head"
    factors = cfg.variant.split("-") if cfg.recipe == "oscar" else []
    if "Hblock" in factors:
        return "group"
    return "head" if "H" in factors else "none"


def for_shape(cfg: CalibrationConfig, shape: ModelShape) -> CalibrationConfig:
    """``cfg`` with the group sizes resolved (KVLayout.resolve: keys head_dim / 4, values
    min(128, head_dim); values as keys when only the keys' size is given) and checked."""
    layout = KVLayout.resolve(shape.head_dim, cfg.group_size, cfg.value_group_size,
                              cfg.scale_dtype).check(shape.head_dim)
    return replace(cfg, group_size=layout.key_group_size, value_group_size=layout.value_group_size)


def build_rotations(cfg: CalibrationConfig, shape: ModelShape, model_name: str,
                    stats: AttentionStats | None, value_metric: list[torch.Tensor] | None = None,
                    fixed: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    extra_detail: dict | None = None, shared: dict | None = None) -> Rotations:
    """Rotations (+ clips) from the statistics; ``value_metric`` feeds the ``attn`` clip
    objective; ``fixed`` gives the per-layer (R_K, R_V) instead of the recipe's. ``shared``
    (a dict, empty at first) keeps what does not depend on the keys' group size (eigenbases,
    C_Q, key mean, the values' clips) for the next call with the same statistics and another
    key group."""
    cfg = for_shape(cfg, shape)
    layout = KVLayout(cfg.group_size, cfg.value_group_size, cfg.scale_dtype)
    scale_dtype = layout.torch_scale_dtype
    shared = {} if shared is None else shared
    if fixed is not None:
        rots = [(k.double(), v.double()) for k, v in fixed]
    else:
        if cfg.recipe == "oscar" and "bases" not in shared:
            shared["bases"] = eigenbases(stats)
        rots = rotations_for(cfg, shape, stats, shared.get("bases"))
    if stats is not None and cfg.clip != "none" and cfg.clip_objective == "attn" and "c_q" not in shared:
        shared["c_q"] = stats.c_q()
    c_q = shared.get("c_q")
    layers, clip_detail = [], []
    search_device = cfg.device if cfg.device and cfg.device.startswith("cuda") else "cpu"
    if stats is not None and cfg.key_shift == "mean" and "key_mean" not in shared:
        shared["key_mean"] = stats.key_mean()
    key_mean = shared.get("key_mean")
    value_clips = shared.setdefault("value_clips", {})  # layer -> (lo, hi, detail): the values' groups are fixed
    for l, (r_k, r_v) in enumerate(rots):
        clips = []
        k_shift = (key_mean[l].unsqueeze(1) @ r_k).squeeze(1) if key_mean is not None else \
            torch.zeros(shape.num_kv_heads, shape.head_dim, dtype=torch.float64)
        if cfg.clip == "none":
            sample = None
        else:
            sample = {"k": stats.k_res[l].sample(), "v": stats.v_res[l].sample()}
        for x, r, g in (("k", r_k, cfg.group_size), ("v", r_v, cfg.value_group_size)):
            if x == "v" and l in value_clips:
                lo, hi, det = value_clips[l]
            elif sample is None:
                lo, hi, det = search_clip(torch.empty(0, shape.num_kv_heads, shape.head_dim), "none",
                                          g, scale_dtype)
            else:
                xr = torch.einsum("nhd,hde->nhe", sample[x].double(), r)
                xr = (xr - k_shift if x == "k" else xr).float().to(search_device)
                w = None
                if cfg.clip_objective == "attn":
                    m = c_q[l] if x == "k" else value_metric[l]
                    w = (r.transpose(-1, -2) @ m @ r).to(search_device)
                lo, hi, det = search_clip(xr, cfg.clip, g, scale_dtype, weight=w)
                lo, hi = lo.cpu(), hi.cpu()
            if x == "v":
                value_clips[l] = (lo, hi, det)
            clips += [lo, hi]
            clip_detail.append({"layer": shape.attention_layers[l], "tensor": x, **{k: v for k, v in det.items() if k != "granularity"}})
        layers.append(LayerRotation(r_k.float().contiguous(), r_v.float().contiguous(), *clips,
                                    k_shift=k_shift.float().contiguous()))
    detail = {
        "order": "x' = x @ R (row vectors); " + (VARIANTS[cfg.variant] if cfg.recipe == "oscar" else
                                                   {"hadamard": "R = H", "naive": "R = I"}[cfg.recipe]),
        "variant": cfg.variant if cfg.recipe == "oscar" else cfg.recipe,
        "hadamard_span": hadamard_span(cfg),
        "eigen_order": "descending" if cfg.recipe == "oscar" else None,
        "key_basis": "eig(C_Q), post-RoPE queries summed over the KV head's query heads" if cfg.recipe == "oscar" else None,
        "value_basis": "eig(C_S), C_S = O^T O of per-head attention outputs" if cfg.recipe == "oscar" else None,
        "key_shift": cfg.key_shift if stats is not None else "none",
        "clip": cfg.clip,
        "clip_method": None if cfg.clip == "none" else
        f"mean +- m * std ({cfg.clip} granularity), m by a two-level grid search (1..8 std, then +-0.375 "
        f"step 0.125) including no clip, minimising "
        + ("the C_Q-weighted key error and o_proj-weighted value error" if cfg.clip_objective == "attn"
           else "the squared error") + " of oscar_kernels.int2.fake_quantise",
        "clip_objective": None if cfg.clip == "none" else cfg.clip_objective,
        "clip_sample_tokens": None if cfg.clip == "none" else cfg.clip_sample_tokens,
        "clip_skip_first": None if cfg.clip == "none" else cfg.skip_first,
        "clip_search": clip_detail if cfg.clip != "none" else None,
        "group_size": cfg.group_size,
        "value_group_size": cfg.value_group_size,
        "scale_dtype": cfg.scale_dtype,
        "seed": cfg.seed,
        "tokens": stats.tokens[0] if stats is not None else 0,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "model_dtype": cfg.dtype,
        "device": cfg.device,
    }
    if extra_detail:
        detail.update(extra_detail)
    detail = {k: v for k, v in detail.items() if v is not None}
    meta = make_meta(shape, model_name, layout, cfg.recipe, recipe_detail=detail,
                     calib_data=text_sources.describe(cfg.data) if stats is not None else "none",
                     calib_tokens=stats.tokens[0] if stats is not None else 0)
    return Rotations(meta, layers)


def proxy_windows(tokenizer, cfg: CalibrationConfig) -> list[torch.Tensor]:
    """The key-groups proxy's text: the first windows of the calibration stream (PROXY_TOKENS
    at most, at least one window), so the layout sees nothing calibration did not."""
    window = min(cfg.seq_len, cfg.tokens)
    return list(islice(calibration_windows(tokenizer, cfg), max(1, PROXY_TOKENS // window)))


def proxy_layout(window: int) -> tuple[int, int]:
    """(sink, recent) of the proxy: serving's BF16 sinks and recent window, or none at all when
    windows of ``window`` tokens would leave no query an INT2 key under them."""
    if window > SERVING_SINK_TOKENS + SERVING_RECENT_WINDOW:
        return SERVING_SINK_TOKENS, SERVING_RECENT_WINDOW
    return 0, 0


def candidate_errors(model, windows, candidates: dict[int, Rotations], sink: int, recent: int, device: str,
                     progress: bool) -> dict[int, list[float]]:
    """{key group: per covered layer attention KL} of each candidate file (one proxy pass)."""
    from .proxy import run_proxy

    res = run_proxy(model, windows, {f"g{g}": rot for g, rot in candidates.items()}, sink=sink, recent=recent,
                    device=device, progress=progress, query_stride=PROXY_QUERY_STRIDE,
                    metrics=(KEY_GROUPS_METRIC,))
    return {g: [row[KEY_GROUPS_METRIC] for row in res[f"g{g}"]["layers"]] for g in candidates}


def per_layer_key_groups(model, tokenizer, cfg: CalibrationConfig, shape: ModelShape, model_name: str,
                         stats: AttentionStats, value_metric, extra_detail: dict | None = None,
                         progress: bool = True, log=print) -> Rotations:
    """Step 4 of the module doc: one file whose layers each take the key group (of G/2, G, 2G)
    that the knapsack picks on the proxy's attention KL at the uniform G layout's mean key bytes."""
    cfg = for_shape(cfg, shape)
    base = cfg.group_size
    shared: dict = {}
    cands = {g: build_rotations(replace(cfg, group_size=g), shape, model_name, stats, value_metric,
                                extra_detail=extra_detail, shared=shared)
             for g in candidate_groups(shape.head_dim, base)}
    if len(cands) == 1:  # no other group fits head_dim: the uniform file
        return cands[base]
    windows = proxy_windows(tokenizer, cfg)
    window = int(windows[0].numel())
    sink, recent = proxy_layout(window)
    t0 = time.time()
    errors = candidate_errors(model, windows, cands, sink, recent, cfg.device, progress)
    cost = {g: key_bytes(shape.head_dim, g, cfg.scale_dtype) for g in cands}
    groups, summed = allocate(errors, cost, cost[base])
    rows = [cands[g].layers[i] for i, g in enumerate(groups)]
    detail = dict(cands[base].meta.recipe_detail)
    if "clip_search" in detail:  # two entries per layer (k, v), each from the chosen candidate
        detail["clip_search"] = [e for i, g in enumerate(groups)
                                 for e in cands[g].meta.recipe_detail["clip_search"][2 * i:2 * i + 2]]
    n_tokens = sum(int(w.numel()) for w in windows)
    detail["key_groups"] = {
        "mode": "per-layer",
        "chosen": groups,
        "candidates": sorted(cands),
        "key_bytes": {str(g): cost[g] for g in sorted(cands)},
        "budget_key_bytes": cost[base],
        "mean_key_bytes": sum(cost[g] for g in groups) / len(groups),
        "method": f"exact knapsack (calibration.layer_groups.allocate): one key group per layer minimising the "
                  f"summed per-layer {KEY_GROUPS_METRIC} under the uniform g{base} layout's mean key bytes",
        "proxy": {"metric": KEY_GROUPS_METRIC, "text": f"the first {n_tokens} tokens of the calibration stream",
                  "tokens": n_tokens, "window": window, "sink": sink, "recent": recent,
                  "query_stride": PROXY_QUERY_STRIDE},
        KEY_GROUPS_METRIC: {str(g): errors[g] for g in sorted(cands)},
        f"summed_{KEY_GROUPS_METRIC}": {"chosen": summed, "uniform": sum(errors[base])},
    }
    if (sink, recent) != (SERVING_SINK_TOKENS, SERVING_RECENT_WINDOW):
        log(f"oscar-calibrate: windows of {window} tokens leave no key in INT2 under serving's "
            f"{SERVING_SINK_TOKENS} BF16 sinks and {SERVING_RECENT_WINDOW}-token window: the key-groups proxy "
            f"quantises every key")
    log(f"oscar-calibrate: key groups proxy: {len(windows)} windows, {len(cands)} candidates "
        f"({', '.join(f'g{g}' for g in sorted(cands))}), {time.time() - t0:.1f}s")
    meta = replace(cands[base].meta, recipe_detail=detail, key_group_sizes=tuple(groups))
    return Rotations(meta, rows)


def calibrate(model_dir: str, cfg: CalibrationConfig, progress: bool = True, log=print,
              fixed: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
              extra_detail: dict | None = None) -> Rotations:
    """The whole calibration for the model in ``model_dir`` (with ``fixed`` rotations only
    the clip thresholds are calibrated)."""
    cfg = cfg.resolved()
    if fixed is not None:
        cfg = replace(cfg, key_groups="uniform")  # the rotations are given: only clips are calibrated
    t0 = time.time()
    shape = model_shape(model_dir)
    cfg = for_shape(cfg, shape)
    name = os.path.basename(os.path.normpath(model_dir))
    needs_forward = cfg.clip != "none" if fixed is not None else cfg.needs_forward
    if not needs_forward:
        return build_rotations(cfg, shape, name, None, fixed=fixed, extra_detail=extra_detail)
    check_token_budget(cfg, shape.head_dim)
    text_sources.check_texts(cfg.data)  # a missing or textless --data path fails before the model loads
    model, tok = load_model(model_dir, cfg.device, cfg.dtype)
    log(f"oscar-calibrate: {name} {shape} on {cfg.device}/{cfg.dtype}, recipe {cfg.recipe}"
        + (f" variant {cfg.variant}" if cfg.recipe == "oscar" else "") + f", clip {cfg.clip}, "
        f"{cfg.tokens} tokens in windows of {cfg.seq_len}")
    stats = collect_stats(model, tok, cfg, progress=progress)
    if stats.tokens[0] < token_budget(cfg):
        log(f"oscar-calibrate: warning: the calibration text ran out after {stats.tokens[0]} of "
            f"{token_budget(cfg)} tokens; the rotations file records {stats.tokens[0]}")
    metric = o_proj_weights(model, shape.num_kv_heads, shape.head_dim, shape.attention_layers) \
        if cfg.clip != "none" and cfg.clip_objective == "attn" else None
    if cfg.key_groups == "per-layer":
        rot = per_layer_key_groups(model, tok, cfg, shape, name, stats, metric, extra_detail=extra_detail,
                                   progress=progress, log=log)
    else:
        rot = build_rotations(cfg, shape, name, stats, metric, fixed=fixed, extra_detail=extra_detail)
    log(f"oscar-calibrate: {stats.tokens[0]} tokens, {time.time() - t0:.1f}s")
    return rot
