"""benchmarks.layer_layout: the per-layer key groups chosen on the calibration-side proxy (issue 46)."""
import itertools
import json

import pytest

from benchmarks import layer_layout as ll

COST = {32: 20, 16: 24, 8: 32, 4: 48}  # key bytes at head_dim 64, fp8 scale + min


def test_key_bytes_at_head_dim_64_and_128():
    assert {g: ll.key_bytes(64, g, "float8_e4m3fn") for g in COST} == COST
    assert ll.key_bytes(128, 32, "float8_e4m3fn") == 40 and ll.key_bytes(128, 16, "float16") == 64


def test_allocate_is_the_exact_optimum_under_the_budget():
    """Against brute force over every layout of 5 layers: the least summed error within the budget."""
    errors = {32: [0.9, 0.2, 0.5, 0.05, 0.4], 16: [0.5, 0.1, 0.3, 0.03, 0.2],
              8: [0.2, 0.06, 0.2, 0.02, 0.1], 4: [0.1, 0.05, 0.15, 0.01, 0.05]}
    for budget in (20, 22.4, 24, 26, 30, 48):
        groups, err = ll.allocate(errors, COST, budget)
        assert sum(COST[g] for g in groups) <= budget * 5
        best = min(sum(errors[g][i] for i, g in enumerate(gs))
                   for gs in itertools.product(COST, repeat=5) if sum(COST[g] for g in gs) <= budget * 5)
        assert err == pytest.approx(best) and err == pytest.approx(sum(errors[g][i] for i, g in enumerate(groups)))
    assert ll.allocate(errors, COST, 20)[0] == [32] * 5
    with pytest.raises(ValueError, match="no layout"):
        ll.allocate(errors, COST, 19)


def test_proxy_errors_read_the_group_size_from_the_file_names(tmp_path, capsys):
    rows = lambda *kl: {"layers": [{"attn_kl": x, "logit_rel": 0, "out_rel": 0} for x in kl]}
    report = {"results": {"smol_oscar": rows(0.4, 0.1), "smol_oscar_g8": rows(0.1, 0.05),
                          "smol_oscar_g32": rows(0.8, 0.12)}}
    assert ll.proxy_errors(report) == {16: [0.4, 0.1], 8: [0.1, 0.05], 32: [0.8, 0.12]}
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(report))
    assert ll.main(["--proxy", str(path), "--budget", "42"]) == 0
    assert "mean 42.00 B" in capsys.readouterr().out and ll.allocate(ll.proxy_errors(report), COST, 26)[0] == [8, 32]


def test_the_study_layouts_are_the_proxys_choice_on_the_calibration_text():
    """benchmarks.fidelity_candidates' layers-42 / 44 / 46 rows: the knapsack's layouts on the committed
    proxy (calibration text) at today's 42 B, +5% and +10%, not hand-picked."""
    from benchmarks import fidelity_candidates as fc
    from benchmarks.server_harness import ROOT
    with open(f"{ROOT}/benchmarks/results/layer_proxy_smollm2.json") as f:
        report = json.load(f)
    assert report["data"].startswith("python stdlib source") and (report["sink"], report["recent"]) == (16, 128)
    errors = ll.proxy_errors(report)
    for label, budget in ((42, 42.0), (44, 42 * 1.05), (46, 42 * 1.10)):
        groups, _ = ll.allocate(errors, COST, budget - 18)
        g8, g32 = fc._LAYOUTS[label]
        assert [i for i, g in enumerate(groups) if g == 8] == g8 and [i for i, g in enumerate(groups) if g == 32] == g32
        assert set(groups) <= {8, 16, 32}


def test_proxy_errors_prefer_the_recorded_group_sizes():
    rows = {"layers": [{"attn_kl": 0.1, "logit_rel": 0, "out_rel": 0}]}
    report = {"results": {"tiny_oscar": rows, "tiny_oscar_g16": rows}}
    assert set(ll.proxy_errors(report, default_group=32)) == {32, 16}
    report["group_sizes"] = {"tiny_oscar": [32, 128], "tiny_oscar_g16": [64, 128]}  # the record wins over the name
    assert set(ll.proxy_errors(report)) == {32, 64}
    report["group_sizes"]["tiny_oscar_g16"] = [32, 128]
    with pytest.raises(ValueError, match="two rotations files"):
        ll.proxy_errors(report)


def test_tinylm_layout_is_its_proxys_choice_at_its_defaults_bytes():
    from benchmarks import fidelity_candidates as fc
    from benchmarks.server_harness import ROOT
    with open(f"{ROOT}/benchmarks/results/layer_proxy_tinylm-A.json") as f:
        report = json.load(f)
    assert report["data"].startswith("python stdlib source") and report["group_sizes"]["tiny_oscar"] == [32, 128]
    errors = ll.proxy_errors(report)
    cost = {g: ll.key_bytes(128, g, "float8_e4m3fn") for g in errors}
    assert cost == {32: 40, 16: 48, 64: 36}
    groups, _ = ll.allocate(errors, cost, 74 - 34)  # values: 32 B of codes + one fp8 scale and min
    assert {f"oscar_g{g}": [i for i, x in enumerate(groups) if x == g] for g in (16, 64)} == fc.TINY_LAYOUT
