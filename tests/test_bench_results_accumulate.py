"""A benchmark split over several GPU calls accumulates in one JSON (server_harness.previous_entries)."""
import json

from benchmarks.server_harness import previous_entries


def _write(path, settings, methods):
    path.write_text(json.dumps({"model": "tinylm-A", "settings": settings, "methods": methods}))


def test_same_settings_keep_the_other_methods(tmp_path):
    out = tmp_path / "server.json"
    _write(out, {"chunk": 1024}, {"bf16": {"ppl_8k": 5.6}, "hadamard": {"ppl_8k": 5.79}})
    run = {"model": "tinylm-A", "settings": {"chunk": 1024}}
    assert previous_entries(str(out), run, "methods", ["hadamard", "oscar"]) == {"bf16": {"ppl_8k": 5.6}}


def test_other_settings_or_model_or_no_file_start_fresh(tmp_path):
    out = tmp_path / "server.json"
    assert previous_entries(str(out), {"model": "tinylm-A", "settings": {}}, "methods", []) == {}
    _write(out, {"chunk": 1024}, {"bf16": {"ppl_8k": 5.6}})
    assert previous_entries(str(out), {"model": "tinylm-A", "settings": {"chunk": 512}}, "methods", []) == {}
    assert previous_entries(str(out), {"model": "other", "settings": {"chunk": 1024}}, "methods", []) == {}
    out.write_text("{truncated")
    assert previous_entries(str(out), {"model": "tinylm-A", "settings": {"chunk": 1024}}, "methods", []) == {}


def test_first_divergence():
    from benchmarks.server_harness import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) == -1
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_tp_check_prompts_and_refusals():
    import numpy as np
    import pytest

    from benchmarks import tp_check

    stream = np.arange(100_000)
    prompts = tp_check.build_prompts(stream, 4, 100, 400)
    assert [len(p) for p in prompts] == [100, 200, 300, 400]
    assert prompts[1][0] == 25_000  # disjoint places in the stream
    with pytest.raises(SystemExit, match="--rotations"):
        tp_check.main(["--configs", "oscar_int2"])
    with pytest.raises(SystemExit, match="--tp"):
        tp_check.main(["--configs", "bf16", "--tp", "1"])


def test_near_tie_rule():
    from benchmarks.server_harness import agree_up_to_a_near_tie as agree

    top = [{"a": -0.1, "x": -3.0}, {"R": -3.119, "J": -3.182}, {"c": -0.5, "d": -0.7}]
    assert agree(["a", "R", "c"], ["a", "R", "c"], top, 0.1) is None
    assert agree(["a", "J", "q"], ["a", "R", "c"], top, 0.1) is None  # 0.063 nats: a near-tie
    assert "token 1" in agree(["a", "J", "q"], ["a", "R", "c"], top, 0.05)
    assert "token 0" in agree(["x", "R", "c"], ["a", "R", "c"], top, 0.1)  # 2.9 nats apart
    assert "token 1" in agree(["a", "Q", "c"], ["a", "R", "c"], top, 0.1)  # not a candidate
    assert "lengths" in agree(["a", "R"], ["a", "R", "c"], top, 0.1)
    three = [{"R": -3.2312, "K": -3.2312, "8": -3.25, "z": -3.6}]  # a three-way tie (seen on the H200)
    assert agree(["8"], ["K"], three, 0.1) is None
    assert "token 0" in agree(["z"], ["K"], three, 0.1)


def test_tp_check_classifies_divergences():
    from benchmarks import tp_check

    prompts = [[1] * 10, [2] * 20, [3] * 30]
    ref = [([5, 6, 7], [{5: -0.1}, {6: -1.0, 9: -1.05}, {7: -0.2}]),
           ([5, 6, 7], [{5: -0.1, 8: -3.0}, {6: -0.1}, {7: -0.2}]),
           ([4, 4, 4], [{4: -0.1}, {4: -0.1}, {4: -0.1}])]
    got = [([5, 9, 1], None), ([8, 6, 7], None), ([4, 4, 4], None)]
    res = tp_check.compare(prompts, ref, got, 0.1)
    assert res["compared"] == 3 and res["exact_equal"] == 1 and res["equal_up_to_a_near_tie"] == 2
    assert res["first_divergent_token"] == [
        {"prompt_len": 10, "token": 1, "near_tie": True, "ref_top2_gap": 0.05},
        {"prompt_len": 20, "token": 0, "near_tie": False, "ref_top2_gap": 2.9}]
