"""benchmarks/fidelity_sweep.py: the memory each (S, W) of the sweep costs."""
from oscar_kernels.contract.model_shape import ModelShape


def test_sweep_memory_costs():
    from benchmarks.fidelity_sweep import memory_costs
    shape = ModelShape("Qwen3ForCausalLM", 8, 4, 2, 128)
    m = memory_costs(shape, 32, "float16", sink=16, recent=128)
    assert m["bf16_bytes_per_token"] == 8 * 2 * 128 * 2 * 2
    assert m["int2_bytes_per_token"] == 8 * 2 * 2 * (32 + 4 * 2 * 2)
    assert m["ring_bytes_per_request"] == 128 * m["bf16_bytes_per_token"]
    assert m["sink_in_int2_tokens"] == round(16 * 8192 / 1536, 1)
    assert (m["group_size"], m["value_group_size"], m["scale_dtype"]) == (32, 32, "float16")
    split = memory_costs(shape, 32, "float8_e4m3fn", sink=16, recent=128, value_group_size=128)
    assert split["int2_bytes_per_token"] == 8 * 2 * 74 and split["value_group_size"] == 128
    assert split["ring_in_int2_tokens"] == round(128 * 8192 / (8 * 2 * 74), 1)
