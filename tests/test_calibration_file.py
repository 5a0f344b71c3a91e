"""The rotations file: every recipe/variant writes an orthogonal, loadable file; every
validation error of load_rotations is one line; TP slicing."""
import json
import math

import pytest
import torch
from safetensors import safe_open

from calibration.calibrate import CalibrationConfig, build_rotations
from calibration.compose import VARIANTS
from oscar_kernels.contract.model_shape import ModelShape, kv_heads_for_rank
from oscar_kernels.contract.rotations_file import (RotationsFileError, load_rotations, orthogonality_error,
                                                   save_rotations)
from calibration.statistics import AttentionStats
from rotations_file_helpers import refusal as _error, rewrite as _rewrite

SHAPE = ModelShape("Qwen3ForCausalLM", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32)


def _stats(seed=0):
    """Statistics fed with random activations that have a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    stats = AttentionStats(2, 2, 32, reservoir_tokens=256, skip_first=1, seed=seed)
    scale = torch.ones(32)
    scale[[3, 17]] = 8.0
    for _ in range(3):
        for layer in range(2):
            q = torch.randn(2, 4, 64, 32, generator=g) * scale
            k = torch.randn(2, 2, 64, 32, generator=g) * scale
            v = torch.randn(2, 2, 64, 32, generator=g)
            o = torch.randn(2, 4, 64, 32, generator=g) * scale.flip(0)
            stats(layer, q, k, v, o)
    return stats


def _metric():
    w = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    return [(w.transpose(1, 2) @ w)[None].expand(2, 2, 32, 32).reshape(2, 2, 32, 32)[l] for l in range(2)]


RECIPES = ([("oscar", v, g) for v in VARIANTS for g in (32, 8)]
           + [("hadamard", "U-H", 32), ("naive", "U-H", 32), ("hadamard", "U-H", 8)])


@pytest.mark.parametrize("recipe,variant,group", RECIPES)
@pytest.mark.parametrize("clip", ["none", "channel"])
def test_every_recipe_and_variant_writes_an_orthogonal_loadable_file(tmp_path, recipe, variant, group, clip):
    cfg = CalibrationConfig(recipe=recipe, variant=variant, group_size=group, clip=clip, device="cpu",
                            scale_dtype="bfloat16").resolved()
    rot = build_rotations(cfg, SHAPE, "tiny", _stats(), _metric())
    path = str(tmp_path / "r.safetensors")
    save_rotations(path, rot)
    back = load_rotations(path, expect=SHAPE)
    m = back.meta
    assert (m.recipe, m.group_size, m.scale_dtype, m.num_layers) == (recipe, group, "bfloat16", 2)
    d = m.recipe_detail
    assert d["group_size"] == group and d["clip"] == clip and d["seed"] == 0 and d["tokens"] == 3 * 128
    assert d["variant"] == (variant if recipe == "oscar" else recipe) and "order" in d and "hadamard_span" in d
    for lr in back.layers:
        assert orthogonality_error(lr.k_rot) < 1e-5 and orthogonality_error(lr.v_rot) < 1e-5
        if clip == "none":
            assert torch.isinf(lr.k_clip_min).all() and torch.isinf(lr.v_clip_max).all()
        else:
            assert (lr.k_clip_min < lr.k_clip_max).all()
    if recipe == "naive":
        torch.testing.assert_close(back.layers[0].k_rot, torch.eye(32).expand(2, 32, 32))


def test_hadamard_span_is_recorded():
    for variant, span in (("U-H-P", "head"), ("U-P-Hblock", "group"), ("U", "none")):
        cfg = CalibrationConfig(variant=variant, group_size=8, clip="none", device="cpu").resolved()
        assert build_rotations(cfg, SHAPE, "t", _stats()).meta.recipe_detail["hadamard_span"] == span


def test_oscar_key_rotation_aligns_with_query_covariance():
    stats = _stats()
    cfg = CalibrationConfig(variant="U", group_size=32, clip="none", device="cpu").resolved()
    rot = build_rotations(cfg, SHAPE, "t", stats)
    r = rot.layers[0].k_rot[0].double()
    rotated = r.T @ stats.c_q()[0, 0] @ r  # diagonal, descending
    diag = torch.diagonal(rotated)
    torch.testing.assert_close(rotated, torch.diag(diag), atol=1e-6 * float(diag.max()), rtol=1e-6)  # R is float32
    assert (diag[:-1] >= diag[1:] - 1e-9).all()


# ---------------------------------------------------------------- validation error paths

def _good_file(tmp_path):
    cfg = CalibrationConfig(group_size=32, clip="channel", device="cpu").resolved()
    path = str(tmp_path / "good.safetensors")
    save_rotations(path, build_rotations(cfg, SHAPE, "tiny", _stats(), _metric()))
    return path


@pytest.mark.parametrize("field,value,words", [
    ("num_layers", 3, "num_layers=2"),
    ("num_kv_heads", 4, "num_kv_heads=2"),
    ("num_q_heads", 8, "num_q_heads=4"),
    ("head_dim", 64, "head_dim=32"),
    ("architecture", "LlamaForCausalLM", "architecture=Qwen3ForCausalLM"),
])
def test_wrong_model_is_refused(tmp_path, field, value, words):
    path = _good_file(tmp_path)
    other = ModelShape(**{**SHAPE.__dict__, field: value})
    assert words in _error(path, expect=other)


@pytest.mark.parametrize("what,value,words", [
    ("nan", math.nan, "contains NaN"),
    ("inf", math.inf, "contains Inf"),
])
def test_non_finite_rotation_is_refused(tmp_path, what, value, words):
    path = _good_file(tmp_path)

    def poison(t):
        t["k_rot.1"][0, 2, 3] = value
    assert words in _error(_rewrite(path, str(tmp_path / "bad.safetensors"), tensors=poison))


def test_nan_clip_is_refused(tmp_path):
    path = _good_file(tmp_path)

    def poison(t):
        t["v_clip_min.0"][1, 5] = math.nan
    assert "v_clip_min.0 contains NaN" in _error(_rewrite(path, str(tmp_path / "bad.safetensors"), tensors=poison))


def test_clip_min_above_max_is_refused(tmp_path):
    path = _good_file(tmp_path)

    def swap(t):
        t["k_clip_min.0"], t["k_clip_max.0"] = t["k_clip_max.0"].clone(), t["k_clip_min.0"].clone()
    assert "k_clip_min.0 is not below k_clip_max.0" in _error(_rewrite(path, str(tmp_path / "b.safetensors"), tensors=swap))


def test_non_orthogonal_rotation_is_refused(tmp_path):
    path = _good_file(tmp_path)

    def scale(t):
        t["v_rot.0"] *= 1.01
    assert "v_rot.0 is not orthogonal" in _error(_rewrite(path, str(tmp_path / "bad.safetensors"), tensors=scale))


def test_key_shift_round_trips_and_version_1_files_load_without_it(tmp_path):
    """Version 2 files carry k_shift.{l} (the rotated keys' calibrated mean); version-1 files,
    which predate it, load with a zero shift; a version-1 file with a shift tensor is refused."""
    path = _good_file(tmp_path)
    rot = load_rotations(path)
    assert rot.meta.recipe_detail["key_shift"] == "mean"
    assert all(lr.k_shift.abs().sum() > 0 for lr in rot.layers)
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["version"] == "2"
        assert torch.equal(f.get_tensor("k_shift.1"), rot.layers[1].k_shift)

    def drop_shift(t):
        for name in [n for n in t if n.startswith("k_shift.")]:
            del t[name]

    v1 = _rewrite(path, str(tmp_path / "v1.safetensors"), tensors=drop_shift,
                  meta=lambda m: m.__setitem__("version", "1"))
    old = load_rotations(v1)
    assert all(torch.equal(lr.k_shift, torch.zeros_like(lr.k_clip_min)) for lr in old.layers)
    assert torch.equal(old.layers[0].k_rot, rot.layers[0].k_rot)
    mixed = _rewrite(path, str(tmp_path / "v1s.safetensors"), meta=lambda m: m.__setitem__("version", "1"))
    assert "unexpected k_shift.0, k_shift.1" in _error(mixed)
    no_shift = _rewrite(path, str(tmp_path / "v2.safetensors"), tensors=drop_shift)
    assert "missing k_shift.0, k_shift.1" in _error(no_shift)


def test_unknown_version_is_refused(tmp_path):
    path = _good_file(tmp_path)
    bad = _rewrite(path, str(tmp_path / "v.safetensors"), meta=lambda m: m.__setitem__("version", "99"))
    assert "unsupported format version '99'" in _error(bad)


def test_truncated_file_is_refused(tmp_path):
    path = _good_file(tmp_path)
    data = open(path, "rb").read()
    bad = tmp_path / "trunc.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    assert "not a readable safetensors file" in _error(str(bad))


def test_garbage_and_missing_files_are_refused(tmp_path):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"\x00" * 7)
    assert _error(str(bad)).endswith(": not a safetensors file (no valid safetensors header)")
    bad.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                  dtype=torch.uint8).numpy().tobytes())
    assert _error(str(bad)).endswith(": not a safetensors file (no valid safetensors header)")
    assert "no such file" in _error(str(tmp_path / "absent.safetensors"))


@pytest.mark.parametrize("zipped", [True, False], ids=["torch.save", "plain-pickle"])
def test_pickle_files_are_refused_as_pickles(tmp_path, zipped):
    import pickle

    bad = tmp_path / "zoo.safetensors"
    if zipped:
        torch.save({"k_rot.0": torch.eye(4)}, bad)
    else:
        bad.write_bytes(pickle.dumps({"k_rot.0": [1.0]}))
    err = _error(str(bad))
    assert "not a safetensors file but a pickle (torch.save) file" in err
    assert "oscar-calibrate import-oscar-zoo" in err


def test_missing_tensor_is_refused(tmp_path):
    path = _good_file(tmp_path)
    bad = _rewrite(path, str(tmp_path / "m.safetensors"), tensors=lambda t: t.pop("v_clip_max.1"))
    assert _error(bad).endswith(": tensor set does not match metadata: missing v_clip_max.1")


def test_wrong_tensor_shape_is_refused(tmp_path):
    path = _good_file(tmp_path)
    bad = _rewrite(path, str(tmp_path / "s.safetensors"),
                   tensors=lambda t: t.__setitem__("k_rot.0", t["k_rot.0"][:1].contiguous()))
    assert "k_rot.0 has shape (1, 32, 32), expected (2, 32, 32)" in _error(bad)


@pytest.mark.parametrize("mutate,words", [
    (lambda m: m.__setitem__("format", "something-else"), "not an OSCAR rotations file"),
    (lambda m: m.pop("head_dim"), "metadata lacks head_dim"),
    (lambda m: m.__setitem__("num_layers", "two"), "metadata num_layers='two' is not an integer"),
    (lambda m: m.__setitem__("recipe_detail", "{not json"), "recipe_detail is not valid JSON"),
    (lambda m: m.__setitem__("recipe", "magic"), "unknown recipe 'magic'"),
    (lambda m: m.__setitem__("bits", "4"), "bits=4, only 2-bit files are served"),
    (lambda m: m.__setitem__("group_size", "24"), "group_size 24 must be a power of two"),
    (lambda m: m.__setitem__("scale_dtype", "int8"), "unknown scale_dtype 'int8'"),
    (lambda m: m.pop("scale_dtype"), "metadata lacks scale_dtype"),  # no default dtype: the file says
    (lambda m: m.__setitem__("value_group_size", "48"), "value_group_size 48 must be a power of two dividing head_dim 32"),
    (lambda m: m.__setitem__("value_group_size", "24"), "value_group_size 24 must be a power of two"),
    (lambda m: m.__setitem__("value_group_size", "big"), "metadata value_group_size='big' is not an integer"),
])
def test_bad_metadata_is_refused(tmp_path, mutate, words):
    path = _good_file(tmp_path)
    assert words in _error(_rewrite(path, str(tmp_path / "meta.safetensors"), meta=mutate))


# ---------------------------------------------------------------- values' own group size

def test_value_group_size_round_trip(tmp_path):
    cfg = CalibrationConfig(group_size=8, value_group_size=32, clip="channel", device="cpu",
                            scale_dtype="float8_e4m3fn").resolved()
    rot = build_rotations(cfg, SHAPE, "tiny", _stats(), _metric())
    path = str(tmp_path / "kv.safetensors")
    save_rotations(path, rot)
    with safe_open(path, framework="pt") as f:
        md = f.metadata()
    assert (md["group_size"], md["value_group_size"], md["scale_dtype"]) == ("8", "32", "float8_e4m3fn")
    m = load_rotations(path, expect=SHAPE).meta
    assert (m.group_size, m.value_group_size, m.scale_dtype) == (8, 32, "float8_e4m3fn")
    assert (m.recipe_detail["group_size"], m.recipe_detail["value_group_size"]) == (8, 32)
    half = load_rotations(path).for_tp_rank(1, 2).meta
    assert (half.num_kv_heads, half.group_size, half.value_group_size) == (1, 8, 32)


def test_file_without_value_group_size_loads_with_the_keys_group(tmp_path):
    old = _rewrite(_good_file(tmp_path), str(tmp_path / "old.safetensors"), meta=lambda m: m.pop("value_group_size"))
    with safe_open(old, framework="pt") as f:
        assert "value_group_size" not in f.metadata()
    m = load_rotations(old, expect=SHAPE).meta
    assert (m.group_size, m.value_group_size) == (32, 32)


@pytest.mark.parametrize("variant", ["U-P-Hblock", "U-H"])
def test_values_are_composed_and_clipped_at_their_own_group_size(variant):
    """Keys at G_K, values at G_V: each tensor's rotation (block Hadamard: depends on G) and
    clip search equal a run with that group size for both tensors."""
    def run(gk, gv):
        cfg = CalibrationConfig(variant=variant, group_size=gk, value_group_size=gv, clip="channel",
                                device="cpu").resolved()
        return build_rotations(cfg, SHAPE, "t", _stats(), _metric())

    split, keys_like, values_like = run(8, 32), run(8, 8), run(32, 32)
    for l in range(2):
        a, k, v = split.layers[l], keys_like.layers[l], values_like.layers[l]
        assert torch.equal(a.k_rot, k.k_rot) and torch.equal(a.k_clip_min, k.k_clip_min)
        assert torch.equal(a.v_rot, v.v_rot) and torch.equal(a.v_clip_max, v.v_clip_max)
        assert not torch.equal(a.v_clip_max, k.v_clip_max)  # the group size moves the clip
        assert torch.equal(a.v_rot, k.v_rot) == (variant == "U-H")
    with pytest.raises(ValueError, match="value group size 48 must be a power of two dividing head_dim 32"):
        run(8, 48)


def test_layer_count_mismatch_between_metadata_and_tensors_is_refused(tmp_path):
    path = _good_file(tmp_path)
    def three_layers_no_field(m):  # a file from before the layers field: it covers every layer
        m["num_layers"] = "3"
        del m["layers"]
    bad = _rewrite(path, str(tmp_path / "l.safetensors"), meta=three_layers_no_field)
    assert _error(bad).endswith(": tensor set does not match metadata: missing k_clip_max.2, k_clip_min.2, "
                                "k_rot.2 and 4 more")
    bad = _rewrite(path, str(tmp_path / "u.safetensors"), tensors=lambda t: t.__setitem__("x", torch.ones(1)))
    assert _error(bad).endswith(": tensor set does not match metadata: unexpected x")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_saved_file_has_the_umask_mode_and_no_temp_is_left(tmp_path, umask):
    import os
    import stat

    cfg = CalibrationConfig(group_size=32, clip="none", device="cpu").resolved()
    rot = build_rotations(cfg, SHAPE, "tiny", _stats())
    old = os.umask(umask)
    try:
        save_rotations(str(tmp_path / "r.safetensors"), rot)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "r.safetensors").st_mode) == 0o666 & ~umask
    assert load_rotations(str(tmp_path / "r.safetensors")).meta.model_name == "tiny"
    (tmp_path / "d.safetensors").mkdir()  # os.replace onto a folder fails after the temp file is written
    with pytest.raises(OSError):
        save_rotations(str(tmp_path / "d.safetensors"), rot)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors", "r.safetensors"]


def test_save_refuses_what_load_would_refuse(tmp_path):
    cfg = CalibrationConfig(group_size=32, clip="none", device="cpu").resolved()
    rot = build_rotations(cfg, SHAPE, "tiny", _stats())
    rot.layers[0].k_rot[0, 0, 0] += 0.5
    with pytest.raises(RotationsFileError, match="not orthogonal"):
        save_rotations(str(tmp_path / "x.safetensors"), rot)
    assert not (tmp_path / "x.safetensors").exists()


def test_recipe_detail_is_json_in_the_file(tmp_path):
    path = _good_file(tmp_path)
    with safe_open(path, framework="pt") as f:
        detail = json.loads(f.metadata()["recipe_detail"])
    assert detail["clip"] == "channel" and detail["clip_objective"] == "attn" and len(detail["clip_search"]) == 4


# ---------------------------------------------------------------- tensor parallelism

@pytest.mark.parametrize("kv_heads", [2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_heads_for_rank(kv_heads, tp):
    per_rank = [kv_heads_for_rank(kv_heads, tp, r) for r in range(tp)]
    if tp <= kv_heads:
        assert all(len(h) == kv_heads // tp for h in per_rank)
        assert sum(per_rank, []) == list(range(kv_heads))  # contiguous, each head once
    else:
        rep = tp // kv_heads
        assert per_rank == [[r // rep] for r in range(tp)]  # each head on `rep` consecutive ranks
        assert sorted(h for hs in per_rank for h in hs) == sorted(list(range(kv_heads)) * rep)


def test_kv_heads_for_rank_errors():
    with pytest.raises(ValueError, match="out of range"):
        kv_heads_for_rank(4, 2, 2)
    with pytest.raises(ValueError, match="cannot be split"):
        kv_heads_for_rank(6, 4, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        kv_heads_for_rank(4, 6, 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rotations_for_tp_rank_slices_heads(tmp_path, tp):
    rot = load_rotations(_good_file(tmp_path))
    for rank in range(tp):
        part = rot.for_tp_rank(rank, tp)
        heads = kv_heads_for_rank(2, tp, rank)
        assert part.meta.num_kv_heads == len(heads)
        for full, sl in zip(rot.layers, part.layers):
            torch.testing.assert_close(sl.k_rot, full.k_rot[heads])
            torch.testing.assert_close(sl.v_clip_max, full.v_clip_max[heads])
