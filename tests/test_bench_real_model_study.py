"""benchmarks/real_model_study.py and its RESULTS.md section: candidates paired by window."""
import json

import pytest

from benchmarks import real_model_study, report


def _method(ppl: float, windows: list[float], top1=None, kl=None) -> dict:
    m = {"ppl_details": {"4096": {"ppl": ppl, "nll_by_window": windows}}}
    if top1 is not None:
        m["agreement"] = {"4096": {"top1": top1, "kl": kl}}
    return m


def _rotation(g: int, shift: str) -> dict:
    return {"recipe": "oscar", "group_size": g, "value_group_size": 64, "scale_dtype": "float8_e4m3fn",
            "recipe_detail": {"key_shift": shift}}


def _settings(**kw) -> dict:
    return {"ppl_len": [4096], "ppl_windows": 3, "chunk": 1024, "sink": 16, "recent": 128, "device": "cuda",
            "int2_parts": "kv", **kw}


@pytest.fixture
def files(tmp_path):
    main = {"model": "SmolLM2-135M-Instruct",
            "settings": _settings(rotations={"oscar": _rotation(16, "mean"), "oscar_noshift": _rotation(16, "none")}),
            "methods": {"bf16": _method(5.0, [1.0, 2.0, 3.0]),
                        "oscar": _method(5.1, [1.01, 2.03, 3.02], 0.95, 0.02),
                        "oscar_noshift": _method(5.3, [1.05, 2.06, 3.07], 0.9, 0.05)}}
    k_only = {"settings": _settings(int2_parts="k", rotations={"oscar": _rotation(16, "mean")}),
              "methods": {"oscar": _method(5.05, [1.01, 2.01, 3.02])}}
    ring = {"settings": _settings(recent=512, rotations={"oscar": _rotation(16, "mean")}),
            "methods": {"oscar": _method(5.02, [1.0, 2.01, 3.01])}}
    cfg = {"num_hidden_layers": 30, "num_key_value_heads": 3, "hidden_size": 576, "num_attention_heads": 9}
    paths = {}
    for name, data in (("main", main), ("k", k_only), ("W512", ring), ("config", cfg)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(data))
    return paths


def test_study_pairs_every_row_with_bf16_and_the_default(files, tmp_path):
    out = tmp_path / "results" / "study_smollm2.json"
    out.parent.mkdir()
    real_model_study.main(["--main", str(files["main"]), "--run", f"k={files['k']}", "--run", f"W512={files['W512']}",
                           "--model-config", str(files["config"]), "--out", str(out)])
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert list(rows) == ["oscar", "oscar_noshift", "k/oscar", "W512/oscar"]
    assert rows["oscar"]["bytes_per_token_head"] == 42  # 16 + 16 code bytes, 4 + 1 float8 (scale, min) pairs
    noshift = rows["oscar_noshift"]["ppl"]["4096"]
    assert noshift["ratio"] == pytest.approx(5.3 / 5.0)
    assert noshift["nll_vs_default"][0] == pytest.approx((0.04 + 0.03 + 0.05) / 3, abs=1e-5)
    assert "nll_vs_default" not in rows["oscar"]["ppl"]["4096"]  # the default itself
    assert rows["W512/oscar"]["ring_bytes_per_request"] == 512 * 30 * 3 * 64 * 2 * 2
    assert rows["k/oscar"]["int2_parts"] == "k" and rows["oscar"]["ppl"]["4096"]["top1"] == 0.95
    text = report.render_real_model_study(str(out.parent))
    assert "oscar: no key shift" in text and "INT2 keys only" in text and "S=16, W=512" in text
    assert "(default)" in text and "5.3000 (1.0600x)" in text


def test_study_refuses_runs_on_other_windows_and_a_main_without_bf16(files, tmp_path):
    other = json.loads(files["k"].read_text())
    other["settings"]["ppl_windows"] = 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="other perplexity windows"):
        real_model_study.main(["--main", str(files["main"]), "--run", f"k={bad}", "--model-config",
                               str(files["config"]), "--out", str(tmp_path / "o.json")])
    main = json.loads(files["main"].read_text())
    del main["methods"]["bf16"]
    nobf16 = tmp_path / "nobf16.json"
    nobf16.write_text(json.dumps(main))
    with pytest.raises(SystemExit, match="no bf16"):
        real_model_study.main(["--main", str(nobf16), "--model-config", str(files["config"]),
                               "--out", str(tmp_path / "o.json")])
