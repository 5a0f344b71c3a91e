"""README.md and benchmarks/RESULTS.md stay true to the code: generated tables, flags,
defaults, refusals, commands, links, and the OpenAI client example (run against a
stand-in server)."""
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS_TEXT = RESULTS_MD.read_text()
REPORT = [sys.executable, "-m", "benchmarks.report"]  # run with cwd=ROOT


def _section(title: str) -> str:
    """README text from the heading `title` to the next heading of the same or higher level."""
    m = re.search(rf"^(#+) {re.escape(title)}\n", README, re.M)
    assert m, f"README has no section '{title}'"
    rest = README[m.end():]
    nxt = re.search(rf"^#{{1,{len(m.group(1))}}} ", rest, re.M)
    return rest[:nxt.start()] if nxt else rest


def test_model_table_shows_each_served_row_and_the_refusal_reason(tmp_path):
    assert report.render_architectures(str(tmp_path)).startswith("_No results yet: run `python3 -m benchmarks.architectures_serving")
    geometry = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 96}
    (tmp_path / "calibration_architectures.json").write_text(json.dumps(
        {"rows": [{"name": "a", "calibrate_ok": True, "file_ok": True}, {"name": "b", "calibrate_ok": True, "file_ok": False}]}))
    (tmp_path / "architectures_serving.json").write_text(json.dumps({"device": "GPU X", "checks": {}, "rows": [
        {"name": "a", "source": "org/A", "architecture": "AForCausalLM", "geometry": geometry,
         "features": ["head_dim 96", "q/k/v bias"], "verdict": "refused: oscar-sglang: --kv-cache-dtype oscar_int2 "
         "cannot serve AForCausalLM: head_dim 96 (why)"},
        {"name": "b", "geometry": geometry, "verdict": "fail: long prompt incomplete"}]}))
    rows = [r for r in report.render_architectures(str(tmp_path)).splitlines() if r.startswith("| ")][2:]
    assert rows[0].startswith("| org/A (`AForCausalLM`) | 32q / 8kv, head_dim 96; q/k/v bias | [ok]")
    assert "[refused at start-up: head_dim 96 (why)]" in rows[0]
    assert "| [fail](" in rows[1] and "[fail: long prompt incomplete]" in rows[1]


def test_result_tables_are_generated_from_the_results_files():
    # the README holds the headline and the model table, RESULTS.md every other table, each exactly once
    assert report.sections_in(README) == ["headline", "architectures"]
    assert sorted(report.sections_in(RESULTS_TEXT)) == sorted(set(report.SECTIONS) - {"headline", "architectures"})
    assert [str(ROOT / "README.md"), str(RESULTS_MD)] == [str(d) for d in report.DOCUMENTS]
    r = subprocess.run([*REPORT, "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_check_and_write_cover_both_documents(tmp_path):
    stale = tmp_path / "doc.md"
    stale.write_text("<!-- report:capacity -->\nold\n<!-- /report:capacity -->\n")
    r = subprocess.run([*REPORT, "--check", str(ROOT / "README.md"), str(stale)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 1 and "doc.md: stale report sections capacity" in r.stderr
    r = subprocess.run([*REPORT, "--results", str(_e2e_fixture(tmp_path)), "--write", str(stale)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "700,000" in stale.read_text(), r.stderr


def _headline_fixture(tmp_path: Path) -> Path:
    res = _e2e_fixture(tmp_path)
    (res / "capacity_qwen3-8b-shape.json").write_text(json.dumps(
        {"bf16": 100000, "oscar_int2": 700000, "meta": {"model": "m-shape", "gpu": "GPU-X", "mem_fraction_static": 0.8}}))
    cases = [{"batch": b, "context": n, "oscar_decode_us": t, "flashinfer_bf16_us": f}
             for b, n, t, f in ((1, 65536, 40.0, 80.0), (8, 131072, 100.0, 350.0), (1, 4096, 20.0, 10.0))]
    (res / "kernels_h200.json").write_text(json.dumps({"device": "GPU-X", "cases": cases}))
    st = {"ppl_windows": 16, "ppl_len": 8192, "passkey_trials": 20, "passkey_depths": [0.1, 0.5, 0.9]}
    (res / "server_tinylm-A.json").write_text(json.dumps({"model": "tinylm-A", "settings": st, "methods": {
        "bf16": {"ppl_8k": 5.0, "passkey": {"2048": 1.0, "8192": 0.9}},
        "oscar": {"ppl_8k": 5.1, "passkey": {"2048": 1.0, "8192": 0.85}}}}))
    (res / "server_passkey8k_quantizers_tinylm-A.json").write_text(json.dumps({"methods": {
        "bf16": {"passkey_hits": {"8192": [1, 1, 0, 1]}}, "minmax": {"passkey_hits": {"8192": [1, 0, 0, 1]}}}}))
    return res


def test_headline_table_links_every_cell_to_its_results_file(tmp_path):
    res = _headline_fixture(tmp_path)
    lines = report.render_headline(str(res)).splitlines()
    assert lines[0] == "| measured | oscar_int2 | BF16 |"
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows[cells[0]] = cells[1:]
    cap = next(v for k, v in rows.items() if k.startswith("KV cache capacity"))
    assert cap[0] == "[700,000 tokens (7.00x)](benchmarks/results/capacity_qwen3-8b-shape.json)"
    long = next(v for k, v in rows.items() if "64k-128k tokens of context, batch 1-8 (GPU-X)" in k)
    assert long[0].startswith("[2.00-3.50x the speed of FlashInfer BF16](benchmarks/results/kernels_h200.json)")
    short = next(v for k, v in rows.items() if "4k-4k tokens" in k)
    assert short[0].startswith("[0.50x the speed")
    ppl = next(v for k, v in rows.items() if k.startswith("perplexity, 16 windows of 8,192 tokens"))
    assert ppl == ["[5.1000 (1.0200x)](benchmarks/results/server_tinylm-A.json)",
                   "[5.0000](benchmarks/results/server_tinylm-A.json)"]
    pk = next(v for k, v in rows.items() if k.startswith("passkey retrieval at 2k / 8k tokens, 60 prompts"))
    assert pk[0] == "[1.000 / 0.850](benchmarks/results/server_tinylm-A.json)"
    paired = next(v for k, v in rows.items() if "4 paired prompts" in k)
    assert paired[0].startswith("[0.500 (-0.250 ± ") and paired[1].startswith("[0.750]")
    for cells in rows.values():  # every figure links to its file, and that file exists
        for cell in cells:
            assert re.fullmatch(r"\[[^]]+\]\(benchmarks/results/[\w.-]+\.json\)", cell), cell
    assert "No results yet" in report.render_headline(str(tmp_path / "none"))


def test_calibration_budget_caption_names_the_files_settings_and_todays_defaults(tmp_path):
    (tmp_path / "calibration_budget.json").write_text(json.dumps({
        "what": "m, default oscar-calibrate settings (U-H-P, clip head/attn, G=128, fp16 scales) at several budgets",
        "wall_seconds_by_tokens": {"8192": 1.0}, "proxy": {},
        "default_cpu_run": {"command": "oscar-calibrate --model /some/machine/models/tinylm-A --out x", "tokens": 8,
                            "wall_seconds": 2.0}}))
    t = report.render_calibration_budget(str(tmp_path))
    assert "defaults when this file was made (U-H-P, clip head/attn, G=128, fp16 scales)" in t
    assert f"defaults now: {report.calibrate_defaults_text()}" in t
    assert "--model ../shared/models/tinylm-A --out x" in t and "/some/machine" not in t


def test_report_states_the_calibration_defaults_of_the_code():
    from calibration import calibrate
    from oscar_kernels.contract.layout import DEFAULT_SCALE_DTYPE, KVLayout

    d = report.CALIBRATE_DEFAULTS
    assert (d["variant"], d["clip"], d["scale_dtype"]) == (calibrate.DEFAULT_VARIANT, calibrate.DEFAULT_CLIP,
                                                           DEFAULT_SCALE_DTYPE)
    assert KVLayout.resolve(128) == KVLayout(32, 128, DEFAULT_SCALE_DTYPE)
    assert KVLayout.resolve(64) == KVLayout(16, 64, DEFAULT_SCALE_DTYPE)
    assert (d["key_group"], d["value_group"]) == ("head_dim / 4", "min(128, head_dim)")
    assert d["key_groups"] == calibrate.DEFAULT_KEY_GROUPS


def _e2e_fixture(tmp_path: Path) -> Path:
    res = tmp_path / "results"
    res.mkdir()
    data = {"model": "m-shape", "environment": {"gpu": "GPU-X", "sglang": "0.5.17"},
            "settings": {"mem_fraction_static": 0.85, "page_size": 64, "max_running_requests": 64},
            "configs": {
                "oscar_int2": {"max_total_num_tokens": 700000, "concurrent_100k": 6, "decode_ms_32k": 5.25,
                               "decode_ms_64k": None, "decode_ms_128k": 7.5, "throughput_tok_s": 1234.5,
                               "steady_decode_tok_s": 300.0,
                               "decode": {"decode_ms_32k": {"median_ttft_ms": 4270.0},
                                          "decode_ms_128k": {"median_ttft_ms": 70000.0}},
                               "throughput": {"median_ttft_ms": 1500.0, "p99_ttft_ms": 9000.0,
                                              "median_itl_ms": 20.0, "p99_itl_ms": 80.0,
                                              "settings": {"max_concurrency": 6, "num_prompts": 32,
                                                           "input_len": 64000, "range_ratio": 1.0,
                                                           "output_len": 256}},
                               "errors": {"throughput": "boom"}},
                "bf16_triton": {"max_total_num_tokens": 100000, "concurrent_100k": 0, "errors": {}}}}
    (res / "e2e_m-shape.json").write_text(json.dumps(data))
    (res / "capacity_m-shape.json").write_text(json.dumps(
        {"bf16": 100000, "oscar_int2": 700000, "meta": {"model": "m-shape", "gpu": "GPU-X"}}))
    return res


def test_e2e_and_capacity_tables_render_every_figure(tmp_path):
    res = _e2e_fixture(tmp_path)
    e2e = report.render_e2e(str(res))
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in e2e.splitlines() if r.startswith("| ") and "config" not in r and "---" not in r}
    assert list(rows) == ["bf16_triton", "oscar_int2"]  # canonical order
    o = rows["oscar_int2"]
    assert o[:7] == ["700,000", "7.00x", "6", "5.25", "-", "7.50", "4.27 / - / 70.00"]
    # decode tok/s at ITL p50: 6 in flight x 1000 / 20 ms
    assert o[7:13] == ["1,234.5", "300.0", "300.0", "6", "1.50 / 9.00", "20.0 / 80.0"] and "boom" in o[13]
    assert "GPU-X" in e2e and "64000 random input tokens and 256 output tokens" in e2e
    cap = report.render_capacity(str(res))
    assert "| oscar_int2 | 700,000 | 7.00x |" in cap


def test_update_rewrites_only_marked_sections(tmp_path):
    res = _e2e_fixture(tmp_path)
    text = "a\n<!-- report:capacity -->\nold\n<!-- /report:capacity -->\nb\n"
    new = report.update(text, str(res))
    assert new.startswith("a\n<!-- report:capacity -->\n") and new.endswith("<!-- /report:capacity -->\nb\n")
    assert "old" not in new and "700,000" in new and report.update(new, str(res)) == new
    with pytest.raises(ValueError, match="no renderer"):
        report.update("<!-- report:nope -->\n<!-- /report:nope -->", str(res))


def _flags_table(title: str = "oscar-sglang serve") -> dict:
    rows = {}
    for line in _section(title).splitlines():
        m = re.match(r"\| `(--[a-z0-9-]+)[^`]*` \| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_flags_table_lists_every_oscar_flag_with_its_default():
    from sglang_ext import memory, settings

    rows = _flags_table()
    documented = {f for f in rows if f.startswith("--oscar-")}
    assert documented == {f.cli for f in settings.FLAGS}
    assert rows["--oscar-sink-tokens"] == str(settings.DEFAULT_SINK_TOKENS)
    assert rows["--oscar-recent-window"] == str(settings.DEFAULT_RECENT_WINDOW)
    assert rows["--page-size"].startswith(f"{settings.DEFAULT_PAGE_SIZE} ")
    assert rows["--max-running-requests"].startswith(f"{memory.DEFAULT_MAX_RUNNING_REQUESTS} ")
    assert f"`--kv-cache-dtype {settings.OSCAR_KV_DTYPE}`" in README
    assert f"`--attention-backend {settings.OSCAR_ATTENTION_BACKEND}`" in README


def test_every_refusal_is_documented():
    from sglang_ext import refusals

    text = _section("Supported models and refused features")
    missing = [flag for _, _, flag, _ in refusals._FLAG_RULES if f"`{flag}`" not in text]
    missing += [env for env, _ in refusals._ENV_RULES if f"`{env}=1`" not in text]
    assert not missing, f"refused at start-up but not in README: {missing}"


def test_calibrate_options_table_gives_the_codes_defaults():
    from calibration import calibrate
    from oscar_kernels.contract.layout import DEFAULT_SCALE_DTYPE, KVLayout

    rows = _flags_table("oscar-calibrate")
    assert rows["--model"] == rows["--out"] == "required"
    assert rows["--variant"] == f"`{calibrate.DEFAULT_VARIANT}`" and rows["--clip"] == f"`{calibrate.DEFAULT_CLIP}`"
    assert rows["--scale-dtype"] == f"`{DEFAULT_SCALE_DTYPE}`"
    assert rows["--tokens"] == (f"{calibrate.DEFAULT_TOKENS['cpu']:,} on cpu, "
                                f"{calibrate.DEFAULT_TOKENS['cuda']:,} on cuda")
    import argparse

    from calibration import cli

    parser = argparse.ArgumentParser()
    cli._add_model_args(parser)
    assert rows["--seq-len"] == str(parser.get_default("seq_len"))
    assert rows["--group-size"] == f"head_dim / 4 ({KVLayout.resolve(128).key_group_size} at head_dim 128)"
    assert rows["--value-group-size"] == "min(128, head_dim)" and KVLayout.resolve(256).value_group_size == 128


DOCS = {"README.md": README, "benchmarks/RESULTS.md": RESULTS_TEXT}


def test_calibrate_flags_in_the_docs_exist():
    """Every flag the docs give `oscar-calibrate` (or its `proxy` subcommand) is in that command's --help."""
    def help_text(*sub):
        r = subprocess.run([sys.executable, "-m", "calibration.cli", *sub, "--help"], capture_output=True,
                           text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    used = {m for text in DOCS.values() for m in re.findall(r"oscar-calibrate [^\n`|]*", text)}
    flags = {sub: {f for line in used if line.startswith("oscar-calibrate proxy") == (sub == "proxy")
                   for f in re.findall(r"(--[a-z][a-z0-9-]*)", line)} for sub in ("main", "proxy")}
    assert "--model" in flags["main"] and "--out" in flags["main"] and "--rotations" in flags["proxy"]
    for sub, args in (("main", ()), ("proxy", ("proxy",))):
        text = help_text(*args)
        assert not [f for f in flags[sub] if f not in text], (sub, text)


def test_eval_flags_in_the_docs_exist():
    r = subprocess.run([sys.executable, "-m", "calibration.fidelity.cli", "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    used = {m for text in DOCS.values() for m in re.findall(r"oscar-eval [^\n`|]*", text)}
    used |= set(re.findall(r"`(--[a-z][a-z0-9-]*)[^`]*`", _section("oscar-eval")))
    flags = {f for line in used for f in re.findall(r"(--[a-z][a-z0-9-]*)", line)}
    assert "--method" in flags and "--out" in flags
    assert not [f for f in flags if f not in r.stdout], r.stdout


def test_scripts_named_in_the_docs_exist():
    for name, text in DOCS.items():
        for path in set(re.findall(r"\b((?:benchmarks|examples|docker|tests|\.ci)/[\w./-]+\.(?:py|sh)|docker/Dockerfile)\b",
                                   text)):
            assert (ROOT / path).is_file(), f"{name} names {path}, which does not exist"
        for module in set(re.findall(r"python3? -m ((?:benchmarks|oscar_kernels|calibration|sglang_ext)(?:\.\w+)+)", text)):
            path = module.replace(".", "/")
            assert (ROOT / f"{path}.py").is_file() or (ROOT / path / "__main__.py").is_file(), \
                f"{name} runs {module}, which does not exist"


def test_docs_run_benchmarks_as_modules():
    # run as a file, a benchmark does not find the `benchmarks` package that its imports name
    for name, text in DOCS.items():
        hits = re.findall(r"python3? (?:benchmarks|tests)/\w+\.py", text)
        assert not hits, f"{name} runs {hits} as files: use python3 -m benchmarks.<script> from the repository root"


def test_links_and_results_files_in_the_docs_exist():
    for name, text in DOCS.items():
        base = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not target.startswith("http"):
                assert (base / target).exists(), f"{name} links to {target}, which does not exist"
        for path in set(re.findall(r"`(?:benchmarks/results/)?(history/[\w.-]+\.json)`", text)):
            assert (ROOT / "benchmarks" / "results" / path).is_file(), f"{name} names {path}, which does not exist"


def test_anchors_in_the_docs_exist():
    def anchors(text):
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", text, re.M)}

    for name, text in DOCS.items():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)]+)\)", text):
            where = (ROOT / name).parent / target if target else ROOT / name
            assert anchor in anchors(where.read_text()), f"{name}: no heading for #{anchor} in {target or name}"


def test_no_development_history_where_a_user_reads():
    # "session 9", "round 17", "run 3", "call F" (a capital letter alone), and the measuring machine's paths
    diary = re.compile(r"\b(?i:session|round|run|call)s? (?:\d+|[A-Z])\b|/work/|/root/")
    for name, text in DOCS.items():
        hits = [m.group(0) for m in diary.finditer(text)]
        assert not hits, f"{name}: development-diary labels or machine paths {hits}"


def test_readme_is_short_and_starts_with_install_and_quick_start():
    lines = README.splitlines()
    assert len(lines) <= 320, len(lines)
    heads = {ln: i + 1 for i, ln in enumerate(lines) if ln.startswith("## ")}
    assert heads["## Quick start (GPU)"] < 80 and README.index("<!-- BEGIN install -->") < len("\n".join(lines[:80]))
    order = ["## Requirements", "## The two commands", "## Quick start (GPU)", "## Flags",
             "## Supported models and refused features", "## Docker", "## Troubleshooting",
             "## Repository layout", "## Reproduce the figures"]
    assert [heads[h] for h in order] == sorted(heads[h] for h in order)


def test_readme_commands_run_from_a_fresh_shell():
    """Every program the README's shell blocks call is called by its .venv path (a fresh shell
    has no activated venv): the package's commands and the examples."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M)
    assert blocks
    prog = re.compile(r"(?<![\w/.:-])((?:oscar-calibrate|oscar-eval|oscar-sglang)(?![\w:-])|python3? examples/)")
    bare = [ln for b in blocks for ln in b.splitlines() if not ln.startswith("docker ")
            for m in prog.finditer(ln) if not ln[:m.start()].endswith(".venv/bin/")]
    assert not bare, f"README commands that need an activated venv: {bare}"


class _StandIn(BaseHTTPRequestHandler):
    """Answers the three OpenAI endpoints the example uses, like an SGLang server."""

    def _send(self, body: bytes, ctype="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        assert self.path == "/v1/models"
        self._send(json.dumps({"object": "list", "data": [{"id": "tinylm-A", "object": "model",
                                                            "created": 0, "owned_by": "sglang"}]}).encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/completions" and req["model"] == "tinylm-A" and req["temperature"] == 0
        base = {"id": "c1", "object": "text_completion", "created": 0, "model": "tinylm-A"}
        if not req.get("stream"):
            self._send(json.dumps({**base, "choices": [{"index": 0, "text": "\n    return n", "finish_reason": "length"}],
                                   "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}).encode())
            return
        chunks = [{**base, "choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("\n    ", "return n")]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(body.encode(), "text/event-stream")

    def log_message(self, *a):
        pass


def test_openai_client_example_runs_against_a_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_client.py"),
                            "--base-url", f"http://127.0.0.1:{server.server_port}/v1", "--max-tokens", "4"],
                           capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr
    assert "model: tinylm-A" in r.stdout and "completion: '\\n    return n'" in r.stdout
    assert "streamed: \n    return n" in r.stdout and "usage: 5 prompt + 4 completion tokens" in r.stdout


def test_soak_table(tmp_path):
    (tmp_path / "soak_t.json").write_text(json.dumps({"configs": {"oscar_int2": {
        "pass": True, "requests": 200, "aborted_mid_stream": 19, "shared_prefix_requests": 100,
        "error_count": 0, "leak_messages": [], "traceback_count": 0, "exact_equal": 170, "compared": 181}}}))
    assert "| oscar_int2 | yes | 200 | 19 | 100 | 0 | 0 | 0 | 170 / 181 |" in report.render_soak(str(tmp_path))


def test_kernel_and_proxy_tables(tmp_path):
    case = {"batch": 8, "context": 65536, "oscar_decode_us": 256.47, "oscar_GBps": 1201.7,
            "oscar_fraction_of_copy": 0.281, "store_us": 16.88, "triton_bf16_us": 623.08,
            "flashinfer_bf16_us": 480.8, "speedup_vs_flashinfer": 1.87}
    (tmp_path / "kernels_x.json").write_text(json.dumps({"device": "GPU-X", "cases": [case], "shape": {}}))
    (tmp_path / "kernels_x_sweep.json").write_text(json.dumps({"device": "GPU-X", "cases": [case]}))
    k = report.render_kernels(str(tmp_path))
    assert k.count("| 8 | 65,536 | 256.47 | 1,201.7 | 0.281 | 16.88 | 623.08 | 480.80 | 1.87 |") == 1
    (tmp_path / "calibration_proxy.json").write_text(json.dumps({"model": "/m/tinylm-A", "evals": {
        "a/sympy,b/networkx": {"results": {"U-H-P": {"mean": {"logit_rel": 0.25, "attn_kl": 0.125, "out_rel": 0.5}}}}}}))
    p = report.render_calibration_proxy(str(tmp_path))
    assert "sympy+networkx: attn_kl" in p and "| U-H-P | 0.2500 | 0.1250 | 0.5000 |" in p


def test_fidelity_sweep_table(tmp_path):
    (tmp_path / "fidelity_x_sweep_m.json").write_text(json.dumps({
        "model": "m", "eval_args": ["--ppl-len", "2048"], "bf16": {"ppl_2k": 7.5, "ppl_decode_tail": 7.0},
        "runs": [{"sink": 4, "recent": 64, "memory": {"ring_in_int2_tokens": 455.1, "sink_in_int2_tokens": 28.4},
                  "methods": {"oscar": {"ppl_2k": 7.75, "ppl_decode_tail": 7.25}}}]}))
    t = report.render_fidelity_sweep(str(tmp_path))
    assert "| bf16 (reference) | - | - | - | 7.500 / 7.000 |" in t
    assert "| S=4 | W=64 | 455.1 | 28.4 | 7.750 / 7.250 |" in t


def test_calibration_budget_table(tmp_path):
    (tmp_path / "calibration_budget.json").write_text(json.dumps({
        "what": "w", "wall_seconds_by_tokens": {"65536": 93.92, "8192": 14.16},
        "proxy": {"default_8192": {"logit_rel": 0.2, "attn_kl": 0.1, "out_rel": 0.3}, "naive": {"logit_rel": 0.3}},
        "default_cpu_run": {"command": "oscar-calibrate x", "tokens": 32768, "wall_seconds": 182.5}}))
    t = report.render_calibration_budget(str(tmp_path))
    lines = [ln for ln in t.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert lines == ["| 8,192 | 14.2 | 0.2000 | 0.1000 | 0.3000 |", "| 65,536 | 93.9 | - | - | - |",
                     "| (naive, no calibration) | - | 0.3000 | - | - |"]
    assert "32,768 tokens) took 182.5 s" in t


def test_extend_table_renders_every_measured_read(tmp_path):
    (tmp_path / "extend_gpu.json").write_text(json.dumps({
        "device": "GPU-X", "shape": {"q_heads": 32, "kv_heads": 8, "head_dim": 128}, "timing": "events",
        "cases": [{"prefix": 32768, "new": 8192, "oscar_int2_us": 9000.0, "oscar_bf16_us": 4000.0,
                   "oscar_flashinfer_us": 2500.0, "materialize_us": 300.0, "flashinfer_bf16_us": 2100.0}]}))
    text = report.render_extend(str(tmp_path))
    row = next(r for r in text.splitlines() if r.startswith("| 32,768"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells == ["32,768", "8,192", "9,000.0", "4,000.0", "2,500.0", "300.0", "2,100.0"]  # untimed reads: no column
    header = next(r for r in text.splitlines() if r.startswith("| cached prefix"))
    assert "128 rows" not in header and "via FlashInfer" in header
    assert "GPU-X" in text and "plot:" not in text and "No results" in report.render_extend(str(tmp_path / "none"))
    (tmp_path / "extend_gpu.png").write_bytes(b"png")
    assert "plot: `" in report.render_extend(str(tmp_path))


def test_tp_table_renders_equality_and_near_ties(tmp_path):
    (tmp_path / "tp_m.json").write_text(json.dumps({
        "model": "m", "settings": {"tp": 2, "prompts": 4, "shortest": 1024, "longest": 8192, "max_new_tokens": 32,
                                   "chunk": 1024, "mem_fraction": 0.5},
        "configs": {"bf16": {"runs": {"tp1": {"max_total_num_tokens": 10}, "tp2": {"max_total_num_tokens": 20}},
                             "compared": 4, "exact_equal": 3, "equal_up_to_a_near_tie": 4,
                             "first_divergent_token": [{"prompt_len": 5000, "token": 7, "near_tie": True}]},
                    "oscar_int2": {"runs": {"tp1": {"max_total_num_tokens": 70}}}}}))
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in report.render_tp(str(tmp_path)).splitlines() if r.startswith("| ") and "config" not in r
            and "---" not in r}
    assert rows["bf16"] == ["10", "20", "3 / 4", "4", "5000: token 7 (near-tie)"]
    assert rows["oscar_int2"] == ["70", "-", "not measured", "-", "-"]


def test_kernel_sweep_winners_are_reported_only_beyond_noise():
    sweep = [{"variant": "default", "batch": 1, "context": 65536, "oscar_decode_us": 50.0},
             {"variant": "merge_grid=split", "batch": 1, "context": 65536, "oscar_decode_us": 35.0},
             {"variant": "x", "batch": 1, "context": 65536, "oscar_decode_us": 40.0},
             {"variant": "default", "batch": 64, "context": 16384, "oscar_decode_us": 315.0},
             {"variant": "y", "batch": 64, "context": 16384, "oscar_decode_us": 310.0},  # 1.6%: noise
             {"variant": "group=64", "batch": 64, "context": 16384, "oscar_decode_us": 100.0},  # other layout
             {"variant": "z", "batch": 8, "context": 65536, "skipped": "time budget"}]
    assert report.fastest_variants(sweep) == ["batch 1, 65,536: merge_grid=split 35.0 us vs 50.0 us default"]
