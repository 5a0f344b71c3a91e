"""Agreement with BF16 (calibration.fidelity.agreement) and its through-server path
(benchmarks.server_fidelity's top-K parsing, benchmarks.server_agreement's files and merge),
on the CPU: made-up distributions and a stand-in HTTP server answering /generate as SGLang 0.5.17."""
from __future__ import annotations

import base64
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from calibration.fidelity import agreement

V = 50  # vocabulary of the made-up distributions


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _topk(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argsort(-lp, -1, kind="stable")[:, :k]
    return np.take_along_axis(lp, idx, -1), idx


def _pair(n: int, noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    ref = _log_softmax(rng.normal(size=(n, V)) * 2.5)
    return ref, _log_softmax(ref + rng.normal(size=(n, V)) * noise)


def _full_kl(ref: np.ndarray, m: np.ndarray) -> np.ndarray:
    return (np.exp(ref) * (ref - m)).sum(-1)


def _coarse_kl(ref: np.ndarray, m: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """KL of the two distributions coarsened to the tokens ``keep`` [N, K] plus one bucket."""
    p, q = np.take_along_axis(np.exp(ref), keep, -1), np.take_along_axis(np.exp(m), keep, -1)
    pr, qr = 1 - p.sum(-1), 1 - q.sum(-1)
    return (p * np.log(p / q)).sum(-1) + pr * np.log(pr / qr)


@pytest.mark.parametrize("noise", [0.05, 0.7, 3.0])
def test_topk_kl_is_a_lower_bound_and_exact_when_every_token_is_listed(noise):
    ref, m = _pair(400, noise)
    full = _full_kl(ref, m)
    r_lp, r_idx = _topk(ref, 20)
    for k in (20, 32, V):
        m_lp, m_idx = _topk(m, k)
        got = agreement.topk_agreement(r_lp, r_idx, m_lp, m_idx, ref_k=20)
        assert (got["kl_topk"] <= full + 1e-9).all()
        missing = (~(r_idx[:, :, None] == m_idx[:, None, :]).any(-1)).sum(-1)
        assert (got["missing"] == missing).all()
        complete = missing == 0
        # every bf16 token in the method's list: the bound is the coarsened KL itself
        np.testing.assert_allclose(got["kl_topk"][complete], _coarse_kl(ref, m, r_idx)[complete], rtol=1e-6,
                                   atol=1e-9)
    assert got["missing"].sum() == 0  # k = V lists every token
    # the bound tracks the full KL: most of it at these sizes
    assert got["kl_topk"].mean() > 0.5 * full.mean()


def test_missing_tokens_take_the_least_kl_their_bound_allows():
    """Positions by hand. bf16 gives token 0 0.7, token 1 0.05 (its top 2), the rest 0.25; the
    method lists token 0 (0.4) and token 3 (0.3, its K' = 2nd): token 1 is missing, so
    q1 <= 0.3 and q1 <= 1 - 0.4 - 0.3; the KL's minimum over q1 is at 0.6 * 0.05 / 0.3 = 0.1."""
    ref_lp, ref_idx = np.log([[0.7, 0.05]]), np.array([[0, 1]])
    m_idx = np.array([[0, 3]])
    kl, missing = agreement.kl_topk_lower_bound(ref_lp, ref_idx, np.log([[0.4, 0.3]]), m_idx, ref_k=2)
    want = 0.7 * math.log(0.7 / 0.4) + 0.05 * math.log(0.05 / 0.1) + 0.25 * math.log(0.25 / 0.5)
    assert missing.tolist() == [1] and kl[0] == pytest.approx(want, rel=1e-9)
    # the method's K'-th probability 0.02 caps q1 below that minimum: q1 = 0.02, the rest 0.58
    kl, _ = agreement.kl_topk_lower_bound(ref_lp, ref_idx, np.log([[0.4, 0.02]]), m_idx, ref_k=2)
    want = 0.7 * math.log(0.7 / 0.4) + 0.05 * math.log(0.05 / 0.02) + 0.25 * math.log(0.25 / 0.58)
    assert kl[0] == pytest.approx(want, rel=1e-9)
    # what the method lists of other tokens stays in the rest: 0.55 of token 3 leave q1 <= 0.05
    kl, _ = agreement.kl_topk_lower_bound(ref_lp, ref_idx, np.log([[0.4, 0.55]]), m_idx, ref_k=2)
    want = 0.7 * math.log(0.7 / 0.4) + 0.05 * math.log(0.05 / 0.05) + 0.25 * math.log(0.25 / 0.55)
    assert kl[0] == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="cannot bound"):
        agreement.kl_topk_lower_bound(ref_lp, ref_idx, np.log([[0.4]]), m_idx[:, :1], ref_k=2)


def test_top1_counts_tied_tops_as_agreeing_whatever_their_order():
    ref_lp = np.array([[-0.5, -0.5, -3.0], [-0.2, -2.0, -3.0], [-0.2, -2.0, -3.0]])
    ref_idx = np.array([[7, 3, 1], [7, 3, 1], [7, 3, 1]])
    m_lp = np.array([[-0.4, -1.0, -3.0], [-0.6, -0.6, -3.0], [-0.3, -1.0, -3.0]])
    m_idx = np.array([[3, 7, 1], [3, 7, 1], [3, 7, 1]])
    # row 0: bf16 ties 7 and 3, the method picks 3; row 1: the method ties 3 and 7; row 2: 7 vs 3
    assert agreement.top1_agree(ref_lp, ref_idx, m_lp, m_idx).tolist() == [True, True, False]


def test_full_kl_and_the_simulators_comparison_of_logits():
    from calibration.fidelity.runner import compare_logits

    ref, m = _pair(6, 0.5, seed=1)
    got = agreement.kl_full(torch.from_numpy(ref), torch.from_numpy(m)).numpy()
    np.testing.assert_allclose(got, _full_kl(ref, m), rtol=1e-5, atol=1e-6)  # float32 inside
    logits = torch.from_numpy(ref * 3.0).float().view(2, 3, V)
    same = compare_logits(logits, logits.clone(), topk=(5, 10))
    assert (same["top1"] == 1).all() and np.abs(same["kl"]).max() < 1e-6 and np.abs(same["kl_topk"]).max() < 1e-6
    other = compare_logits(logits, torch.from_numpy(m).float().view(2, 3, V), topk=(5, 10))
    assert other["kl"].shape == (2, 3) and (other["kl_topk"] <= other["kl"] + 1e-5).all()


def test_tally_counts_positions_past_the_first_chunk_per_window_and_by_bucket():
    t = agreement.AgreementTally(start=4, buckets=[(0, 4), (4, 8)])
    t.add(0, np.arange(0, 4), {"kl": np.zeros(4), "top1": np.ones(4)})  # the first chunk: not counted overall
    t.add(0, np.arange(4, 8), {"kl": np.array([1.0, 1, 1, 1]), "top1": np.array([1.0, 0, 1, 0])})
    t.add(1, np.arange(0, 8), {"kl": np.r_[np.zeros(4), np.full(4, 3.0)], "top1": np.ones(8)})
    r = t.result()
    assert (r["from_position"], r["positions"]) == (4, 8)
    assert r["kl"] == 2.0 and r["top1"] == 0.75
    assert r["by_window"] == {"kl": [1.0, 3.0], "top1": [0.5, 1.0]}
    assert r["by_position"] == {"0-4": {"kl": 0.0, "top1": 1.0}, "4-8": {"kl": 2.0, "top1": 0.75}}


# ---------------------------------------------------------------- through a stand-in server
def _distribution(ids: list[int], j: int, shift: float) -> np.ndarray:
    """The stand-in model's log-probs [V] that predict token j of ``ids`` (a method: ``shift``)."""
    rng = np.random.default_rng(1000 * j + sum(ids[:j]) % 997)
    return _log_softmax(rng.normal(size=V) * 2.0 + shift * np.cos(np.arange(V) * (j + 1)))


class _Generate(BaseHTTPRequestHandler):
    """/generate as SGLang 0.5.17 answers it with return_logprob, logprob_start_len=0 and
    top_logprobs_num (flat base64 arrays when asked for them, else nested lists)."""

    shift = 0.0
    requests: list = []

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(req)
        ids, k = req["input_ids"], req.get("top_logprobs_num", 0)
        dists = [None] + [_distribution(ids, j, self.shift) for j in range(1, len(ids))]
        meta = {"input_token_logprobs": [[None, ids[0], None]] + [[float(d[t % V]), t, None]  # ids beyond V: any
                                                                 for d, t in zip(dists[1:], ids[1:])]}
        if k:
            tops = [None] + [_topk(d[None], k) for d in dists[1:]]
            if req.get("return_flat_raw_top_logprobs"):
                lp = np.concatenate([t[0] for t in tops[1:]]).astype("<f4")
                idx = np.concatenate([t[1] for t in tops[1:]]).astype("<i4")
                meta.update(input_top_logprobs_shape=[len(ids) - 1, k], input_top_logprobs_null_prefix=1,
                            input_top_logprobs_val_flat_b64=base64.b64encode(lp.tobytes()).decode(),
                            input_top_logprobs_idx_flat_b64=base64.b64encode(idx.tobytes()).decode())
            else:
                meta["input_top_logprobs"] = [None] + [[[float(a), int(b), None] for a, b in zip(t[0][0], t[1][0])]
                                                       for t in tops[1:]]
        body = json.dumps({"text": "", "meta_info": meta}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def stand_in():
    """A started stand-in server per method shift: yields make(shift) -> server_harness.Server."""
    from benchmarks.server_harness import Server

    started = []

    def make(shift: float):
        handler = type("Handler", (_Generate,), {"shift": shift, "requests": []})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        server = Server(f"stand-in-{shift}", [], "/tmp", port=httpd.server_port)
        server.handler = handler
        return server

    yield make
    for httpd in started:
        httpd.shutdown()


def test_window_top_logprobs_are_parsed_flat_and_nested(stand_in):
    from benchmarks import server_fidelity

    server = stand_in(0.0)
    ids = [5, 9, 2, 7, 7, 1]
    got = server_fidelity.window_logprobs(server, ids, topk=8)
    want = [_topk(_distribution(ids, j, 0.0)[None], 8) for j in range(1, len(ids))]
    np.testing.assert_allclose(got["top_lp"], np.concatenate([w[0] for w in want]), rtol=1e-6)
    assert (got["top_idx"] == np.concatenate([w[1] for w in want])).all() and got["top_idx"].dtype == np.int32
    assert got["nll"] == pytest.approx([-_distribution(ids, j, 0.0)[ids[j]] for j in range(1, len(ids))])
    req = server.handler.requests[-1]
    assert req["top_logprobs_num"] == 8 and req["return_flat_raw_top_logprobs_b64"] and req["logprob_start_len"] == 0
    meta = server.post("/generate", {"input_ids": ids, "top_logprobs_num": 8})["meta_info"]  # nested lists
    lp, idx = server_fidelity.parse_top_logprobs("s", meta, len(ids), 8)
    assert (idx == got["top_idx"]).all() and np.allclose(lp, got["top_lp"])
    with pytest.raises(RuntimeError, match="8 entries for each of the 6 predicted"):
        server_fidelity.parse_top_logprobs("s", meta, len(ids) + 1, 8)
    assert "top_lp" not in server_fidelity.window_logprobs(server, ids) and "top_logprobs_num" not in \
        server.handler.requests[-1]


def test_agreement_through_the_server_from_the_methods_files(stand_in, tmp_path):
    """bf16 and a method served side by side (two invocations), their top-K files compared by
    --merge: top-1 and the KL bound per window past the first chunk, as the arrays give them."""
    from benchmarks import server_agreement, server_fidelity

    stream = np.random.default_rng(3).integers(0, V, size=400)
    length, chunk, windows, ref_k, k = 24, 8, 3, 4, 10
    per = {}
    for name, shift in (("bf16", 0.0), ("oscar", 0.8), ("same", 0.0)):
        p = server_fidelity.perplexity(stand_in(shift), stream, length, windows, workers=2, topk=k)
        assert p["top_lp"].shape == (windows, length, k) and len(p["nll_by_window"]) == windows
        per[name] = p
        path = server_agreement.save_topk(str(tmp_path / "topk" / f"{name}.npz"), {length: p})
        st = {"chunked_prefill_size": chunk, "topk": k, "topk_ref": ref_k}
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"model": "m", "settings": st, "methods": {name: {"ppl_24": p["ppl"], "topk_file": path}}}))
    merged = server_fidelity.merge_outputs([str(tmp_path / f"{n}.json") for n in ("bf16", "oscar", "same")],
                                           str(tmp_path / "all.json"))
    assert "agreement" not in merged["methods"]["bf16"]
    same = merged["methods"]["same"]["agreement"]["24"]
    assert same["top1"] == 1.0 and abs(same["kl_topk"]) < 1e-6 and same["positions"] == windows * (length - chunk)
    ag = merged["methods"]["oscar"]["agreement"]["24"]
    want_top1, want_kl = [], []
    for w in range(windows):
        r = agreement.topk_agreement(per["bf16"]["top_lp"][w, chunk:], per["bf16"]["top_idx"][w, chunk:],
                                     per["oscar"]["top_lp"][w, chunk:], per["oscar"]["top_idx"][w, chunk:], ref_k)
        want_top1.append(r["top1"].mean())
        want_kl.append(r["kl_topk"].mean())
    assert ag["by_window"]["top1"] == pytest.approx(want_top1, abs=1e-6)
    assert ag["by_window"]["kl_topk"] == pytest.approx(want_kl, abs=1e-6)
    assert 0 < ag["top1"] < 1 and ag["kl_topk"] > 0.01
    assert json.loads((tmp_path / "all.json").read_text())["methods"]["oscar"]["agreement"]["24"] == ag
    # another invocation's windows are not comparable
    moved = server_fidelity.perplexity(stand_in(0.8), stream[5:], length, windows, workers=2, topk=k)
    bad = server_agreement.save_topk(str(tmp_path / "topk" / "moved.npz"), {length: moved})
    with pytest.raises(ValueError, match="not those of"):
        server_agreement.compare(merged["methods"]["bf16"]["topk_file"], bad, chunk, ref_k)


def test_fp8_and_oscar_server_arguments():
    from benchmarks import server_fidelity

    args = server_fidelity.build_parser().parse_args(
        ["--model", "M", "--fp8", "--server-args", "--mem-fraction-static 0.2 --max-total-tokens 90000",
         "--ppl-len", "2048,4096,8192"])
    assert args.ppl_len == [2048, 4096, 8192] and args.fp8
    fp8 = server_fidelity.server_args(args, "fp8_e4m3", None)
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and fp8[fp8.index("--attention-backend") + 1] == "triton"
    assert fp8[fp8.index("--max-total-tokens") + 1] == "90000" and fp8[fp8.index("--chunked-prefill-size") + 1] == "1024"
    bf16 = server_fidelity.server_args(args, "bf16", None)
    assert "--kv-cache-dtype" not in bf16 and "--attention-backend" in bf16
    osc = server_fidelity.server_args(args, "oscar", "/r.safetensors")
    assert osc[osc.index("--kv-cache-dtype") + 1] == "oscar_int2" and "--attention-backend" not in osc


@pytest.mark.parametrize("prog,module", [("oscar-eval", "calibration.fidelity.cli"),
                                         ("server_fidelity", "benchmarks.server_fidelity")])
@pytest.mark.parametrize("flag,value,why", [
    ("--lengths", "-1", "lengths must be >= 73"), ("--lengths", "0", "lengths must be >= 73"),
    ("--lengths", "2048,72", "a passkey prompt of length 72 cannot hold"),
    ("--ppl-len", "1", "perplexity windows must be >= 2 tokens"), ("--ppl-len", "2048,x", "comma-separated integers"),
    ("--ppl-windows", "-1", "must be an integer >= 0"), ("--chunk", "0", "must be an integer >= 1"),
    ("--passkey-trials", "-3", "must be an integer >= 0")])
def test_bad_numbers_are_refused_in_one_line(prog, module, flag, value, why, capsys):
    import importlib

    cli = importlib.import_module(module)
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "/nowhere", f"{flag}={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith(f"{prog}: error: argument {flag}: ") and why in err[-1], err
    assert "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("value", ["0,0.5", "0.5,1", "-0.1", "x"])
def test_oscar_eval_refuses_depths_outside_0_1(value, capsys):
    from calibration.fidelity import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "/nowhere", f"--depths={value}"])
    assert e.value.code == 2 and "argument --depths" in capsys.readouterr().err.strip().splitlines()[-1]


def test_passkey_min_length_is_the_shortest_prompt_that_builds():
    """At the bound every tokenizer that spends at most a token per byte (plus a word-start
    marker) builds a prompt of L - 16 tokens; one token shorter than the needle and query need, a
    prompt is refused with a line, not built wrong."""
    from calibration.fidelity import tasks

    class Bytes:  # one token per byte: the bound's worst case
        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

        def decode(self, ids, skip_special_tokens=True):
            return bytes(i for i in ids if i < 256).decode(errors="replace")

        def convert_tokens_to_ids(self, token):
            return 300

        def __len__(self):
            return 301

    stream = np.array([10, 65, 66, 10, 67] * 40)
    pk = tasks.Passkey(Bytes(), stream)
    low = tasks.passkey_min_length()
    (p,) = tasks.passkey_prompts(pk, [low], depths=[0.5], trials=1)
    assert len(p.ids) == low - tasks.PASSKEY_PROMPT_MARGIN
    with pytest.raises(ValueError, match="cannot hold"):
        pk.eval_prompt(np.random.default_rng(0), 54, 0.5)  # 1 + 26 + 27 bytes leave no filler


def test_server_windows_must_fit_the_models_context(tmp_path, capsys):
    """A window of L + 1 input ids and one generated token must fit the context SGLang allows."""
    from benchmarks import server_fidelity

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert server_fidelity.model_context(str(tmp_path), "--mem-fraction-static 0.2") == 8192
    assert server_fidelity.model_context(str(tmp_path), "--context-length 9000") == 9000
    with pytest.raises(SystemExit) as e:
        server_fidelity.main(["--model", str(tmp_path), "--ppl-len", "2048,8192"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "server_fidelity: error: --ppl-len 8192 needs 8194 tokens per request (the window's 8193 input ids and one "
        "generated token), more than the model's context of 8192: use at most 8190")
    with pytest.raises(SystemExit) as e:  # 8190 fits; the folder has no tokenizer: one line too
        server_fidelity.main(["--model", str(tmp_path), "--ppl-len", "2048,8190"])
    assert e.value.code == 2 and "no tokenizer" in capsys.readouterr().err.strip().splitlines()[-1]


class _StandInServer:
    """server_harness.Server's interface over a stand-in /generate and /v1/completions in this
    process: a method's distributions shift with its --kv-cache-dtype (bf16 none, fp8 a little,
    oscar_int2 more), so a whole server_fidelity run can be checked without a GPU."""

    SHIFT = {None: 0.0, "fp8_e4m3": 0.02, "oscar_int2": 0.8}
    started: list = []

    def __init__(self, name, args, log_dir, **_):
        dtype = args[args.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in args else None
        shift = self.SHIFT[dtype]

        class Handler(_Generate):
            def do_POST(self):
                if self.path == "/v1/completions":
                    body = json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                       "choices": [{"index": 0, "text": "abcdef" if shift < 0.5 else "zzz",
                                                    "finish_reason": "length"}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                super().do_POST()

        Handler.shift = shift
        self.name, self.cmd, self.log_path = name, ["python", *args], f"{log_dir}/{name}.log"
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        type(self).started.append(name)

    def start(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return 0.0

    def stop(self):
        self.httpd.shutdown()

    def post(self, path, payload):
        import urllib.request

        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())


def test_server_fidelity_runs_end_to_end_and_merges_side_by_side_runs(tinylm_dir, tmp_path, monkeypatch):
    """bf16 + fp8 in one invocation, oscar in another, merged: every length's perplexity, the
    agreement of fp8 and oscar with bf16, passkey; stand-in servers instead of SGLang."""
    from benchmarks import server_fidelity

    monkeypatch.setattr(server_fidelity, "Server", _StandInServer)
    monkeypatch.setattr(_Generate, "requests", [])
    rot = tmp_path / "oscar.safetensors"
    rot.write_bytes(b"not read by the stand-in")
    common = ["--model", str(tinylm_dir), "--ppl-len", "96,128", "--ppl-windows", "3", "--chunk", "32",
              "--lengths", "256", "--passkey-trials", "2", "--topk", "12", "--topk-ref", "5", "--workers", "2",
              "--topk-dir", str(tmp_path / "topk"), "--log-dir", str(tmp_path / "logs")]
    assert server_fidelity.main([*common, "--fp8", "--out", str(tmp_path / "a.json")]) == 0
    assert server_fidelity.main([*common, "--no-bf16", "--method", f"oscar={rot}", "--out", str(tmp_path / "b.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    assert list(a["methods"]) == ["bf16", "fp8_e4m3"] and "agreement" in a["methods"]["fp8_e4m3"]
    assert a["settings"]["ppl_len"] == [96, 128] and "LOWER BOUND" in a["settings"]["agreement"]
    merged = server_fidelity.merge_outputs([str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                                           str(tmp_path / "all.json"))
    bf16, fp8, oscar = (merged["methods"][n] for n in ("bf16", "fp8_e4m3", "oscar"))
    for m in (bf16, fp8, oscar):
        assert set(m["ppl_details"]) == {"96", "128"} and m["ppl_96"] == m["ppl_details"]["96"]["ppl"]
        assert len(m["ppl_details"]["128"]["nll_by_window"]) == 3 and m["nll_by_window"] == m["ppl_details"]["96"]["nll_by_window"]
        assert len(m["passkey_hits"]["256"]) == 6
    assert bf16["passkey"]["256"] == 0.0 and oscar["passkey"]["256"] == 0.0  # "abcdef" is no hex value
    assert oscar["ppl_128"] != bf16["ppl_128"] and fp8["agreement"]["128"]["positions"] == 3 * (128 - 32)
    assert fp8["agreement"]["128"]["top1"] > oscar["agreement"]["128"]["top1"]
    assert 0 < fp8["agreement"]["128"]["kl_topk"] < oscar["agreement"]["128"]["kl_topk"]
    assert "--kv-cache-dtype" not in bf16["server_cmd"] and "fp8_e4m3" in fp8["server_cmd"]
