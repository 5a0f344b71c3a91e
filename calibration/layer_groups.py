"""Key groups per layer: spend the keys' INT2 bytes where the attention needs them.

The keys' INT2 error is not equally harmful in every layer. With C candidate key group sizes
(oscar-calibrate: G/2, G, 2G around the recipe's key group G) and, for every covered layer l
and candidate g, a measured error e[g][l] (the proxy's attention KL of layer l with its keys
quantised in groups of g, :mod:`calibration.proxy`, on calibration-side text), the layout is

    choose g_l for every layer l   minimising   sum_l e[g_l][l]
    subject to                     sum_l c(g_l) <= B * L

where c(g) = D/4 + (D/g) * 2 * s are the key bytes per token and KV head of groups of g (2-bit
codes, then a scale and a min of s bytes per group; :func:`key_bytes`), L the number of
layers and B the mean key bytes allowed (oscar-calibrate: B = c(G), the uniform layout's,
so the file costs what today's does). The values keep their groups in every layer.

:func:`allocate` solves it exactly as a multiple-choice knapsack by dynamic programming over
the layers, the state being the bytes spent so far in units of u = gcd(c(g)): at most
L * C * (B * L / u) steps (16,200 for SmolLM2-135M: 30 layers, 3 candidates, 180 states).
Among layouts of equal summed error the cheaper wins, so equal errors never buy bytes. The summed per-layer KL is a proxy (each
layer sees exact inputs, errors do not propagate between layers); its layouts were judged by
paired perplexity in benchmarks/RESULTS.md (SmolLM2-135M 1.0360x -> 1.0216x at 4k, tinylm-A
1.0134x -> 1.0087x at 8k, same bytes).

Torch-free: the arithmetic here is imported by the benchmarks too.
"""
from __future__ import annotations

import math

from oscar_kernels.contract.layout import KVLayout, group_bytes, group_size_problem

# The BF16 sinks and recent window a server keeps by default (sglang_ext.settings'
# DEFAULT_SINK_TOKENS / DEFAULT_RECENT_WINDOW; calibration does not import sglang_ext, a test
# keeps the two equal): keys the proxy leaves exact, as serving does.
SERVING_SINK_TOKENS = 16
SERVING_RECENT_WINDOW = 128

MODES = ("per-layer", "uniform")
key_bytes = group_bytes  # c(g): the keys' INT2 bytes per token and KV head at groups of g
DEFAULT_MODE = "per-layer"
METRIC = "attn_kl"


def candidate_groups(head_dim: int, group_size: int) -> list[int]:
    """G/2, G, 2G (ascending) less those ``head_dim`` cannot be stored in (group_size_problem)."""
    cands = [group_size * 2] + ([group_size // 2] if group_size % 2 == 0 else [])
    return sorted({group_size} | {g for g in cands if g >= 1 and group_size_problem(head_dim, g) is None})


def allocate(errors: dict[int, list[float]], cost: dict[int, int], budget: float) -> tuple[list[int], float]:
    """One group size per layer minimising sum(errors[g][layer]) with sum(cost[g]) <= budget x layers
    (budget: the mean key bytes allowed); ties go to the cheaper layout. Returns (groups, summed error)."""
    sizes = sorted(errors)
    layers = len(errors[sizes[0]])
    unit = math.gcd(*cost.values())
    cap = int(budget * layers // unit)
    best = {0: (0.0, [])}  # bytes used (in units) -> (error, groups so far)
    for layer in range(layers):
        nxt = {}
        for used, (err, groups) in best.items():
            for g in sizes:
                u = used + cost[g] // unit
                if u > cap:
                    continue
                cand = (err + errors[g][layer], groups + [g])
                if u not in nxt or (cand[0], u) < (nxt[u][0], u):
                    nxt[u] = cand
        best = nxt
    if not best:
        raise ValueError(f"no layout fits a mean of {budget} key bytes")
    err, groups = min(best.values(), key=lambda v: (v[0], sum(cost[g] for g in v[1])))
    return groups, err


def describe_layout(meta) -> str:
    """One line for a rotations file's key groups (a :class:`RotationsMeta`), e.g.
    ``key groups per layer: g8 at 7,14; g32 at 0,1; g16 elsewhere; mean 42.0 B per token and
    KV head (K+V), same as uniform g16``."""
    base = meta.group_size
    uniform = KVLayout(base, meta.value_group_size, meta.scale_dtype).bytes_per_token_per_head(meta.head_dim)
    mean = meta.mean_bytes_per_token_per_head()
    by = {}
    for l, g in zip(meta.layer_ids, meta.key_group_sizes):
        by.setdefault(g, []).append(l)
    if set(by) == {base}:
        return f"key groups per layer: g{base} everywhere; {mean:.1f} B per token and KV head (K+V)"
    parts = [f"g{g} at {','.join(map(str, by[g]))}" for g in sorted(by) if g != base]
    if base in by:
        parts.append(f"g{base} elsewhere")
    tail = f"same as uniform g{base}" if math.isclose(mean, uniform) else f"uniform g{base}: {uniform:.1f} B"
    return f"key groups per layer: {'; '.join(parts)}; mean {mean:.1f} B per token and KV head (K+V), {tail}"
