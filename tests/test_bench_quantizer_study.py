"""benchmarks/quantizer_study.py: the paired summary and verdicts of the candidates (CPU)."""
import pytest

from benchmarks import quantizer_study as qs


def test_study_summary_pairs_every_candidate_with_minmax_and_bf16():
    def method(ppl, nll, hits):
        return {"ppl_8k": ppl, "ppl_detail": {"nll_by_window": nll}, "passkey": {"8192": sum(hits) / len(hits)},
                "passkey_hits": {"8192": hits}, "passkey_first_token_logprobs": {"8192": [-0.1 * h for h in hits]}}

    runs = {"long": {"methods": {
        "bf16": method(5.0, [1.0, 1.0, 1.0, 1.0], [1, 1, 1, 1]),
        "minmax": method(5.1, [1.1, 1.0, 1.2, 1.1], [1, 1, 1, 0]),
        "per-channel-keys": method(5.2, [1.2, 1.1, 1.3, 1.2], [0, 0, 0, 0])}}}
    table = {n: {"total": 74} for n in qs.CANDIDATES}
    rows = qs.summarise(runs, table)
    pck = rows["per-channel-keys"]
    assert rows["minmax"]["ppl_ratio_vs_bf16"] == 1.02 and "nll_paired_vs_minmax" not in rows["minmax"]
    assert pck["nll_paired_vs_minmax"]["gap"] == 0.1 and pck["nll_paired_vs_minmax"]["windows_higher"] == 4
    assert pck["passkey_paired_vs_minmax"]["8192"]["gap"] == -0.75
    assert pck["passkey_paired_vs_bf16"]["8192"]["gap"] == -1.0
    verdict = qs.verdict(rows)["per-channel-keys"]
    assert any(v.startswith("ppl worse") for v in verdict) and any(v.startswith("passkey 8192 worse") for v in verdict)


def test_server_results_pair_like_the_simulators(tmp_path):
    import json

    def served(ppl, nll, hits):
        return {"ppl_8k": ppl, "nll_by_window": nll, "passkey": {"8192": sum(hits) / len(hits)},
                "passkey_hits": {"8192": hits}, "server_cmd": ["serve"]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"methods": {"minmax": served(5.1, [1.1, 1.0, 1.2], [1, 1, 0]),
                                         "per-channel-keys": served(5.3, [1.3, 1.2, 1.4], [0, 1, 0])}}))
    b.write_text(json.dumps({"methods": {"bf16": {"passkey": {"8192": 1.0}, "passkey_hits": {"8192": [1, 1, 1]}},
                                         "oscar-g128": served(9.0, [2.0, 2.0, 2.0], [0, 0, 0])}}))
    runs = qs.server_runs([str(a), str(b)])
    assert set(runs["server"]["methods"]) == {"minmax", "per-channel-keys", "bf16"}  # oscar-g128 left out
    rows = qs.summarise(runs, {n: {"total": 74} for n in qs.CANDIDATES})
    pck = rows["per-channel-keys"]
    assert pck["nll_paired_vs_minmax"]["gap"] == 0.2 and pck["nll_paired_vs_minmax"]["windows_higher"] == 3
    assert abs(pck["passkey_paired_vs_minmax"]["8192"]["gap"] + 1 / 3) < 1e-3
    assert abs(rows["minmax"]["passkey_paired_vs_bf16"]["8192"]["gap"] + 1 / 3) < 1e-3
    assert "first_token_logprob_paired_vs_minmax" not in pck and "ppl_ratio_vs_bf16" not in pck


def test_server_results_go_into_the_study_and_leave_the_rest(tmp_path):
    import json

    study = tmp_path / "study.json"
    study.write_text(json.dumps({"candidates": {"minmax": {"ppl_8k": 5.0}}, "conclusion": "kept",
                                 "bytes_per_token_per_head": {n: {"total": 74} for n in qs.CANDIDATES}}))
    served = tmp_path / "served.json"
    served.write_text(json.dumps({"methods": {
        "bf16": {"passkey": {"8192": 1.0}, "passkey_hits": {"8192": [1, 1]}},
        "minmax": {"passkey": {"8192": 0.5}, "passkey_hits": {"8192": [1, 0]}}}}))
    assert qs.main(["--server", str(served), "--out", str(study)]) == 0
    data = json.loads(study.read_text())
    assert data["candidates"] == {"minmax": {"ppl_8k": 5.0}} and data["conclusion"] == "kept"
    assert data["through_server"]["candidates"]["minmax"]["passkey_paired_vs_bf16"]["8192"]["gap"] == -0.5
    with pytest.raises(SystemExit, match="--model and --rotations"):
        qs.main(["--out", str(study)])
