"""Models whose full-attention layers are a subset (hybrid linear attention, sliding windows):
ModelShape's layer detection per config pattern, the rotations file's ``layers`` field (round
trip, the loader's one-line refusals, check_matches_model) and lookups by model layer."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from calibration.calibrate import CalibrationConfig, build_rotations
from oscar_kernels.contract.model_shape import ModelShape, format_layers
from oscar_kernels.contract.rotations_file import (RotationsFileError, check_matches_model, load_rotations,
                                                   save_rotations)
from rotations_file_helpers import refusal as _error, rewrite as _rewrite

BASE = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 128}


def _cfg(n, **kw):
    return {"architectures": ["XForCausalLM"], "num_hidden_layers": n, **BASE, **kw}


# ---------------------------------------------------------------- ModelShape: which layers are full attention

@pytest.mark.parametrize("cfg,want", [
    (_cfg(8, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
          + ["full_attention"]), (3, 7)),  # Qwen3-Next / Qwen3.5 layer_types
    (_cfg(8, full_attention_interval=4), (3, 7)),  # Qwen3-Next config.json without layer_types
    (_cfg(4, layer_types=["sliding_attention", "full_attention"] * 2), (1, 3)),  # gpt-oss
    (_cfg(12, sliding_window_pattern=6), (5, 11)),  # Gemma-3 config.json without layer_types
    (_cfg(4, layer_types=["mamba", "attention", "mamba", "moe"]), (1,)),  # Nemotron-H / Bamba
    (_cfg(4, layer_types=["chunked_attention"] * 3 + ["full_attention"]), (3,)),  # Llama-4
    (_cfg(3, layer_types=["full_attention"] * 3), (0, 1, 2)),  # Qwen2/3 without sliding window
    (_cfg(3), (0, 1, 2)),  # a plain model: every layer
], ids=["layer_types-linear", "full_attention_interval", "layer_types-sliding", "sliding_window_pattern",
        "mamba-attention", "chunked", "all-full-types", "plain"])
def test_full_attention_layers_from_a_config_dict(cfg, want):
    shape = ModelShape.from_hf_config(cfg)
    assert shape.attention_layers == want
    assert shape.num_layers == cfg["num_hidden_layers"]
    assert shape.is_hybrid == (len(want) != cfg["num_hidden_layers"])


def test_text_config_is_read_for_multimodal_configs():
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"],
           "text_config": _cfg(4, layer_types=["linear_attention"] * 3 + ["full_attention"])}
    assert ModelShape.from_hf_config(cfg).attention_layers == (3,)


@pytest.mark.parametrize("model_type,want", [
    ("qwen3_next", (3, 7)), ("qwen3_5_text", (3, 7)), ("qwen3_5_moe_text", (3, 7)),
    ("gpt_oss", (1, 3, 5, 7)), ("gemma3_text", (5,)), ("llama", tuple(range(8))),
])
def test_installed_transformers_configs_give_their_layer_pattern(model_type, want):
    """The exact layer_types strings of the installed transformers' own defaults."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, num_hidden_layers=8)
    assert ModelShape.from_hf_config(cfg).attention_layers == want
    assert ModelShape.from_hf_config(cfg.to_dict()).attention_layers == want


def test_layer_types_of_another_length_is_one_line():
    with pytest.raises(ValueError, match="^config layer_types names 2 layers, num_hidden_layers is 3$"):
        ModelShape.from_hf_config(_cfg(3, layer_types=["full_attention"] * 2))


def test_positional_construction_covers_every_layer():
    shape = ModelShape("LlamaForCausalLM", 3, 4, 2, 32)
    assert shape.attention_layers == (0, 1, 2) and not shape.is_hybrid
    assert shape == ModelShape("LlamaForCausalLM", 3, 4, 2, 32, (0, 1, 2))
    assert ModelShape("X", 8, 4, 2, 32, [3, 7]).attention_layers == (3, 7)


def test_format_layers_shortens_long_lists():
    assert format_layers([3, 7, 11]) == "3,7,11"
    assert format_layers(range(48), limit=4) == "0,1,2,3,... (48 in all)"


# ---------------------------------------------------------------- the file's layers field

HYBRID = ModelShape("Qwen3NextForCausalLM", 8, 4, 2, 32, (3, 7))
PLAIN = ModelShape("Qwen3NextForCausalLM", 8, 4, 2, 32)


def _file(tmp_path, shape=HYBRID, recipe="hadamard", name="r.safetensors") -> str:
    cfg = CalibrationConfig(recipe=recipe, device="cpu").resolved()
    path = str(tmp_path / name)
    save_rotations(path, build_rotations(cfg, shape, "tiny", None))
    return path


def test_hybrid_file_round_trip_names_tensors_by_model_layer(tmp_path):
    path = _file(tmp_path)
    with safe_open(path, framework="pt") as f:
        md, keys = f.metadata(), set(f.keys())
    assert json.loads(md["layers"]) == [3, 7] and md["version"] == "3" and md["num_layers"] == "8"
    assert {k.split(".")[1] for k in keys} == {"3", "7"} and "k_rot.3" in keys and "v_rot.7" in keys
    rot = load_rotations(path, expect=HYBRID)
    assert rot.meta.layer_ids == (3, 7) and rot.meta.shape == HYBRID and len(rot.layers) == 2
    t = load_file(path)
    by_layer = rot.by_model_layer()
    assert sorted(by_layer) == [3, 7]
    assert torch.equal(by_layer[7].k_rot, t["k_rot.7"]) and torch.equal(rot.for_model_layers([7])[0].v_rot,
                                                                        t["v_rot.7"])
    assert rot.for_tp_rank(1, 2).meta.layer_ids == (3, 7)


def test_file_for_every_layer_stays_version_2_and_lists_them(tmp_path):
    path = _file(tmp_path, PLAIN)
    with safe_open(path, framework="pt") as f:
        md = f.metadata()
    assert md["version"] == "2" and json.loads(md["layers"]) == list(range(8))
    assert load_rotations(path, expect=PLAIN).meta.layer_ids == tuple(range(8))


def test_file_without_the_field_covers_every_layer(tmp_path):
    old = _rewrite(_file(tmp_path, PLAIN), str(tmp_path / "old.safetensors"), meta=lambda m: m.pop("layers"))
    rot = load_rotations(old, expect=PLAIN)
    assert rot.meta.layer_ids == tuple(range(8)) and rot.meta.covers_every_layer


def test_lookup_of_an_uncovered_layer_is_one_line(tmp_path):
    rot = load_rotations(_file(tmp_path))
    with pytest.raises(ValueError, match=r"^the rotations file covers model layers 3,7, not 0,4$"):
        rot.for_model_layers([0, 3, 4])


@pytest.mark.parametrize("value,words", [
    ("3,7", "metadata layers='3,7' is not a JSON list of layer numbers"),
    ('["3", "7"]', "metadata layers='[\"3\", \"7\"]' is not a JSON list of layer numbers"),
    ("[true, 7]", "metadata layers='[true, 7]' is not a JSON list of layer numbers"),
    ("[7, 3]", "metadata layers 7,3 is not ascending without repeats"),
    ("[3, 3]", "metadata layers 3,3 is not ascending without repeats"),
    ("[3, 8]", "metadata layers names 8, outside the model's 8 layers (0..7)"),
    ("[-1, 3]", "metadata layers names -1, outside the model's 8 layers (0..7)"),
    ("[]", "metadata layers is empty: the file covers no layer"),
])
def test_bad_layers_field_is_refused(tmp_path, value, words):
    bad = _rewrite(_file(tmp_path), str(tmp_path / "bad.safetensors"), meta=lambda m: m.__setitem__("layers", value))
    assert _error(bad).endswith(": " + words)


def test_version_3_file_without_the_field_is_refused(tmp_path):
    bad = _rewrite(_file(tmp_path), str(tmp_path / "bad.safetensors"), meta=lambda m: m.pop("layers"))
    assert _error(bad).endswith(": version 3 file without the metadata 'layers' field")


def test_version_2_file_covering_some_layers_is_refused(tmp_path):
    bad = _rewrite(_file(tmp_path), str(tmp_path / "bad.safetensors"), meta=lambda m: m.__setitem__("version", "2"))
    assert _error(bad).endswith(": version 2 file covering only layers 3,7 of 8 (such a file is version 3)")


def test_missing_tensor_of_a_covered_layer_is_refused(tmp_path):
    bad = _rewrite(_file(tmp_path), str(tmp_path / "bad.safetensors"), tensors=lambda t: t.pop("k_rot.7"))
    assert _error(bad).endswith(": tensor set does not match metadata: missing k_rot.7")


def test_tensor_of_an_uncovered_layer_is_refused(tmp_path):
    def add(t):
        t["k_rot.0"] = t["k_rot.3"].clone()
    bad = _rewrite(_file(tmp_path), str(tmp_path / "bad.safetensors"), tensors=add)
    assert _error(bad).endswith(": tensor set does not match metadata: unexpected k_rot.0")


def test_file_for_every_layer_is_refused_for_a_hybrid_model(tmp_path):
    path = _file(tmp_path, PLAIN)
    assert _error(path, expect=HYBRID).endswith(": covers layers 0,1,2,3,4,5,6,7 but the model's "
                                                "full-attention layers are 3,7")


def test_hybrid_file_is_refused_for_other_layers(tmp_path):
    path = _file(tmp_path)
    with pytest.raises(RotationsFileError, match=r": covers layers 3,7 but the model's full-attention layers "
                                                 r"are 0,1,2,3,4,5,6,7$"):
        check_matches_model(load_rotations(path).meta, PLAIN, path)
    other = ModelShape("Qwen3NextForCausalLM", 8, 4, 2, 32, (1, 3, 5, 7))
    assert _error(path, expect=other).endswith(": covers layers 3,7 but the model's full-attention layers "
                                               "are 1,3,5,7")
