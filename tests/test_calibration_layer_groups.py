"""oscar-calibrate's key groups per layer: the knapsack, the candidates, the calibrated file, the flag."""
import dataclasses
import itertools
import random

import pytest
import torch
from safetensors import safe_open

from calibration import calibrate as cal
from calibration import layer_groups as lg
from calibration.calibrate import CalibrationConfig, calibrate, load_model
from calibration.cli import main
from calibration.proxy import run_proxy
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.rotations_file import Rotations, load_rotations
from oscar_kernels.hybrid_cache import LayerRotation
from calibration_helpers import save_tiny_model_dir

# tiny model: head_dim 32, so G = 8 and the candidates are 4, 8, 16; values in one group of 32.
# Key bytes (fp8 scale + min): g4 24, g8 16, g16 12, so 3 layers can mix g4 with two g16.
TOKENS, SEQ = ["--tokens", "512", "--seq-len", "256"], 256  # windows > 16 sinks + 128 recent
QUIET = dict(progress=False, log=lambda m: None)


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny3") / "m", "qwen3", num_layers=3, kv_heads=2,
                               head_dim=32)


def _cfg(**kw):
    return CalibrationConfig(tokens=512, seq_len=SEQ, device="cpu", **kw)


def _same_layer(a: LayerRotation, b: LayerRotation) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in LayerRotation.FIELDS)


# ---------------------------------------------------------------- the knapsack

@pytest.mark.parametrize("seed", range(12))
def test_allocate_is_the_brute_force_optimum_within_the_budget(seed):
    rnd = random.Random(seed)
    sizes = rnd.sample([4, 8, 16, 32, 64], rnd.randint(2, 4))
    cost = {g: lg.key_bytes(64, g, rnd.choice(["float8_e4m3fn", "float16"])) for g in sizes}
    layers = rnd.randint(1, 6)
    errors = {g: [rnd.random() for _ in range(layers)] for g in sizes}
    for budget in (min(cost.values()), sorted(cost.values())[len(cost) // 2], rnd.uniform(min(cost.values()),
                                                                                           max(cost.values()))):
        groups, err = lg.allocate(errors, cost, budget)
        assert len(groups) == layers and sum(cost[g] for g in groups) <= budget * layers + 1e-9
        feasible = [gs for gs in itertools.product(sizes, repeat=layers) if sum(cost[g] for g in gs) <= budget * layers]
        best = min(sum(errors[g][i] for i, g in enumerate(gs)) for gs in feasible)
        assert err == pytest.approx(best) and err == pytest.approx(sum(errors[g][i] for i, g in enumerate(groups)))
    with pytest.raises(ValueError, match="no layout"):
        lg.allocate(errors, cost, min(cost.values()) - 1)


def test_allocate_spends_no_bytes_on_equal_errors():
    cost = {4: 24, 8: 16, 16: 12}
    assert lg.allocate({g: [0.0] * 4 for g in cost}, cost, 16)[0] == [16] * 4


def test_the_benchmark_uses_the_calibration_knapsack():
    from benchmarks import layer_layout

    assert layer_layout.allocate is lg.allocate and layer_layout.key_bytes is lg.key_bytes


def test_candidate_groups():
    assert lg.candidate_groups(128, 32) == [16, 32, 64]
    assert lg.candidate_groups(64, 64) == [32, 64]  # 2G does not divide head_dim
    assert lg.candidate_groups(96, 24) == [24, 48]  # 12: not a power of two nor a whole plane of 96
    assert lg.candidate_groups(4, 1) == [1, 2]
    assert lg.candidate_groups(12, 3) == [3, 6]


def test_the_proxy_keeps_the_servers_default_sinks_and_window():
    from sglang_ext import settings  # plain data: imports neither sglang nor another sglang_ext module

    assert (lg.SERVING_SINK_TOKENS, lg.SERVING_RECENT_WINDOW) == (settings.DEFAULT_SINK_TOKENS,
                                                                 settings.DEFAULT_RECENT_WINDOW)
    assert cal.proxy_layout(2048) == (16, 128) and cal.proxy_layout(144) == (0, 0)


# ---------------------------------------------------------------- calibrate's default

@pytest.fixture(scope="module")
def default_rot(tiny3):
    return calibrate(tiny3, _cfg(clip="head", clip_sample_tokens=128), **QUIET)


def test_default_is_per_layer_within_the_uniform_bytes(default_rot):
    m = default_rot.meta
    assert m.group_size == 8 and m.value_group_size == 32 and len(m.key_group_sizes) == 3
    uniform = KVLayout(8, 32, m.scale_dtype).bytes_per_token_per_head(32)
    assert m.mean_bytes_per_token_per_head() <= uniform
    d = m.recipe_detail["key_groups"]
    assert d["mode"] == "per-layer" and d["chosen"] == list(m.key_group_sizes) and d["candidates"] == [4, 8, 16]
    assert d["budget_key_bytes"] == 16 and d["mean_key_bytes"] <= 16
    assert (d["proxy"]["sink"], d["proxy"]["recent"], d["proxy"]["window"]) == (16, 128, SEQ)
    assert d["proxy"]["query_stride"] == cal.PROXY_QUERY_STRIDE and d["proxy"]["tokens"] == 512
    kl = d["attn_kl"]
    assert set(kl) == {"4", "8", "16"} and all(len(v) == 3 and min(v) > 0 for v in kl.values())
    chosen = sum(kl[str(g)][i] for i, g in enumerate(m.key_group_sizes))
    assert d["summed_attn_kl"]["chosen"] == pytest.approx(chosen) and chosen <= d["summed_attn_kl"]["uniform"]
    assert d["summed_attn_kl"]["uniform"] == pytest.approx(sum(kl["8"]))
    assert [e["layer"] for e in m.recipe_detail["clip_search"]] == [0, 0, 1, 1, 2, 2]


def test_chosen_layers_are_the_uniform_calibration_at_their_group(tiny3, default_rot, monkeypatch):
    """Every layer's tensors are those a uniform calibration at its group gives, for a layout that
    mixes all three candidates (the proxy's KL made to favour g4 at layer 1)."""
    def errors(model, windows, candidates, *a, **k):
        return {4: [0.9, 0.1, 0.9], 8: [0.5, 0.5, 0.5], 16: [0.6, 0.9, 0.6]}

    monkeypatch.setattr(cal, "candidate_errors", errors)
    rot = calibrate(tiny3, _cfg(clip="head", clip_sample_tokens=128), **QUIET)
    assert rot.meta.key_group_sizes == (16, 4, 16) and rot.meta.per_layer_key_groups
    groups = set(rot.meta.key_group_sizes) | set(default_rot.meta.key_group_sizes)
    uniform = {g: calibrate(tiny3, _cfg(clip="head", clip_sample_tokens=128, key_groups="uniform", group_size=g,
                                        value_group_size=32), **QUIET) for g in groups}
    for r in (rot, default_rot):
        for i, g in enumerate(r.meta.key_group_sizes):
            assert _same_layer(r.layers[i], uniform[g].layers[i]), (i, g)


def test_one_candidate_means_the_uniform_file(tiny3, monkeypatch):
    monkeypatch.setattr(cal, "candidate_groups", lambda head_dim, g: [g])
    rot = calibrate(tiny3, _cfg(), **QUIET)
    assert not rot.meta.per_layer_key_groups and "key_groups" not in rot.meta.recipe_detail


def test_short_windows_measure_every_key_in_int2(tiny3):
    logs = []
    rot = calibrate(tiny3, CalibrationConfig(tokens=256, seq_len=64, device="cpu"), progress=False, log=logs.append)
    p = rot.meta.recipe_detail["key_groups"]["proxy"]
    assert (p["sink"], p["recent"], p["window"]) == (0, 0, 64)
    assert any("quantises every key" in line for line in logs)


def test_proxy_quantises_each_layer_at_its_own_key_group(tiny3):
    uniform = {g: calibrate(tiny3, _cfg(key_groups="uniform", group_size=g, value_group_size=32), **QUIET)
               for g in (4, 16)}
    mixed = Rotations(dataclasses.replace(uniform[4].meta, key_group_sizes=(4, 16, 4), group_size=8),
                          [uniform[4].layers[0], uniform[16].layers[1], uniform[4].layers[2]])
    model, tok = load_model(tiny3, "cpu", "float32")
    windows = cal.proxy_windows(tok, cal.for_shape(_cfg().resolved(), cal.model_shape(tiny3)))
    res = run_proxy(model, windows, {"mixed": mixed, "g4": uniform[4], "g16": uniform[16]}, sink=16, recent=128,
                    progress=False)
    kl = {k: [row["attn_kl"] for row in v["layers"]] for k, v in res.items()}
    assert kl["mixed"] == pytest.approx([kl["g4"][0], kl["g16"][1], kl["g4"][2]])
    only = run_proxy(model, windows, {"g4": uniform[4]}, sink=16, recent=128, progress=False, metrics=("attn_kl",))
    assert [row["attn_kl"] for row in only["g4"]["layers"]] == pytest.approx(kl["g4"])
    assert set(only["g4"]["layers"][0]) == {"attn_kl"}


# ---------------------------------------------------------------- the command line

def test_cli_default_prints_the_layout_and_uniform_writes_version_2(tiny3, tmp_path, capsys):
    per, uni = str(tmp_path / "per.safetensors"), str(tmp_path / "uni.safetensors")
    assert main(["--model", tiny3, "--out", per, *TOKENS, "--quiet"]) == 0
    err = capsys.readouterr().err
    rot = load_rotations(per)
    line = [ln for ln in err.splitlines() if "key groups per layer:" in ln]
    assert line == [f"oscar-calibrate: {lg.describe_layout(rot.meta)}"]
    assert ("same as uniform g8" in line[0]) if rot.meta.per_layer_key_groups else ("g8 everywhere" in line[0])
    assert main(["--model", tiny3, "--out", uni, *TOKENS, "--key-groups", "uniform", "--quiet"]) == 0
    assert "key groups per layer" not in capsys.readouterr().err
    with safe_open(uni, framework="pt") as f:
        md = f.metadata()
    assert md["version"] == "2" and "key_group_sizes" not in md
    u = load_rotations(uni)
    assert u.meta.key_group_sizes == (8, 8, 8) and "key_groups" not in u.meta.recipe_detail
    assert (u.meta.group_size, u.meta.value_group_size) == (8, 32)
    # the uniform file is the g8 candidate of the default's: the same tensors where the default chose g8
    for i, g in enumerate(rot.meta.key_group_sizes):
        if g == 8:
            assert _same_layer(rot.layers[i], u.layers[i])
    for recipe in ("hadamard", "naive"):  # the data-free baselines stay uniform
        out = str(tmp_path / f"{recipe}.safetensors")
        assert main(["--model", tiny3, "--out", out, "--recipe", recipe, "--quiet"]) == 0
        assert not load_rotations(out).meta.per_layer_key_groups


def test_describe_layout():
    from oscar_kernels.contract.rotations_file import RotationsMeta

    def meta(groups):
        return RotationsMeta("A", "m", 30, 9, 3, 64, 16, "float8_e4m3fn", "oscar", value_group_size=64,
                             key_group_sizes=groups)

    g = [16] * 30
    for i in (7, 14, 18, 20):
        g[i] = 8
    for i in (0, 1, 6, 10, 11, 12, 13, 25):
        g[i] = 32
    assert lg.describe_layout(meta(g)) == ("key groups per layer: g8 at 7,14,18,20; g32 at 0,1,6,10,11,12,13,25; "
                                           "g16 elsewhere; mean 42.0 B per token and KV head (K+V), same as "
                                           "uniform g16")
    assert lg.describe_layout(meta([32] * 30)).endswith("mean 38.0 B per token and KV head (K+V), uniform g16: 42.0 B")
    assert lg.describe_layout(meta([16] * 30)) == "key groups per layer: g16 everywhere; 42.0 B per token and KV head (K+V)"


def test_bad_key_groups_is_one_line(tiny3, tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown key groups 'x'"):
        CalibrationConfig(key_groups="x", device="cpu").resolved()
    with pytest.raises(SystemExit):
        main(["--model", tiny3, "--out", str(tmp_path / "o"), "--key-groups", "x"])
    assert "invalid choice: 'x'" in capsys.readouterr().err
    assert CalibrationConfig(recipe="naive", device="cpu").resolved().key_groups == "uniform"
    assert CalibrationConfig(device="cpu").resolved().key_groups == "per-layer"


def test_candidates_share_what_the_key_group_does_not_change(tiny3, monkeypatch):
    """Clip searches: keys once per candidate and layer, values once per layer; one eigendecomposition."""
    searched, eighs = [], []
    real_search, real_eig = cal.search_clip, cal.eigenbases
    monkeypatch.setattr(cal, "search_clip", lambda x, gran, g, *a, **k: searched.append(g) or real_search(x, gran, g, *a, **k))
    monkeypatch.setattr(cal, "eigenbases", lambda stats: eighs.append(1) or real_eig(stats))
    calibrate(tiny3, _cfg(clip="channel", clip_sample_tokens=64), **QUIET)
    assert searched == [4, 32, 4, 32, 4, 32, 8, 8, 8, 16, 16, 16] and eighs == [1]
