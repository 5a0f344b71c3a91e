"""OscarKVPool and the oscar memory arithmetic on CPU (no GPU, no server)."""
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import SHARED
from sglang_cases import SMALL_QWEN3, write_distinct_heads_file, write_hadamard_file

from oscar_kernels.contract.rotations_file import RotationsFileError
from oscar_kernels import reference as ref
from oscar_kernels.hybrid_cache import allocate_index, allocate_layer, assign_sink_slots
from sglang_ext.memory import (DEFAULT_MAX_RUNNING_REQUESTS, OscarMemoryPlan, bf16_bytes_per_token,
                               default_sink_slots, planned_request_rows)
from sglang_ext.settings import DEFAULT_RECENT_WINDOW, DEFAULT_SINK_TOKENS, OSCAR_KV_DTYPE

pytest.importorskip("sglang")
from sglang.srt.distributed.parallel_state_wrapper import ParallelState  # noqa: E402

from sglang_ext.pool import (OscarKVPool, RankLayout,  # noqa: E402
                             build_pool_for_configurator, load_rank_rotations, memory_plan,
                             plan_for_configurator)

# Measured: SGLang 0.5.17 BF16 max_total_num_tokens for Qwen3-8B on one H200 at
# --mem-fraction-static 0.88 (the budget the INT2 pool must beat by >= 6.5x).
BF16_TOKENS_QWEN3_8B_H200 = 779_876


def qwen3_8b_plan(rows=DEFAULT_MAX_RUNNING_REQUESTS + 1, page=64, group_size=32, value_group_size=128,
                  scale_dtype="float8_e4m3fn"):
    """The Qwen3-8B pool at the server's defaults and oscar-calibrate's default layout."""
    return OscarMemoryPlan(num_layers=36, num_kv_heads=8, head_dim=128, group_size=group_size,
                           scale_dtype=scale_dtype, sink_tokens=DEFAULT_SINK_TOKENS,
                           recent_window=DEFAULT_RECENT_WINDOW, page_size=page, num_rows=rows,
                           num_sink_slots=default_sink_slots(rows), value_group_size=value_group_size)


# ---------------------------------------------------------------- memory arithmetic

def test_qwen3_8b_bytes_per_token():
    plan = qwen3_8b_plan()  # keys 32 + 4 x 2, values 32 + 2
    assert plan.bytes_per_token == 36 * 8 * (32 + 8 + 32 + 2) == 21312
    assert qwen3_8b_plan(group_size=128, value_group_size=128, scale_dtype="float16").bytes_per_token == \
        36 * 8 * (2 * (32 + 4)) == 20736
    assert bf16_bytes_per_token(36, 8, 128) == 36 * 8 * 2 * 128 * 2 == 147456


def test_qwen3_8b_capacity_is_at_least_6_5x_bf16():
    budget = BF16_TOKENS_QWEN3_8B_H200 * bf16_bytes_per_token(36, 8, 128)  # same KV budget
    plan = qwen3_8b_plan()
    tokens = plan.max_total_tokens(budget)
    assert tokens % plan.page_size == 0
    assert plan.pool_bytes(tokens) <= budget < plan.pool_bytes(tokens + plan.page_size)
    assert tokens >= 6.5 * BF16_TOKENS_QWEN3_8B_H200, tokens / BF16_TOKENS_QWEN3_8B_H200


@pytest.mark.parametrize("page,rows,slots,budget", [(64, 9, 5, 10_000_000), (16, 3, 1, 2_345_678),
                                                    (128, 257, 1028, 3_000_000_000)])
def test_max_total_tokens_is_the_largest_fitting_page_multiple(page, rows, slots, budget):
    plan = OscarMemoryPlan(4, 2, 64, 32, "bfloat16", 4, 16, page, rows, slots)
    n = plan.max_total_tokens(budget)
    assert n > 0 and n % page == 0
    assert plan.pool_bytes(n) <= budget < plan.pool_bytes(n + page)
    assert plan.max_total_tokens(plan.fixed_bytes) == 0


def test_key_and_value_group_sizes_of_their_own():
    """Keys G=32, values G=128, float8 scales at head_dim 128: 2 * 32 code bytes + (4 + 1)
    groups * (scale, min) = 74 bytes per token and KV head."""
    split = OscarMemoryPlan(36, 8, 128, 32, "float8_e4m3fn", DEFAULT_SINK_TOKENS, DEFAULT_RECENT_WINDOW, 64,
                            257, 1028, value_group_size=128)
    assert split.value_group_size == 128 and split.bytes_per_token == 36 * 8 * 74
    keys_only = OscarMemoryPlan(36, 8, 128, 32, "float8_e4m3fn", DEFAULT_SINK_TOKENS, DEFAULT_RECENT_WINDOW,
                                64, 257, 1028)
    assert keys_only.value_group_size == 32 and keys_only.bytes_per_token == 36 * 8 * (64 + 2 * 4 * 2)
    budget = BF16_TOKENS_QWEN3_8B_H200 * bf16_bytes_per_token(36, 8, 128)
    n = split.max_total_tokens(budget)
    assert n > 0 and n % 64 == 0
    assert split.pool_bytes(n) <= budget < split.pool_bytes(n + 64)
    assert split.pool_bytes(n) - split.pool_bytes(n - 64) == 64 * 36 * 8 * 74 + 4  # one page: cells + index
    g128 = qwen3_8b_plan(group_size=128, value_group_size=128, scale_dtype="float16")
    assert split.num_sink_slots == 1028 and g128.num_sink_slots == 3 * 257
    g128_four = OscarMemoryPlan(36, 8, 128, 128, "float16", DEFAULT_SINK_TOKENS, DEFAULT_RECENT_WINDOW, 64,
                                257, 1028)
    assert n > g128_four.max_total_tokens(budget) * 72 / 74 - 64  # 74 vs 72 bytes per token


def test_plan_refuses_sinks_beyond_the_first_page():
    with pytest.raises(ValueError, match="page size") as e:
        OscarMemoryPlan(2, 2, 64, 32, "float16", sink_tokens=16, recent_window=8, page_size=8,
                        num_rows=3, num_sink_slots=4)
    assert "\n" not in str(e.value)


def test_planned_request_rows():
    assert planned_request_rows(None) == DEFAULT_MAX_RUNNING_REQUESTS
    assert planned_request_rows(64, attn_dp_size=2) == 32
    with pytest.raises(ValueError, match="max-running-requests"):
        planned_request_rows(1, attn_dp_size=2)


# ---------------------------------------------------------------- the pool on CPU

def small_pool(size=256, page=16, layers=2, heads=2, dim=64, group=32, sink=4, window=8, rows=5,
               seed=0, **kw):
    from oscar_kernels.testing import random_rotation

    g = torch.Generator().manual_seed(seed)
    rots = [random_rotation(heads, dim, g) for _ in range(layers)]
    r2t = torch.zeros(rows, 4 * page, dtype=torch.int32)
    return OscarKVPool(size, page, heads, dim, layers, "cpu", rotations=rots, req_to_token=r2t,
                       sink_tokens=sink, recent_window=window, group_size=group, **kw)


def test_pool_buffers_shapes_and_true_bytes():
    pool = small_pool(num_sink_slots=6)
    slots = 256 + 16
    assert pool.dtype == torch.bfloat16 and pool.store_dtype == torch.uint8
    for l in range(2):
        lc = pool.layers[l]
        assert pool.get_key_buffer(l) is lc.k_packed and pool.get_value_buffer(l) is lc.v_packed
        assert lc.k_packed.shape == (slots, 2, 16) and lc.k_packed.dtype == torch.uint8
        assert pool.k_scale_buffer[l] is lc.k_scales
        assert lc.v_scales.shape == (slots, 2, 2, 2) and lc.v_scales.dtype == torch.float8_e4m3fn  # the default
        assert lc.k_sink.shape == (6, 4, 2, 64) and lc.k_sink.dtype == torch.bfloat16
        assert lc.v_ring.shape == (5, 8, 2, 64) and lc.v_ring.dtype == torch.bfloat16
        assert pool.rotations[l].k_rot.dtype == torch.float32
    assert pool.index.sink_slot_of_page.shape == (slots // 16,)
    assert pool.index.ring_owner.shape == pool.index.ring_end.shape == (5,)
    assert pool.cache.layers is pool.layers and pool.cache.index is pool.index
    assert sum(pool.get_kv_size_bytes()) == pool.plan.pool_bytes(256)


def test_pool_with_value_groups_of_their_own():
    pool = small_pool(group=16, value_group_size=64, scale_dtype="float8_e4m3fn")
    slots = 256 + 16
    assert pool.plan.value_group_size == 64 and pool.plan.bytes_per_token == 2 * 2 * (2 * 16 + (4 + 1) * 2)
    for l in range(2):
        lc = pool.layers[l]
        assert lc.k_scales.shape == (slots, 2, 4, 2) and lc.v_scales.shape == (slots, 2, 1, 2)
        assert lc.v_scales.dtype == torch.float8_e4m3fn and pool.v_scale_buffer[l] is lc.v_scales
        assert (lc.key_group_size, lc.value_group_size) == (16, 64)
    assert sum(pool.get_kv_size_bytes()) == pool.plan.pool_bytes(256)


def test_pool_refuses_sinks_beyond_page_and_partial_copies():
    with pytest.raises(ValueError, match="page size"):
        small_pool(page=4, sink=8)
    pool = small_pool()
    idx = torch.tensor([16, 17])
    for call in (lambda: pool.get_cpu_copy(idx), lambda: pool.load_cpu_copy([], idx),
                 pool.get_contiguous_buf_infos, lambda: pool.set_kv_buffer_prefix_valid(None),
                 lambda: pool.move_kv_cache(idx, idx)):
        with pytest.raises(NotImplementedError, match=OSCAR_KV_DTYPE) as e:
            call()
        assert "\n" not in str(e.value)
    k = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="--attention-backend oscar"):
        pool.set_kv_buffer(SimpleNamespace(layer_id=0), idx, k, k)


def test_attention_over_the_pool_stores_like_the_reference():
    """The pool's cache is what HybridAttention writes: an extend of 20 tokens stores into
    the pool's layer exactly what the reference store writes into a fresh cache."""
    from oscar_kernels.hybrid_attention import HybridAttention

    pool = small_pool()
    page, row = 16, 2
    pool.req_to_token[row, :32] = torch.arange(32, 64, dtype=torch.int32)  # pages 2, 3
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(20, 2, 64, generator=g).bfloat16() for _ in range(2))
    slots, pos, rows = pool.req_to_token[row, :20], torch.arange(20), torch.tensor([row])
    attn = HybridAttention(pool.cache, 4, 0.125)
    attn.plan_extend(rows, torch.tensor([0]), torch.tensor([20]), pos, slots, prefix_lens_host=[0],
                     extend_lens_host=[20], owners=torch.tensor([7]))
    attn.extend(1, torch.zeros(20, 4, 64, dtype=torch.bfloat16), k, v)

    want = allocate_layer(256 + page, 2, 64, 32, 4, 8, pool.plan.num_sink_slots, 5)
    index = allocate_index(256 + page, page, pool.plan.num_sink_slots, 5)
    assign_sink_slots(index, pool.req_to_token[row:row + 1, 0], pool.plan.num_sink_slots)
    ref.reference_store(want, index, pool.rotations[1], pool.req_to_token, k, v, slots, pos,
                        torch.full((20,), row), torch.full((20,), 20))
    got = pool.layers[1]
    for name in ("k_packed", "v_packed", "k_scales", "k_sink", "v_sink", "k_ring", "v_ring"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert not pool.layers[0].k_packed.any()  # other layers untouched
    assert int(pool.index.ring_owner[row]) == 7 and int(pool.index.ring_end[row]) == 20

def test_pool_with_key_groups_per_layer_from_a_version_4_file(tmp_path):
    """Each cache layer is allocated at its model layer's key groups; the cell size is their sum."""
    path = write_distinct_heads_file(tmp_path / "rot.safetensors", HYBRID_QWEN3_NEXT, group_size=16,
                                     value_group_size=64, scale_dtype="float8_e4m3fn", key_group_sizes=(8, 32))
    layout = RankLayout(start_layer=0, num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, tp_rank=0,
                        tp_size=1, layer_ids=(3, 7))
    layers, meta = load_rank_rotations(path, HYBRID_QWEN3_NEXT, layout)
    plan = memory_plan(layout, meta, 4, 8, 5, None)
    assert plan.key_group_sizes == (8, 32)
    # per KV head: codes 2 x 16, (scale, min) fp8 of 64/G_K key groups and one value group
    assert plan.bytes_per_token == 2 * ((32 + (8 + 1) * 2) + (32 + (2 + 1) * 2))
    pool = small_pool(layers=2, group=16, value_group_size=64, key_group_sizes=plan.key_group_sizes, layer_ids=(3, 7))
    assert [(lc.key_group_size, lc.value_group_size) for lc in pool.layers] == [(8, 64), (32, 64)]
    assert pool.plan.bytes_per_token == plan.bytes_per_token
    assert sum(pool.get_kv_size_bytes()) == pool.plan.pool_bytes(256)
    with pytest.raises(ValueError, match="3 key group sizes for 2 layers"):
        small_pool(layers=2, key_group_sizes=(8, 16, 32))


# ---------------------------------------------------------------- rotations vs the model

def layout_for(config, tp_rank=0, tp_size=1, page=16):
    heads = max(1, config["num_key_value_heads"] // tp_size)
    return RankLayout(start_layer=0, num_layers=config["num_hidden_layers"], num_kv_heads=heads,
                      head_dim=config["head_dim"], page_size=page, tp_rank=tp_rank, tp_size=tp_size)


def test_rank_rotations_are_sliced_per_tp_rank(tmp_path):
    path = write_hadamard_file(tmp_path / "rot.safetensors", SMALL_QWEN3)
    layers, meta = load_rank_rotations(path, SMALL_QWEN3, layout_for(SMALL_QWEN3))
    assert len(layers) == 2 and layers[0].k_rot.shape == (2, 64, 64) and meta.group_size == 32
    layers1, meta1 = load_rank_rotations(path, SMALL_QWEN3, layout_for(SMALL_QWEN3, 1, 2))
    assert meta1.num_kv_heads == 1 and torch.equal(layers1[1].v_rot[0], layers[1].v_rot[1])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_each_rank_loads_exactly_its_kv_heads(tmp_path, tp):
    """2 KV heads: tp 2 gives one head per rank; tp 4 / 8 replicate each head on tp / 2
    consecutive ranks (SGLang's layout), with that head's own matrices."""
    path = write_distinct_heads_file(tmp_path / "rot.safetensors", SMALL_QWEN3)
    full, _ = load_rank_rotations(path, SMALL_QWEN3, layout_for(SMALL_QWEN3))
    heads_per_rank = max(1, 2 // tp)
    for rank in range(tp):
        part, meta = load_rank_rotations(path, SMALL_QWEN3, layout_for(SMALL_QWEN3, rank, tp))
        first = rank * 2 // tp
        want = list(range(first, first + heads_per_rank))
        assert meta.num_kv_heads == heads_per_rank
        for layer, ref_layer in zip(part, full):
            assert torch.equal(layer.k_rot, ref_layer.k_rot[want]) and torch.equal(layer.v_rot, ref_layer.v_rot[want])


HYBRID_QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                     "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 64, "hidden_size": 256, "full_attention_interval": 4}


def test_rank_rotations_are_looked_up_by_model_layer(tmp_path):
    """A file covering model layers 3 and 7: the pool holding those layers gets their rotations in
    that order; a pool that would hold layers 0 and 1 is refused in one line, never handed 3 and 7."""
    from oscar_kernels.contract.rotations_file import load_rotations

    path = write_distinct_heads_file(tmp_path / "rot.safetensors", HYBRID_QWEN3_NEXT)
    by_layer = load_rotations(path).by_model_layer()
    layout = RankLayout(start_layer=0, num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, tp_rank=0,
                        tp_size=1, layer_ids=(3, 7))
    layers, meta = load_rank_rotations(path, HYBRID_QWEN3_NEXT, layout)
    assert meta.layer_ids == (3, 7)
    assert [torch.equal(a.k_rot, b.k_rot) for a, b in zip(layers, (by_layer[3], by_layer[7]))] == [True, True]
    plain = RankLayout(start_layer=0, num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, tp_rank=0, tp_size=1)
    assert plain.layer_ids == (0, 1)
    with pytest.raises(ValueError, match=rf"^oscar rotations file {path}: the rotations file covers model layers "
                                         r"3,7, not 0,1 \(this rank's pool holds those\)$"):
        load_rank_rotations(path, HYBRID_QWEN3_NEXT, plain)


def test_pool_maps_model_layers_to_cache_layers():
    pool = small_pool(layer_ids=(3, 7))
    assert pool.cache_layer_of == {3: 0, 7: 1} and pool.cache_layer(7) == 1
    assert pool.get_key_buffer(7) is pool.k_buffer[1] and pool.get_value_buffer(3) is pool.v_buffer[0]
    with pytest.raises(ValueError, match=r"^oscar pool: model layer 4 has no INT2 cache here \(this pool holds "
                                         r"layers 3, 7\)$"):
        pool.cache_layer(4)
    staged = small_pool(start_layer=2, end_layer=3)  # pipeline stage: model layers 2 and 3, as before
    assert staged.cache_layer_of == {2: 0, 3: 1}


def test_float8_scale_file_sizes_the_pool_like_float16_groups_of_twice_the_size(tmp_path):
    f8 = write_distinct_heads_file(tmp_path / "f8.safetensors", SMALL_QWEN3, group_size=32, scale_dtype="float8_e4m3fn")
    f16 = write_distinct_heads_file(tmp_path / "f16.safetensors", SMALL_QWEN3, group_size=64)
    plans = []
    for path in (f8, f16):
        _, meta = load_rank_rotations(path, SMALL_QWEN3, layout_for(SMALL_QWEN3))
        plans.append(memory_plan(layout_for(SMALL_QWEN3), meta, 4, 8, 8, None))
    assert plans[0].scale_dtype == "float8_e4m3fn" and plans[0].bytes_per_token == plans[1].bytes_per_token


def test_value_group_size_from_the_file_reaches_plan_and_pool(tmp_path):
    path = write_distinct_heads_file(tmp_path / "kv.safetensors", SMALL_QWEN3, group_size=16,
                                     scale_dtype="float8_e4m3fn", value_group_size=64)
    kvc = fake_configurator(path, max_running_requests=7, sink=4, window=8)
    plan = plan_for_configurator(kvc)
    assert (plan.group_size, plan.value_group_size, plan.scale_dtype) == (16, 64, "float8_e4m3fn")
    assert plan.bytes_per_token == 2 * 2 * (2 * 16 + (4 + 1) * 2)
    pool = build_pool_for_configurator(kvc, 128, SimpleNamespace(req_to_token=torch.zeros(8, 64, dtype=torch.int32)))
    assert pool.plan == plan and sum(pool.get_kv_size_bytes()) == plan.pool_bytes(128)
    assert pool.layers[0].k_scales.shape[2:] == (4, 2) and pool.layers[0].v_scales.shape[2:] == (1, 2)


def test_rotations_for_another_model_fail_with_one_line(tmp_path, tinylm_dir):
    other = SHARED / "shapes" / "qwen3-8b-shape" / "config.json"
    if not other.is_file():
        pytest.skip(f"{other} not found")
    tiny = json.loads((tinylm_dir / "config.json").read_text())
    qwen8b = json.loads(other.read_text())
    path = write_hadamard_file(tmp_path / "tiny.safetensors", tiny, group_size=128)
    load_rank_rotations(path, tiny, layout_for(tiny))  # fits its own model
    with pytest.raises(RotationsFileError, match="num_layers=8") as e:
        load_rank_rotations(path, qwen8b, layout_for(qwen8b))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- from SGLang's configurator

def fake_configurator(rotations_path, max_running_requests=None, page=16, **oscar):
    cfg = SMALL_QWEN3
    mc = SimpleNamespace(hf_config=cfg, head_dim=64, v_head_dim=64,
                         get_num_kv_heads=lambda tp: max(1, cfg["num_key_value_heads"] // tp))
    args = SimpleNamespace(kv_cache_dtype=OSCAR_KV_DTYPE, oscar_rotations=rotations_path,
                           oscar_sink_tokens=oscar.get("sink"), oscar_recent_window=oscar.get("window"),
                           oscar_sink_slots=oscar.get("slots"),
                           max_running_requests=max_running_requests, enable_memory_saver=False)
    return SimpleNamespace(server_args=args, model_config=mc, ps=ParallelState.trivial(),
                           layer_info=SimpleNamespace(start_layer=0, end_layer=1, num_effective_layers=2),
                           pool_page_size=page, device="cpu", mambaish_config=None, is_hybrid_swa=False)


def test_plan_and_pool_from_configurator(tmp_path):
    path = write_hadamard_file(tmp_path / "rot.safetensors", SMALL_QWEN3)
    kvc = fake_configurator(path, max_running_requests=7, sink=4, window=8)
    plan = plan_for_configurator(kvc)
    assert (plan.num_rows, plan.num_sink_slots, plan.sink_tokens, plan.recent_window) == (8, 3 * 8, 4, 8)
    assert plan.bytes_per_token == 2 * 2 * 2 * (16 + 2 * 2 * 2)
    req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(8, 64, dtype=torch.int32))
    pool = build_pool_for_configurator(kvc, 128, req_to_token_pool)
    assert pool.plan == plan and sum(pool.get_kv_size_bytes()) == plan.pool_bytes(128)
    assert plan_for_configurator(fake_configurator(path)).num_rows == DEFAULT_MAX_RUNNING_REQUESTS + 1


def test_sink_slots_skip_those_in_use_until_none_is_left():
    """assign_sink_slots with in_use: the free slots nearest after the cursor; slots in use
    only when the free ones run out. sink_slots_in_use: the live rows' registered slots."""
    from oscar_kernels.hybrid_cache import sink_slot_for, sink_slots_in_use

    index = allocate_index(16 * 8, 16, 4, 4)
    r2t = torch.zeros(4, 8, dtype=torch.int32)
    r2t[1:, 0] = torch.tensor([16, 32, 48], dtype=torch.int32)  # rows 1-3 start on pages 1-3
    assign_sink_slots(index, r2t[1:, 0], 4)  # slots 0, 1, 2
    used = sink_slots_in_use(index, r2t, torch.tensor([1, 3]))
    assert used.tolist() == [1, 0, 1, 0]
    assign_sink_slots(index, torch.tensor([64, 80]), 4, used)  # pages 4, 5: slots 3 then 1 (wrapping)
    assert sink_slot_for(index, torch.tensor([64, 80, 16, 32, 48])).tolist() == [3, 1, 0, -1, 2]
    everything = torch.ones(4, dtype=torch.int32)
    assign_sink_slots(index, torch.tensor([96]), 4, everything)  # none free: round-robin from the cursor
    assert sink_slot_for(index, torch.tensor([96])).tolist() == [1]
    assert sink_slots_in_use(index, r2t, torch.tensor([], dtype=torch.int64)).tolist() == [0, 0, 0, 0]
