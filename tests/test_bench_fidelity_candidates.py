"""benchmarks.fidelity_candidates (issue 46's study of what closes the gap): bytes, pairing, reuse of
finished runs and the RESULTS.md section, from fixture oscar-eval outputs (CPU, no model)."""
import json
from pathlib import Path

import pytest

from benchmarks import fidelity_candidates as fc
from benchmarks import report, targets

FP8 = "float8_e4m3fn"


def _rot(stem: str, g: int = 16, vg: int = 64) -> dict:
    return {"file": f"/r/smol_{stem}.safetensors", "group_size": g, "value_group_size": vg, "scale_dtype": FP8}


def _settings(argv, rot, sink=16, recent=128, **kw) -> dict:
    return {"sink": sink, "recent": recent, "chunk": 1024, "device": "cpu", "threads": 1, "ppl_windows": 3,
            "eval": {"text": "held-out"}, "calib": {"oscar": "stdlib"}, "rotations": {"oscar": rot},
            "int2_parts": "kv", "argv": [*argv, "--out", "/x.json"], "wall_s": 1.0, **kw}


def _details(ppl: float, nlls: list[float]) -> dict:
    return {"ppl": ppl, "nll_by_window": nlls, "windows": len(nlls), "window_starts": [0, 10, 20]}


def _args(work: Path, **kw):
    a = type("A", (), dict(model="/m", rot_dir="/r", rot_prefix="smol_", ppl_windows=3, threads=1, work=str(work)))()
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _write(work: Path, a, name: str, methods: dict, **st):
    argv = fc.eval_argv(name, a, 2048)
    stem = fc.CANDIDATES[name][0]
    g = 8 if stem == "oscar_g8" else 16
    (work / f"{name}_2048.json").write_text(json.dumps(
        {"model": "smol", "settings": _settings(argv, _rot(stem, g), **st),
         "methods": {n: {"ppl_details": {"2048": d}, "wall_s": 2.0} for n, d in methods.items()}}))


def test_bytes_per_token_head_of_each_layout():
    def st(**kw):
        return {"rotations": {"oscar": _rot("oscar")}, **kw}
    assert fc.bytes_of(st(), 64)["bytes_per_token_head"] == 42  # 16 + 8 keys, 16 + 2 values
    g8 = {"rotations": {"oscar": _rot("oscar_g8", 8)}}
    assert (fc.bytes_of(g8, 64)["key_bytes"], fc.bytes_of(g8, 64)["bytes_per_token_head"]) == (32, 50)
    page = {"page": 64, "scale_dtype": FP8}
    kivi = fc.bytes_of(st(key_channel_page=page), 64)
    assert (kivi["key_bytes"], kivi["value_bytes"], kivi["bytes_per_token_head"]) == (18, 18, 36)
    kivi16 = fc.bytes_of(st(key_channel_page={"page": 64, "scale_dtype": "float16"},
                            value_groups={"group_size": 32, "scale_dtype": FP8}), 64)
    assert (kivi16["key_bytes"], kivi16["value_bytes"]) == (20, 20)
    v16 = fc.bytes_of(st(key_channel_page=page, value_groups={"group_size": 16, "scale_dtype": FP8}), 64)
    assert v16["bytes_per_token_head"] == 42 and "64-position pages" in v16["key_layout"]


def test_study_pairs_every_candidate_by_window(tmp_path):
    a = _args(tmp_path)
    _write(tmp_path, a, "default", {"bf16": _details(5.0, [1.0, 1.5, 2.0]), "oscar": _details(5.1, [1.02, 1.53, 2.04])})
    _write(tmp_path, a, "W512", {"oscar": _details(5.05, [1.01, 1.52, 2.02])}, recent=512)
    _write(tmp_path, a, "fake", {"oscar": _details(5.11, [1.021, 1.531, 2.041])})
    _write(tmp_path, a, "kivi64-fp8", {"oscar": _details(5.2, [1.05, 1.55, 2.1])}, int2_parts="kv-fake",
           key_channel_page={"page": 64, "scale_dtype": FP8})
    (tmp_path / "kivi64-fp8-v16_2048.json.log").write_text("a log, not a run")
    out = fc.study(a, {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64})
    rows = out["rows"]
    assert list(rows) == ["default", "W512", "fake", "kivi64-fp8"] and out["bf16"] == {"2048": 5.0}
    assert rows["default"]["changes"].startswith("today's default: S 16, W 128, keys INT2 g16, values g64,")
    assert rows["default"]["ppl"]["2048"]["ratio"] == 1.02 and "nll_vs_default" not in rows["default"]["ppl"]["2048"]
    gap = targets.paired_gap([1.01, 1.52, 2.02], [1.02, 1.53, 2.04])
    assert rows["W512"]["ppl"]["2048"]["nll_vs_default"] == [round(gap[0], 5), round(gap[1], 5)]
    assert rows["W512"]["ring_bytes_per_request"] == 512 * 30 * 3 * 64 * 4
    kivi = rows["kivi64-fp8"]
    assert kivi["bytes_per_token_head"] == 36 and kivi["ppl"]["2048"]["nll_vs_fake"][0] == pytest.approx(
        (0.029 + 0.019 + 0.059) / 3, abs=1e-5)
    assert "nll_vs_fake" not in rows["fake"]["ppl"]["2048"] and "nll_vs_fake" not in rows["W512"]["ppl"]["2048"]
    # a finished run with the same oscar-eval arguments is reused, another is not
    argv = fc.eval_argv("W512", a, 2048)
    done = json.loads((tmp_path / "W512_2048.json").read_text())
    assert fc._same_argv(done, argv) and not fc._same_argv(done, argv + ["--sink", "4"])
    assert fc.run_one(a, "W512", 2048).startswith("W512 2048: reused")
    # the RESULTS.md section
    (tmp_path / report.FIDELITY_CANDIDATES).write_text(json.dumps(out))
    text = report.render_fidelity_candidates(str(tmp_path))
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert cells["default"][4] == "5.1000 (1.0200x)" and cells["default"][5] == "(default)"
    assert cells["kivi64-fp8"][2] == "36.0 (18.0 + 18.0)" and cells["W512"][3] == "11.8"
    assert report.render_fidelity_candidates(str(tmp_path / "none")).startswith("_No results yet")


def test_study_refuses_other_windows(tmp_path):
    a = _args(tmp_path)
    _write(tmp_path, a, "default", {"bf16": _details(5.0, [1.0, 1.5, 2.0]), "oscar": _details(5.1, [1.0, 1.5, 2.0])})
    bad = _details(5.0, [1.0, 1.5, 2.0])
    bad["window_starts"] = [0, 11, 20]
    _write(tmp_path, a, "S64", {"oscar": bad}, sink=64)
    with pytest.raises(SystemExit, match="other windows"):
        fc.study(a, {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64})


def test_reference_gives_the_default_at_lengths_it_lacks(tmp_path):
    """--reference: an earlier oscar-eval output on the same windows pairs the rows at a length the
    default run lacks, refused when it disagrees with the default run where both have a length."""
    a = _args(tmp_path)
    base = {"bf16": _details(5.0, [1.0, 1.5, 2.0]), "oscar": _details(5.1, [1.02, 1.53, 2.04])}
    _write(tmp_path, a, "default", base)
    w = fc.eval_argv("W512", a, 4096)
    (tmp_path / "W512_4096.json").write_text(json.dumps(
        {"model": "smol", "settings": _settings(w, _rot("oscar"), recent=512),
         "methods": {"oscar": {"ppl_details": {"4096": _details(4.1, [1.0, 1.1, 1.2])}}}}))
    old = json.loads((tmp_path / "default_2048.json").read_text())
    for m, d in (("bf16", _details(4.0, [0.9, 1.0, 1.1])), ("oscar", _details(4.2, [1.0, 1.2, 1.3]))):
        old["methods"][m]["ppl_details"]["4096"] = d
    ref = tmp_path / "old.json"
    ref.write_text(json.dumps(old))
    a.reference = str(ref)
    out = fc.study(a, {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64})
    cell = out["rows"]["W512"]["ppl"]["4096"]
    assert out["bf16"] == {"2048": 5.0, "4096": 4.0} and cell["ratio"] == round(4.1 / 4.0, 5)
    assert cell["nll_vs_default"][0] == pytest.approx(-0.2 / 3, abs=1e-5)
    assert out["rows"]["default"]["ppl"]["4096"]["from"] == "old.json"
    old["methods"]["oscar"]["ppl_details"]["2048"]["nll_by_window"][0] = 9.0
    ref.write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="differs"):
        fc.study(a, {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64})


def test_device_is_passed_and_a_missing_rotations_file_skips_its_candidate(tmp_path):
    a = _args(tmp_path)
    assert "--device" not in fc.eval_argv("g8", a, 2048)  # the runs made without it are reused
    a.device = "cuda"
    assert fc.eval_argv("g8", a, 2048)[-2:] == ["--device", "cuda"]
    assert "skipped, no rotations file /r/smol_oscar_g8.safetensors" in fc.run_one(a, "g8", 2048)


def test_bytes_of_a_layout_per_layer_is_the_mean_over_its_layers():
    """Issue 46's uneven layouts: 2 layers at key groups 8 (+8 B) and 4 at 32 (-4 B) among 30 keep
    the default's 42 B on average; BF16 layers cost 2 x head_dim bytes each for K and V."""
    groups = [[8, 64]] * 2 + [[32, 64]] * 4 + [[16, 64]] * 24
    st = {"rotations": {"oscar": {**_rot("oscar"), "layer_groups": groups}}}
    b = fc.bytes_of(st, 64)
    assert (b["bytes_per_token_head"], b["key_bytes"], b["value_bytes"]) == (42, 24, 18)
    assert b["layers"] == {"keys g8, values g64": [0, 1], "keys g32, values g64": [2, 3, 4, 5],
                           "keys g16, values g64": list(range(6, 30))}
    up = fc.bytes_of({"rotations": {"oscar": {**_rot("oscar"), "layer_groups": [[4, 64]] * 3 + [[16, 64]] * 27}}}, 64)
    assert up["bytes_per_token_head"] == pytest.approx(42 + 3 * 24 / 30)
    bf16 = fc.bytes_of({"rotations": {"oscar": {**_rot("oscar"), "layer_groups": [[16, 64]] * 30}},
                        "bf16_layers": [0, 1, 2, 3, 4]}, 64)
    assert bf16["bytes_per_token_head"] == pytest.approx((5 * 256 + 25 * 42) / 30) and bf16["layers"]["BF16"] == [0, 1, 2, 3, 4]
    head = fc.bytes_of({"rotations": {"oscar": {**_rot("oscar"), "layer_groups": [[16, 64]] * 30}},
                        "bf16_kv_heads": [2]}, 64, num_kv_heads=3)
    assert head["bytes_per_token_head"] == pytest.approx((2 * 42 + 256) / 3) and head["bf16_kv_heads"] == [2]
    with pytest.raises(ValueError, match="KV head count"):
        fc.bytes_of({"rotations": {"oscar": _rot("oscar")}, "bf16_kv_heads": [2]}, 64)
    with pytest.raises(ValueError, match="layer_groups"):
        fc.bytes_of({"rotations": {"oscar": _rot("oscar")}, "bf16_layers": [0]}, 64)


def test_a_layer_layout_names_its_files_and_is_skipped_without_them(tmp_path, monkeypatch):
    a = _args(tmp_path)
    monkeypatch.setitem(fc.CANDIDATES, "mix", ("oscar", ["--layer-rotations", ("oscar_g8", [3, 7])], "test"))
    argv = fc.eval_argv("mix", a, 2048)
    assert argv[argv.index("--layer-rotations") + 1] == "/r/smol_oscar_g8.safetensors:3,7"
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "smol_oscar.safetensors").write_text("")
    a.rot_dir = str(tmp_path / "r")
    assert fc.run_one(a, "mix", 2048).endswith(f"no rotations file {tmp_path}/r/smol_oscar_g8.safetensors")


def test_the_attribution_table_gives_each_blocks_share_beside_the_proxys(tmp_path):
    a = _args(tmp_path)
    _write(tmp_path, a, "default", {"bf16": _details(5.0, [1.0, 1.5, 2.0]), "oscar": _details(5.1, [1.04, 1.54, 2.04])})
    groups = [[16, 64]] * 30
    _write(tmp_path, a, "bf16-L0-4", {"oscar": _details(5.05, [1.03, 1.53, 2.03])}, bf16_layers=[0, 1, 2, 3, 4])
    run = json.loads((tmp_path / "bf16-L0-4_2048.json").read_text())
    run["settings"]["rotations"]["oscar"]["layer_groups"] = groups
    (tmp_path / "bf16-L0-4_2048.json").write_text(json.dumps(run))
    out = fc.study(a, {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64})
    assert out["rows"]["bf16-L0-4"]["bytes_per_token_head"] == pytest.approx((5 * 256 + 25 * 42) / 30)
    (tmp_path / report.FIDELITY_CANDIDATES).write_text(json.dumps(out))
    kl = [{"attn_kl": 0.2 if i < 5 else 0.1, "logit_rel": 0, "out_rel": 0} for i in range(30)]
    (tmp_path / report.LAYER_PROXY).write_text(json.dumps({"tokens": 8, "data": "calib", "results": {
        "smol_oscar": {"layers": kl}, "smol_oscar_g8": {"layers": [{**x, "attn_kl": 0} for x in kl]}}}))
    text = report.render_fidelity_candidates(str(tmp_path))
    row = next(line for line in text.splitlines() if line.startswith("| 0-4 |")).split(" | ")
    assert row[1] == "+0.0100 ± 0.0000" and row[2] == "25%" and row[3].rstrip(" |") == "29%"  # 1.0 / 3.5 of the KL
    (tmp_path / "study_candidates_tinylm-A.json").write_text(json.dumps({**out, "model": "tinylm-A"}))
    assert "tinylm-A in simulation" in report.render_fidelity_candidates(str(tmp_path))
