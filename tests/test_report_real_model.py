"""benchmarks.report's real-model section and headline row, rendered from fixture JSON (CPU)."""
import json
from pathlib import Path

from benchmarks import report, targets


def _details(ppl: float, nlls: list[float]) -> dict:
    return {"ppl": ppl, "nll_by_window": nlls, "windows": len(nlls)}


def _agreement(top1: float, **kl) -> dict:
    return {"from_position": 1024, "positions": 4 * 7168, "top1": top1, **kl}


def _fixture(tmp_path: Path, sim: bool = True) -> Path:
    st = {"chunked_prefill_size": 1024, "ppl_windows": 4, "passkey_trials": 2, "passkey_depths": [0.1, 0.5],
          "agreement": "at every predicting position p >= 1024 ... kl_topk = a LOWER BOUND on KL(bf16 || method)"}
    methods = {
        "bf16": {"ppl_details": {"2048": _details(4.0, [1.0, 1.2, 1.4, 1.6]), "8192": _details(3.6, [1.1, 1.2, 1.3, 1.4])},
                 "passkey": {"2048": 0.75}, "passkey_hits": {"2048": [1, 1, 0, 1]}},
        "fp8_e4m3": {"ppl_details": {"2048": _details(4.02, [1.01, 1.21, 1.41, 1.61]),
                                     "8192": _details(3.62, [1.11, 1.2, 1.31, 1.41])},
                     "passkey": {"2048": 0.75}, "passkey_hits": {"2048": [1, 1, 0, 1]},
                     "agreement": {"2048": _agreement(0.99, kl_topk=0.002), "8192": _agreement(0.985, kl_topk=0.003)}},
        "oscar": {"ppl_details": {"2048": _details(4.2, [1.05, 1.25, 1.45, 1.7]), "8192": _details(3.87, [1.2, 1.25, 1.4, 1.5])},
                  "passkey": {"2048": 0.5}, "passkey_hits": {"2048": [1, 0, 0, 1]},
                  "agreement": {"2048": _agreement(0.95, kl_topk=0.04), "8192": _agreement(0.93, kl_topk=0.06)}},
    }
    (tmp_path / "server_smollm2.json").write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "settings": st,
                                                              "methods": methods}))
    if sim:
        sim_methods = {"bf16": {"ppl_details": {"2048": _details(4.0, [1.0, 1.3])}},
                       "oscar": {"ppl_details": {"2048": _details(4.1, [1.02, 1.33])},
                                 "agreement": {"2048": _agreement(0.96, kl=0.05, kl_topk=0.045)}}}
        (tmp_path / "fidelity_smollm2.json").write_text(json.dumps(
            {"model": "SmolLM2-135M-Instruct", "methods": sim_methods,
             "settings": {"sink": 16, "recent": 128, "group_size": 16, "value_group_size": 64, "chunk": 1024,
                          "ppl_windows": 2, "passkey_trials": 0, "device": "cuda"}}))
    return tmp_path


def _rows(text: str, header_start: str) -> dict[str, list[str]]:
    """The rows of the table whose header starts with ``header_start``, by first cell."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[i + 2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows[cells[0]] = cells[1:]
    return rows


def test_real_model_section_pairs_every_method_with_bf16(tmp_path):
    text = report.render_real_model(str(_fixture(tmp_path)))
    served, sim = text.split("in simulation**")
    assert "SmolLM2-135M-Instruct through the server" in served and "LOWER BOUND" in served
    assert "the KL column is a lower bound" in served
    ppl = _rows(served, "| method | ppl 2,048 (vs bf16)")
    gap, half = targets.paired_gap([1.2, 1.25, 1.4, 1.5], [1.1, 1.2, 1.3, 1.4])
    assert ppl["oscar"][:4] == ["4.2000 (1.0500x)", report._gap(*targets.paired_gap([1.05, 1.25, 1.45, 1.7],
                                                                                      [1.0, 1.2, 1.4, 1.6]), 4),
                                f"3.8700 ({3.87 / 3.6:.4f}x)", f"{gap:+.4f} ± {half:.4f}"]
    assert ppl["bf16"][:4] == ["4.0000", "-", "3.6000", "-"]
    assert ppl["oscar"][4].startswith("0.500 (-0.250 ± ") and ppl["fp8_e4m3"][4].startswith("0.750 (+0.000 ± ")
    agree = _rows(served, "| method | top-1 = bf16, 2,048")
    assert agree == {"fp8_e4m3": ["0.9900", "0.0020", "0.9850", "0.0030"],
                     "oscar": ["0.9500", "0.0400", "0.9300", "0.0600"]}
    assert "KL(bf16 || method) >=, 8,192" in served
    sim_agree = _rows(sim, "| method | top-1 = bf16, 2,048")
    assert sim_agree == {"oscar": ["0.9600", "0.0500", "0.0450"]}
    assert "S=16, W=128, G=16 (keys) / 64 (values), chunk 1024" in sim
    assert _rows(sim, "| method | ppl 2,048")["oscar"][0] == "4.1000 (1.0250x)"


def test_real_model_section_waits_for_its_files_and_stays_out_of_tinylms(tmp_path):
    assert report.render_real_model(str(tmp_path)).startswith("_No results yet: run `python3 -m benchmarks.server_fidelity")
    res = _fixture(tmp_path, sim=False)
    text = report.render_real_model(str(res))
    assert "through the server" in text and "in simulation" not in text
    # the tinylm-A sections render every other server_*.json / fidelity_*.json, not these
    assert report.render_server_fidelity(str(res)).startswith("_No results yet")
    _fixture(tmp_path)
    assert report.render_fidelity(str(res)).startswith("_No results yet")


def test_headline_row_for_the_real_model_appears_with_its_file(tmp_path):
    assert report._headline_real_model(str(tmp_path)) == []
    res = _fixture(tmp_path)
    (row,) = report._headline_real_model(str(res))
    assert row[0] == "perplexity at 2k / 8k tokens, 4 windows each, through the server (SmolLM2-135M-Instruct)"
    assert row[1] == f"[4.200 / 3.870 (1.050 / {3.87 / 3.6:.3f}x)](benchmarks/results/server_smollm2.json)"
    assert row[2] == "[4.000 / 3.600](benchmarks/results/server_smollm2.json)"
    assert any(r == row for r in [
        [c.strip() for c in line.strip().strip("|").split(" | ")]
        for line in report.render_headline(str(res)).splitlines()[2:]])


def test_headline_row_falls_back_to_the_simulation_and_every_simulated_run_renders(tmp_path):
    res = _fixture(tmp_path)
    (res / "server_smollm2.json").unlink()
    (row,) = report._headline_real_model(str(res))
    assert row[0] == "perplexity at 2k tokens, 2 windows each, in simulation (oscar-eval, cuda) (SmolLM2-135M-Instruct)"
    assert row[1] == "[4.100 (1.025x)](benchmarks/results/fidelity_smollm2.json)"
    more = json.loads((res / "fidelity_smollm2.json").read_text())
    more["methods"]["oscar"]["ppl_details"] = {"2048": _details(4.3, [1.1, 1.4])}
    (res / "fidelity_smollm2_8k.json").write_text(json.dumps(more))
    text = report.render_real_model(str(res))
    assert text.count("in simulation**") == 2 and "fidelity_smollm2_8k.json" in text
    assert _rows(text.split("fidelity_smollm2_8k.json")[1], "| method | ppl 2,048")["oscar"][0] == "4.3000 (1.0750x)"
    assert report.render_fidelity(str(res)).startswith("_No results yet")  # not a tinylm-A file
