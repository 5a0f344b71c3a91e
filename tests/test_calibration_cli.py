"""oscar-calibrate end to end: SmolLM2-135M-Instruct, tiny random models, import-oscar-zoo, proxy."""
import json

import pytest
import torch

from calibration.calibrate import CalibrationConfig, calibrate, load_model, model_shape
from calibration.cli import main
from oscar_kernels.contract.model_shape import ModelShape
from calibration.proxy import run_proxy
from oscar_kernels.contract.rotations_file import load_rotations, orthogonality_error
from calibration import text_sources
from calibration_helpers import save_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", kv_heads=2, head_dim=32)


@pytest.mark.slow
def test_real_model_end_to_end_small_budget(real_model_dir, tmp_path):
    """SmolLM2-135M-Instruct on the CPU: 3 query heads per KV head, head_dim 64 (key group 16)."""
    out = str(tmp_path / "smollm2.safetensors")
    rc = main(["--model", str(real_model_dir), "--out", out, "--tokens", "1024", "--seq-len", "512",
               "--device", "cpu", "--quiet"])
    assert rc == 0
    shape = model_shape(str(real_model_dir))
    assert shape == ModelShape("LlamaForCausalLM", num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64)
    rot = load_rotations(out, expect=shape)
    m = rot.meta
    assert (m.architecture, m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim) == ("LlamaForCausalLM", 30, 9, 3, 64)
    assert m.recipe == "oscar" and m.calib_tokens == 1024
    # the default layout at head_dim 64: keys one group per plane, values one group, float8 (scale, min)
    assert (m.group_size, m.value_group_size, m.scale_dtype) == (16, 64, "float8_e4m3fn")
    d = m.recipe_detail
    assert d["tokens"] == 1024 and d["clip"] == "none" and d["variant"] == "U-H-P" and d["seq_len"] == 512
    assert "stdlib" in m.calib_data
    for lr in rot.layers:
        assert lr.k_rot.shape == lr.v_rot.shape == (3, 64, 64)
        assert orthogonality_error(lr.k_rot) < 1e-5 and orthogonality_error(lr.v_rot) < 1e-5
    # calibrated, not a data-free fallback: each layer's key rotations differ between KV heads
    assert not torch.allclose(rot.layers[0].k_rot[0], rot.layers[0].k_rot[1])


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral", "qwen2"])
def test_cli_recipes_on_tiny_models(tmp_path, family):
    d = save_tiny_model_dir(tmp_path / family, family, kv_heads=2, head_dim=32)
    shape = model_shape(d)
    for recipe, extra in (("oscar", ["--variant", "U-P-Hblock", "--group-size", "16", "--clip", "head"]),
                          ("hadamard", ["--clip", "layer", "--clip-objective", "mse"]),
                          ("naive", [])):
        out = str(tmp_path / f"{family}-{recipe}.safetensors")
        assert main(["--model", d, "--out", out, "--recipe", recipe, "--tokens", "256", "--seq-len", "64",
                     "--batch-size", "2", "--clip-sample", "128", "--scale-dtype", "bfloat16", "--quiet", *extra]) == 0
        rot = load_rotations(out, expect=shape)
        assert rot.meta.recipe == recipe and rot.meta.scale_dtype == "bfloat16"
        assert rot.meta.recipe_detail["batch_size"] == 2
    assert load_rotations(str(tmp_path / f"{family}-oscar.safetensors")).meta.group_size == 16
    naive = load_rotations(str(tmp_path / f"{family}-naive.safetensors"))
    assert naive.meta.calib_tokens == 0 and torch.isinf(naive.layers[0].v_clip_max).all()
    hadamard = load_rotations(str(tmp_path / f"{family}-hadamard.safetensors"))
    assert hadamard.meta.recipe_detail["clip"] == "layer" and len(hadamard.meta.recipe_detail["clip_search"]) == 4


def test_default_clip_per_recipe():
    assert CalibrationConfig(device="cpu").resolved().clip == "none"
    assert CalibrationConfig(recipe="hadamard", device="cpu").resolved().clip == "none"
    assert CalibrationConfig(recipe="naive", device="cpu").resolved().clip == "none"
    assert not CalibrationConfig(recipe="hadamard", device="cpu").resolved().needs_forward
    with pytest.raises(ValueError, match="unknown variant"):
        CalibrationConfig(variant="X", device="cpu").resolved()


def test_cli_reads_jsonl_data(tmp_path, tiny_dir):
    data = tmp_path / "c.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 20}) for i in range(20)))
    out = str(tmp_path / "j.safetensors")
    assert main(["--model", tiny_dir, "--out", out, "--data", str(data), "--tokens", "256", "--seq-len", "128",
                 "--clip", "none", "--quiet"]) == 0
    rot = load_rotations(out)
    assert rot.meta.calib_tokens == 256 and str(data) in rot.meta.calib_data


def test_cli_errors_are_one_line(tmp_path, tiny_dir, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert main(["--model", tiny_dir, "--out", str(tmp_path / "o"), "--group-size", "24", "--quiet"]) == 2
    assert main(["--model", tiny_dir, "--out", str(tmp_path / "o"), "--data", str(tmp_path / "none.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [e for e in err if e.startswith("oscar-calibrate: error: ")]
    assert len(err) == 3
    assert "no config.json" in err[0] and "group size 24" in err[1] and "no such file or folder" in err[2]


def test_calibration_is_deterministic(tmp_path, tiny_dir):
    cfg = CalibrationConfig(tokens=256, seq_len=64, clip="channel", clip_sample_tokens=64, device="cpu")
    a = calibrate(tiny_dir, cfg, progress=False, log=lambda m: None)
    b = calibrate(tiny_dir, cfg, progress=False, log=lambda m: None)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.k_rot, lb.k_rot) and torch.equal(la.v_clip_min, lb.v_clip_min)


# ---------------------------------------------------------------- import-oscar-zoo

def _random_orthogonal(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))[0].float()


def test_import_oscar_zoo_round_trip(tmp_path, tiny_dir):
    shape = model_shape(tiny_dir)
    src = tmp_path / "zoo"
    src.mkdir()
    want = {}
    for layer in range(shape.num_layers):
        # layer 0: one matrix shared by all heads; layer 1: per head
        k = _random_orthogonal(32, 32, seed=layer) if layer == 0 else _random_orthogonal(2, 32, 32, seed=layer)
        v = _random_orthogonal(2, 32, 32, seed=10 + layer)
        torch.save(k, src / f"k_rotation_{layer}.pt")
        torch.save(v, src / f"v_rotation_{layer}.pt")
        want[layer] = (k.expand(2, 32, 32), v)
    out = str(tmp_path / "imported.safetensors")
    assert main(["import-oscar-zoo", "--model", tiny_dir, "--src", str(src), "--out", out]) == 0
    rot = load_rotations(out, expect=shape)
    assert rot.meta.recipe == "oscar" and rot.meta.recipe_detail["imported"] == str(src)
    assert rot.meta.recipe_detail["clip"] == "none"
    for layer, (k, v) in want.items():
        torch.testing.assert_close(rot.layers[layer].k_rot, k)
        torch.testing.assert_close(rot.layers[layer].v_rot, v)
        assert torch.isinf(rot.layers[layer].k_clip_max).all()
    out_t = str(tmp_path / "imported_t.safetensors")
    assert main(["import-oscar-zoo", "--model", tiny_dir, "--src", str(src), "--out", out_t, "--transpose"]) == 0
    torch.testing.assert_close(load_rotations(out_t).layers[1].v_rot, want[1][1].transpose(-1, -2))
    # clip on request: rotations kept, thresholds calibrated
    out_c = str(tmp_path / "imported_c.safetensors")
    assert main(["import-oscar-zoo", "--model", tiny_dir, "--src", str(src), "--out", out_c, "--clip", "head",
                 "--tokens", "256", "--seq-len", "64", "--clip-sample", "64", "--quiet"]) == 0
    rc = load_rotations(out_c)
    torch.testing.assert_close(rc.layers[1].k_rot, want[1][0])
    assert rc.meta.recipe_detail["variant"] == "imported" and rc.meta.recipe_detail["clip"] == "head"


def test_import_oscar_zoo_errors(tmp_path, tiny_dir, capsys):
    src = tmp_path / "zoo"
    src.mkdir()
    torch.save(_random_orthogonal(32, 32), src / "k_rotation_0.pt")
    torch.save(_random_orthogonal(32, 32), src / "v_rotation_0.pt")
    out = str(tmp_path / "x.safetensors")
    assert main(["import-oscar-zoo", "--model", tiny_dir, "--src", str(src), "--out", out]) == 2
    assert "missing k_rotation_1.pt, v_rotation_1.pt" in capsys.readouterr().err
    torch.save(_random_orthogonal(16, 16), src / "k_rotation_1.pt")
    torch.save(_random_orthogonal(32, 32), src / "v_rotation_1.pt")
    assert main(["import-oscar-zoo", "--model", tiny_dir, "--src", str(src), "--out", out]) == 2
    assert "shape (16, 16), expected (32, 32) or (2, 32, 32)" in capsys.readouterr().err
    torch.save(torch.randn(32, 32), src / "k_rotation_1.pt")
    assert main(["import-oscar-zoo", "--model", tiny_dir, "--src", str(src), "--out", out]) == 2
    assert "k_rot.1 is not orthogonal" in capsys.readouterr().err
    torch.save(_random_orthogonal(32, 32), src / "k_rotation_1.pt")
    torch.save(_random_orthogonal(32, 32), src / "k_rotation_5.pt")
    assert main(["import-oscar-zoo", "--model", tiny_dir, "--src", str(src), "--out", out]) == 2
    assert "beyond the model's 2 layers" in capsys.readouterr().err


# ---------------------------------------------------------------- proxy

def _windows(tok, n=2, seq=64):
    return list(text_sources.token_stream(tok, text_sources.read_texts(text_sources.stdlib_test_files()[:5]), seq, n * seq))


def test_proxy_is_exact_with_every_key_bf16_and_positive_with_int2(tmp_path, tiny_dir):
    model, tok = load_model(tiny_dir, "cpu", "float32")
    cfg = CalibrationConfig(tokens=256, seq_len=64, clip="none", device="cpu", variant="U-H")
    rots = {"oscar": calibrate(tiny_dir, cfg, progress=False, log=lambda m: None),
            "naive": calibrate(tiny_dir, CalibrationConfig(recipe="naive", device="cpu"), progress=False,
                               log=lambda m: None)}
    ws = _windows(tok)
    exact = run_proxy(model, ws, rots, progress=False, recent=64, query_stride=3)  # 64-token windows: all BF16
    for r in exact.values():
        assert r["mean"]["out_rel"] < 1e-5 and r["mean"]["logit_rel"] < 1e-5 and abs(r["mean"]["attn_kl"]) < 1e-6
    quant = run_proxy(model, ws, rots, progress=False)
    for r in quant.values():
        assert len(r["layers"]) == 2 and all(0 < x["out_rel"] < 2 and x["attn_kl"] > 0 for x in r["layers"])
    sink = run_proxy(model, ws, rots, progress=False, sink=8, recent=8)
    assert all(sink[n]["mean"]["out_rel"] < quant[n]["mean"]["out_rel"] for n in rots)


def test_proxy_cli_writes_json(tmp_path, tiny_dir, capsys):
    out = str(tmp_path / "h.safetensors")
    assert main(["--model", tiny_dir, "--out", out, "--recipe", "hadamard", "--clip", "none"]) == 0
    js = str(tmp_path / "p.json")
    assert main(["proxy", "--model", tiny_dir, "--rotations", out, "--tokens", "128", "--seq-len", "64",
                 "--json", js, "--quiet"]) == 0
    assert "out_rel" in capsys.readouterr().out
    rep = json.load(open(js))
    assert rep["tokens"] == 128 and set(rep["results"]) == {"h"}
    assert rep["data"] == "python stdlib test suite" and rep["group_sizes"]["h"] == [8, 32]  # head_dim 32: D / 4, min(128, D)
    # --calib-text: the calibration text itself (the stdlib source), another text than the test suite's
    assert main(["proxy", "--model", tiny_dir, "--rotations", out, "--tokens", "128", "--seq-len", "64",
                 "--json", js, "--quiet", "--calib-text"]) == 0
    calib = json.load(open(js))
    assert calib["data"].startswith("python stdlib source") and calib["results"] != rep["results"]
    with pytest.raises(SystemExit):
        main(["proxy", "--model", tiny_dir, "--rotations", out, "--calib-text", "--data", tiny_dir])
    assert ModelShape  # imported for the type of the expected shape in other tests


# ---------------------------------------------------------------- values' own group size

def test_cli_value_group_size(tmp_path, tiny_dir, capsys, monkeypatch):
    import calibration.calibrate as cal

    searched = []  # group size of every clip search, in call order (per layer: keys, values)
    real = cal.search_clip

    def spy(x, granularity, group_size, *a, **kw):
        searched.append(group_size)
        return real(x, granularity, group_size, *a, **kw)

    monkeypatch.setattr(cal, "search_clip", spy)
    out = str(tmp_path / "kv.safetensors")
    args = ["--model", tiny_dir, "--tokens", "256", "--seq-len", "64", "--clip", "channel", "--clip-sample", "64",
            "--group-size", "8", "--scale-dtype", "float8_e4m3fn", "--key-groups", "uniform", "--quiet"]
    assert main([*args, "--out", out, "--value-group-size", "32"]) == 0
    m = load_rotations(out, expect=model_shape(tiny_dir)).meta
    assert (m.group_size, m.value_group_size, m.scale_dtype) == (8, 32, "float8_e4m3fn")
    assert (m.recipe_detail["group_size"], m.recipe_detail["value_group_size"]) == (8, 32)
    assert searched == [8, 32, 8, 32]
    assert "key group 8, value group 32" in capsys.readouterr().err
    searched.clear()
    same = str(tmp_path / "same.safetensors")
    assert main([*args, "--out", same]) == 0
    assert load_rotations(same).meta.value_group_size == 8 and searched == [8, 8, 8, 8]
    assert "clip channel, group 8)" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "bad"), "--value-group-size", "48"]) == 2
    err = [e for e in capsys.readouterr().err.strip().splitlines() if e.startswith("oscar-calibrate: error: ")]
    assert err == ["oscar-calibrate: error: value group size 48 must be a power of two dividing head_dim 32"]


def test_proxy_quantises_values_at_the_value_group_size(tmp_path, tiny_dir):
    """Keys alone decide the logits: changing only the values' group size leaves logit_rel
    and attn_kl as they are and moves out_rel."""
    from dataclasses import replace

    model, tok = load_model(tiny_dir, "cpu", "float32")
    cfg = CalibrationConfig(recipe="hadamard", group_size=8, value_group_size=32, clip="none", device="cpu")
    split = calibrate(tiny_dir, cfg, progress=False, log=lambda m: None)
    assert split.meta.value_group_size == 32
    same = type(split)(replace(split.meta, value_group_size=8), split.layers)
    res = run_proxy(model, _windows(tok), {"split": split, "same": same}, progress=False)
    a, b = res["split"]["mean"], res["same"]["mean"]
    assert a["logit_rel"] == b["logit_rel"] and a["attn_kl"] == b["attn_kl"]
    assert a["out_rel"] > b["out_rel"]  # coarser value groups, larger output error
