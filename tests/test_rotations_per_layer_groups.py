"""Rotations files whose layers take their own key group size (version 4, ``key_group_sizes``):
round trip, what each reader sees, and the one-line refusals of a bad field."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import (Rotations, load_rotations, make_meta, no_clip,
                                                   save_rotations)
from oscar_kernels.hybrid_cache import LayerRotation
from oscar_kernels.testing import random_rotation
from rotations_file_helpers import refusal, rewrite

SHAPE = ModelShape("Qwen3ForCausalLM", num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=64)


def _file(tmp_path, groups=(8, 16, 32, 16), name="per_layer.safetensors", shape=SHAPE) -> str:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in shape.attention_layers:
        r = random_rotation(shape.num_kv_heads, shape.head_dim, g)
        lo, hi = no_clip(shape.num_kv_heads, shape.head_dim)
        layers.append(LayerRotation(r.k_rot, r.v_rot, lo, hi, lo.clone(), hi.clone(), torch.zeros_like(lo)))
    meta = make_meta(shape, "tiny", KVLayout(16, 64, "float8_e4m3fn"), "oscar")
    meta = dataclasses.replace(meta, key_group_sizes=groups)
    path = str(tmp_path / name)
    save_rotations(path, Rotations(meta, layers))
    return path


def test_per_layer_key_groups_round_trip_as_version_4(tmp_path):
    path = _file(tmp_path)
    with safe_open(path, framework="pt") as f:
        md = f.metadata()
    assert md["version"] == "4" and md["key_group_sizes"] == "[8, 16, 32, 16]" and md["group_size"] == "16"
    m = load_rotations(path, expect=SHAPE).meta
    assert m.key_group_sizes == (8, 16, 32, 16) and m.per_layer_key_groups
    assert [x.key_group_size for x in m.layer_layouts()] == [8, 16, 32, 16]
    assert [x.key_group_size for x in m.layer_layouts([3, 0])] == [16, 8]
    assert {x.value_group_size for x in m.layer_layouts()} == {64}
    # K and V bytes per token-head at head_dim 64, float8 (scale, min): codes 32 + key groups x 2 + 1 x 2
    assert m.mean_bytes_per_token_per_head() == (50 + 42 + 38 + 42) / 4 == 43
    with pytest.raises(ValueError, match="per layer"):
        _ = m.layout
    # a tensor-parallel rank's slice keeps the layers' groups
    assert load_rotations(path).for_tp_rank(1, 2).meta.key_group_sizes == (8, 16, 32, 16)


def test_uniform_groups_write_no_field_and_keep_their_version(tmp_path):
    path = _file(tmp_path, groups=(16, 16, 16, 16))
    with safe_open(path, framework="pt") as f:
        md = f.metadata()
    assert md["version"] == "2" and "key_group_sizes" not in md
    m = load_rotations(path, expect=SHAPE).meta
    assert m.key_group_sizes == (16,) * 4 and not m.per_layer_key_groups and m.layout.key_group_size == 16


def test_partial_layer_files_carry_groups_per_covered_layer(tmp_path):
    hybrid = dataclasses.replace(SHAPE, attention_layers=(1, 3))
    path = _file(tmp_path, groups=(8, 32), shape=hybrid)
    m = load_rotations(path, expect=hybrid).meta
    assert m.version == "4" and m.layer_ids == (1, 3) and m.key_group_sizes == (8, 32)
    assert [x.key_group_size for x in m.layer_layouts([3])] == [32]
    with pytest.raises(ValueError, match="not 0"):
        m.layer_layouts([0])


@pytest.mark.parametrize("mutate,words", [
    (lambda m: m.pop("key_group_sizes"), "version 4 file without the metadata 'key_group_sizes' field"),
    (lambda m: m.__setitem__("key_group_sizes", "[8, 16]"), "key_group_sizes names 2 layers, the file covers 4"),
    (lambda m: m.__setitem__("key_group_sizes", "[8, 16, 24, 16]"), "key group size 24 of layer 2 must be a power of two"),
    (lambda m: m.__setitem__("key_group_sizes", "8,16"), "is not a JSON list of integers"),
    (lambda m: m.__setitem__("version", "2"), "key_group_sizes in a version 2 file"),
])
def test_bad_key_group_sizes_are_refused_in_one_line(tmp_path, mutate, words):
    path = rewrite(_file(tmp_path), str(tmp_path / "bad.safetensors"), meta=mutate)
    assert words in refusal(path)


def test_save_refuses_what_load_would_refuse(tmp_path):
    with pytest.raises(ValueError, match="key group size 12 of layer 1"):
        _file(tmp_path, groups=(8, 12, 16, 16))
