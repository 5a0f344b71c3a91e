"""benchmarks/targets.py: verdicts follow the results files (met / missed / not measured)."""
import json
from pathlib import Path

from benchmarks import targets


def _write(d: Path, name: str, data: dict) -> None:
    (d / name).write_text(json.dumps(data))


def _verdicts(d: Path) -> dict:
    return {t: v for t, _, v in targets.evaluate(str(d))}


def test_nothing_measured(tmp_path):
    assert set(_verdicts(tmp_path).values()) == {"not measured"}


def test_fidelity_and_capacity_verdicts(tmp_path):
    ref = {"ppl_8k": 5.0, "passkey": {"2048": 1.0, "8192": 0.9}}
    _write(tmp_path, "fidelity_tinylm-A.json",
           {"methods": {"bf16": ref, "oscar": {"ppl_8k": 5.1, "passkey": {"2048": 1.0, "8192": 0.85}}}})
    _write(tmp_path, "server_tinylm-A.json",
           {"methods": {"bf16": ref, "oscar": {"ppl_8k": 5.2, "passkey": {"2048": 0.99, "8192": 0.89}}}})
    _write(tmp_path, "capacity_qwen3-8b-shape.json", {"bf16": 100, "oscar_int2": 650})
    v = _verdicts(tmp_path)
    sim = [k for k in v if k.startswith("simulated")]
    srv = [k for k in v if k.startswith("through the server")]
    assert [v[k] for k in sim] == ["met", "missed"]  # 1.02 x; passkey gap -0.05 at 8k
    assert [v[k] for k in srv] == ["missed", "met"]  # 1.04 x; gaps -0.01
    assert v[next(k for k in v if k.startswith("KV capacity"))] == "met"  # exactly 6.5 x


def test_kernel_and_soak_verdicts(tmp_path):
    cases = [{"batch": 64, "context": 131072, "oscar_GBps": 3100.0, "oscar_decode_us": 1000.0,
              "flashinfer_bf16_us": 4100.0},
             {"batch": 1, "context": 65536, "oscar_GBps": 400.0, "oscar_decode_us": 40.0,
              "flashinfer_bf16_us": 70.0}]
    _write(tmp_path, "kernels_h200.json", {"copy_GBps": 4000.0, "cases": cases})
    _write(tmp_path, "soak_tinylm-A.json", {"configs": {"oscar_int2": {"pass": True, "exact_equal": 180,
                                                                       "compared": 180}}})
    v = _verdicts(tmp_path)
    kern = {k: x for k, x in v.items() if k.startswith("decode kernel")}
    assert list(kern.values()) == ["met", "met", "missed"]  # 0.775 x copy; 4.1 x; 1.75 x at b1
    assert [x for k, x in v.items() if k.startswith("soak")] == ["met", "met"]
    _write(tmp_path, "soak_deterministic_tinylm-A.json", {"configs": {"oscar_int2": {
        "pass": True, "exact_equal": 179, "compared": 180}}})
    v = _verdicts(tmp_path)
    det = {k: x for k, x in v.items() if k.startswith("soak (--enable-deterministic-inference)")}
    assert list(det.values()) == ["met", "missed"]


def test_e2e_throughput_is_judged_against_the_faster_bf16(tmp_path):
    _write(tmp_path, "e2e_qwen3-8b-shape.json", {"configs": {
        "bf16_triton": {"throughput_tok_s": 50.0, "decode_ms_64k": 30.0},
        "bf16_flashinfer": {"throughput_tok_s": 100.0, "decode_ms_64k": 7.5},
        "oscar_int2": {"throughput_tok_s": 400.0, "decode_ms_64k": 5.0, "concurrent_100k": 52}}})
    rows = {t: (m, v) for t, m, v in targets.evaluate(str(tmp_path)) if t.startswith("end to end")}
    tp = next(x for t, x in rows.items() if "throughput" in t)
    assert tp == ("4.00 x (bf16_flashinfer)", "missed")  # 8 x bf16_triton, but 4 x flashinfer
    assert [v for _, v in rows.values()] == ["met", "missed", "met"]  # 52; 4 x; 5.0 <= 7.5 / 1.5


def test_fidelity_table_shows_deltas_and_first_token_logprob():
    from benchmarks import report

    ref = {"ppl_8k": 5.0, "passkey": {"2048": 1.0, "8192": 0.9},
           "passkey_first_token_logprob": {"2048": -0.1, "8192": -0.5}}
    osc = {"ppl_8k": 5.1, "passkey": {"2048": 1.0, "8192": 0.85},
           "passkey_first_token_logprob": {"2048": -0.2, "8192": -0.9}}
    text = report.fidelity_table({"bf16": ref, "oscar": osc})
    assert "| oscar | 5.1000 | 1.0200 | 1.000 (+0.000) | 0.850 (-0.050) | -0.200 / -0.900 |" in text
    assert "log p(first answer token) 2048 / 8192" in text


def test_steady_decode_verdict(tmp_path):
    label = next(k for k in _verdicts(tmp_path) if k.startswith("steady-state decode at a full pool"))
    assert _verdicts(tmp_path)[label] == "not measured"
    _write(tmp_path, "e2e_decode_throughput_qwen3-8b-shape.json",
           {"target": {"ratio": 5.0, "steady_8k": {"measured": 3.37, "met": False},
                       "steady_32k": {"measured": None, "met": None}}})
    assert _verdicts(tmp_path)[label] == "missed"
    _write(tmp_path, "e2e_decode_throughput_qwen3-8b-shape.json",
           {"target": {"steady_8k": {"measured": 5.2}, "steady_32k": {"measured": 6.0}}})
    assert _verdicts(tmp_path)[label] == "met"
