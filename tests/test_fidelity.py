"""oscar-eval: the simulated hybrid cache, the eval tasks and the CLI (CPU, tinylm-A)."""
from __future__ import annotations

import importlib.util
import json
from multiprocessing.dummy import Pool as ThreadPool

import numpy as np
import pytest
import torch

from calibration.fidelity import tasks
from calibration.fidelity.attention import forward_step, use_simulated_attention
from calibration.fidelity.baseline_rotations import baseline_rotations
from calibration.fidelity.sim_cache import Bf16KVSim, HybridKVSim
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import save_rotations

L, CHUNK = 128, 32


@pytest.fixture(scope="module")
def tiny():
    from conftest import TINYLM
    if not (TINYLM / "config.json").is_file():
        pytest.skip(f"tinylm-A not found at {TINYLM}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    plain = AutoModelForCausalLM.from_pretrained(TINYLM, dtype=torch.float32, attn_implementation="sdpa").eval()
    sim_model = AutoModelForCausalLM.from_pretrained(TINYLM, dtype=torch.float32).eval()
    use_simulated_attention(sim_model)
    tok = AutoTokenizer.from_pretrained(TINYLM)
    return plain, sim_model, tok, ModelShape.from_hf_config(plain.config)


@pytest.fixture(scope="module")
def stream(tiny):
    return tasks.load_heldout_stream(tiny[2], corpus_mb=0.3).tokens


def _chunked(model, sim, ids, chunk):
    sim.begin(ids.shape[0])
    return torch.cat([forward_step(model, sim, ids[:, s:s + chunk]) for s in range(0, ids.shape[1], chunk)], 1)


def _prefill_then_decode(model, sim, ids):
    """Logits of ids [B, L]: chunked prefill of all but the last 4 tokens, then 4 decode steps."""
    pre = _chunked(model, sim, ids[:, :L - 4], CHUNK)
    dec = torch.cat([forward_step(model, sim, ids[:, j:j + 1]) for j in range(L - 4, L)], 1)
    return torch.cat([pre, dec], 1)


def _gap_after_first_chunk(a, b):
    """Mean |a - b| over the logits of positions that read a history (after the first chunk)."""
    return (a[:, CHUNK:] - b[:, CHUNK:]).abs().mean().item()


def _hybrid(shape, recipe, sink, recent, max_len, batch=1):
    rot = baseline_rotations(shape, "tinylm-A", recipe, group_size=32)
    return HybridKVSim(rot.layers, 32, sink, recent, batch, max_len)


def test_identity_full_windows_reproduce_plain_model(tiny, stream):
    plain, sim_model, _, shape = tiny
    ids = torch.from_numpy(np.stack([stream[:L], stream[1000:1000 + L]]))
    with torch.no_grad():
        ref = plain(input_ids=ids, use_cache=False).logits
    hyb = _chunked(sim_model, _hybrid(shape, "naive", 4, L, L, batch=2), ids, CHUNK)
    bf = _chunked(sim_model, Bf16KVSim(shape.num_layers, shape.num_kv_heads, shape.head_dim, 2, L), ids, CHUNK)
    # identical up to the BF16 rounding of q/k/v/o that the server's cache implies
    assert (hyb - ref).abs().max() < 0.1
    assert (hyb - bf).abs().max() < 0.05
    assert (hyb.argmax(-1) == ref.argmax(-1)).float().mean() > 0.98


def test_identity_full_windows_decode_matches_bf16(tiny, stream):
    _, sim_model, _, shape = tiny
    ids = torch.from_numpy(stream[:L][None])
    hyb, bf = _hybrid(shape, "naive", 4, L, L), Bf16KVSim(shape.num_layers, shape.num_kv_heads,
                                                          shape.head_dim, 1, L)
    outs = []
    for sim in (hyb, bf):
        _chunked(sim_model, sim, ids[:, :L - 4], CHUNK)
        outs.append(torch.cat([forward_step(sim_model, sim, ids[:, j:j + 1]) for j in range(L - 4, L)], 1))
    assert (outs[0] - outs[1]).abs().max() < 0.05


def test_chunked_int2_reads_quantised_history(tiny, stream):
    plain, sim_model, _, shape = tiny
    ids = torch.from_numpy(stream[:L][None])
    with torch.no_grad():
        ref = plain(input_ids=ids, use_cache=False).logits
    # one chunk = the full-sequence forward: queries never read INT2, so it measures nothing
    whole = _chunked(sim_model, _hybrid(shape, "naive", 4, 16, L), ids, L)
    assert (whole - ref).abs().max() < 0.1
    # chunked prefill: the first chunk has no history, later chunks read INT2 history
    chunked = _chunked(sim_model, _hybrid(shape, "naive", 4, 16, L), ids, CHUNK)
    assert (chunked[:, :CHUNK] - ref[:, :CHUNK]).abs().max() < 0.1
    assert (chunked[:, CHUNK:] - ref[:, CHUNK:]).abs().max() > 0.5
    # decoding also reads it
    sim = _hybrid(shape, "naive", 4, 16, L)
    _chunked(sim_model, sim, ids[:, :L - 1], CHUNK)
    step = forward_step(sim_model, sim, ids[:, L - 1:])
    assert (step[:, 0] - ref[:, L - 1]).abs().max() > 0.5


def _load_tinylm_train(tinylm_dir):
    spec = importlib.util.spec_from_file_location("tinylm_train", tinylm_dir / "tinylm_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_passkey_prompts_match_tinylm(tinylm_dir, tiny, stream):
    from tokenizers import Tokenizer
    tt = _load_tinylm_train(tinylm_dir)
    raw = Tokenizer.from_file(str(tinylm_dir / "tokenizer.json"))
    eot = raw.token_to_id(tt.EOT)
    nl = tt.line_start_mask(raw, raw.get_vocab_size())
    assert (nl == tasks.line_start_mask(tiny[2])).all()
    theirs = tt.Passkey(raw, stream, nl, eot)
    ours = tasks.Passkey(tiny[2], stream)
    r1, r2 = np.random.default_rng(777), np.random.default_rng(777)
    for length in (512, 2048 - 16):
        for d in tasks.PASSKEY_DEPTHS:
            (a_ids, a_val), (b_ids, b_val) = theirs.eval_prompt(r1, length, d), ours.eval_prompt(r2, length, d)
            assert a_val == b_val and np.array_equal(a_ids, b_ids) and len(b_ids) == length
    p = tasks.passkey_prompts(ours, [512], trials=2)
    text = tasks.decode(tiny[2], p[0].ids, skip_special_tokens=False)
    assert text.startswith(tasks.EOT) and text.endswith(f'\nassert PASSKEY_{text.split("PASSKEY_")[1][:6]} == "')
    assert f'\nPASSKEY_{text.split("PASSKEY_")[1][:6]} = "{p[0].value}"' in text
    assert [(q.length, q.depth, q.trial) for q in p[:3]] == [(512, 0.1, 0), (512, 0.1, 1), (512, 0.5, 0)]
    assert tasks.passkey_hit('7f5355"\n', "7f5355") and not tasks.passkey_hit("7f535", "7f5355")


def test_heldout_files_match_tinylm_discovery(tinylm_dir):
    tt = _load_tinylm_train(tinylm_dir)
    roots = tasks.site_roots()
    with ThreadPool(2) as pool:
        _, held, _, _ = tt.discover_files(pool, roots, list(tasks.HELDOUT_PACKAGES), 1024 * 1024, False)
    held.sort()
    import random
    random.Random(12345).shuffle(held)
    assert tasks.heldout_files(roots=roots) == held


def test_heldout_roots_include_where_the_packages_import_from(tmp_path, monkeypatch):
    """A held-out package importable only through a .pth or PYTHONPATH folder is found there."""
    import importlib.util
    pkg = tmp_path / "extra" / "sympy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    spec = importlib.machinery.ModuleSpec("sympy", None, is_package=True)
    spec.submodule_search_locations.append(str(pkg))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "sympy" else real(name, *a))
    assert str((tmp_path / "extra").resolve()) in tasks.site_roots()


def test_oscar_eval_smoke(tinylm_dir, tmp_path):
    from calibration.fidelity import cli
    shape = ModelShape.from_hf_config(json.loads((tinylm_dir / "config.json").read_text()))
    rot_path = tmp_path / "hadamard.safetensors"
    save_rotations(str(rot_path), baseline_rotations(shape, "tinylm-A", "hadamard", 32))
    out = tmp_path / "fid.json"
    assert cli.main(["--model", str(tinylm_dir), "--method", f"hadamard={rot_path}", "--ppl-len", "256",
                     "--ppl-windows", "1", "--chunk", "128", "--passkey-trials", "1", "--lengths", "256",
                     "--corpus-mb", "0.3", "--sink", "4", "--recent", "64", "--out", str(out),
                     "--device", "cpu"]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"model", "settings", "methods"}
    s = res["settings"]
    assert (s["sink"], s["recent"], s["group_size"], s["chunk"]) == (4, 64, 32, 128)
    assert {"calib", "eval", "passkey_trials", "rotations"} <= set(s)
    assert s["rotations"]["hadamard"]["recipe_detail"]["rotation"] == "hadamard(head_dim)"
    assert set(res["methods"]) == {"bf16", "hadamard"}
    for m in res["methods"].values():
        assert 1.0 < m["ppl_256"] < 100.0
        assert set(m["passkey"]) == {"256"} and 0.0 <= m["passkey"]["256"] <= 1.0
        assert set(m["passkey_by_depth"]["256"]) == {"0.1", "0.5", "0.9"}
        assert set(m["passkey_first_token_logprob"]) == {"256"} and m["passkey_first_token_logprob"]["256"] <= 0.0
        # per prompt, in prompt order (one prompt per depth): the mean and the accuracy follow from them
        hits, lps = m["passkey_hits"]["256"], m["passkey_first_token_logprobs"]["256"]
        assert len(hits) == len(lps) == 3 and set(hits) <= {0, 1}
        assert sum(hits) / 3 == pytest.approx(m["passkey"]["256"])
        assert sum(lps) / 3 == pytest.approx(m["passkey_first_token_logprob"]["256"], abs=1e-3)


def test_oscar_eval_values_take_the_files_value_group_size(tinylm_dir, tmp_path, monkeypatch):
    """Without --value-groups the values use the file's value_group_size (fake runs and the
    kernels' pool); --value-groups still overrides it in fake runs; settings record both."""
    from calibration.fidelity import cli
    shape = ModelShape.from_hf_config(json.loads((tinylm_dir / "config.json").read_text()))
    rot_path = tmp_path / "kv.safetensors"
    save_rotations(str(rot_path), baseline_rotations(shape, "tinylm-A", "hadamard", 32, value_group_size=128,
                                                     scale_dtype="float8_e4m3fn"))
    built = []

    class FakeSpy(cli.FakeInt2KVSim):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    class Stop(Exception):
        pass

    class HybridSpy(cli.HybridKVSim):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)
            raise Stop  # the pool is built; no need to run the kernels here

    monkeypatch.setattr(cli, "FakeInt2KVSim", FakeSpy)
    monkeypatch.setattr(cli, "HybridKVSim", HybridSpy)
    out = tmp_path / "fid.json"
    common = ["--model", str(tinylm_dir), "--method", f"h={rot_path}", "--no-bf16", "--ppl-len", "256",
              "--ppl-windows", "1", "--chunk", "128", "--passkey-trials", "0", "--corpus-mb", "0.3",
              "--sink", "4", "--recent", "64", "--device", "cpu", "--out", str(out)]
    assert cli.main([*common, "--int2-parts", "v"]) == 0
    sim = built[-1]
    assert (sim.group_size, sim.value_group_size, sim.value_scale_dtype) == (32, 128, torch.float8_e4m3fn)
    s = json.loads(out.read_text())["settings"]
    assert (s["group_size"], s["value_group_size"]) == (32, 128)
    assert s["rotations"]["h"]["value_group_size"] == 128 and "value_groups" not in s
    assert cli.main([*common, "--int2-parts", "kv-fake", "--value-groups", "64:float16"]) == 0
    assert (built[-1].value_group_size, built[-1].value_scale_dtype) == (64, torch.float16)
    with pytest.raises(Stop):
        cli.main(common)
    lay = built[-1].cache.layers[0]
    assert built[-1].value_group_size == 128 and (lay.key_group_size, lay.value_group_size) == (32, 128)


def test_oscar_eval_value_groups_need_a_fake_value_run(tinylm_dir):
    from calibration.fidelity import cli
    with pytest.raises(SystemExit, match="int2-parts"):
        cli.main(["--model", str(tinylm_dir), "--int2-parts", "k", "--value-groups", "128:float16"])
    with pytest.raises(SystemExit):
        cli.main(["--model", str(tinylm_dir), "--int2-parts", "v", "--value-groups", "128:float13"])


def test_oscar_eval_rejects_bad_method(tinylm_dir):
    from calibration.fidelity import cli
    with pytest.raises(SystemExit):
        cli.main(["--model", str(tinylm_dir), "--method", "nofile"])


def test_decode_tail_scores_the_same_positions(tiny, stream):
    from calibration.fidelity import runner
    _, sim_model, _, shape = tiny
    sim = Bf16KVSim(shape.num_layers, shape.num_kv_heads, shape.head_dim, 1, L)
    full = runner.perplexity(sim_model, sim, stream, L, 1, CHUNK)
    tail = runner.perplexity(sim_model, sim, stream, L, 1, CHUNK, decode_tail=4)
    assert abs(full["nll"] - tail["nll"]) < 1e-3 and tail["decode_tail"] == 4
    int2 = runner.perplexity(sim_model, _hybrid(shape, "naive", 4, 16, L), stream, L, 1, CHUNK, decode_tail=4)
    assert int2["nll_decode"] != tail["nll_decode"]


def test_fake_int2_ablation_attributes_the_error(tiny, stream):
    """FakeInt2KVSim with K and V quantised tracks the kernels' HybridKVSim (same read rule,
    PyTorch numerics); quantising only K or only V moves the logits less than both."""
    from calibration.fidelity.sim_cache import FakeInt2KVSim
    _, sim_model, _, shape = tiny
    ids = torch.from_numpy(stream[:L][None])
    rot = baseline_rotations(shape, "tinylm-A", "hadamard", group_size=32)

    def run(sim):
        return _prefill_then_decode(sim_model, sim, ids)

    bf = run(Bf16KVSim(shape.num_layers, shape.num_kv_heads, shape.head_dim, 1, L))
    hyb = run(HybridKVSim(rot.layers, 32, 4, 16, 1, L))
    fake = {p: run(FakeInt2KVSim(rot.layers, 32, 4, 16, 1, L, parts=p)) for p in ("kv", "k", "v")}
    # the first chunk reads no history: every simulator agrees there
    for out in (hyb, *fake.values()):
        assert (out[:, :CHUNK] - bf[:, :CHUNK]).abs().max() < 0.05
    err = {p: (o[:, CHUNK:] - bf[:, CHUNK:]).abs().mean().item() for p, o in fake.items()}
    err_hyb = (hyb[:, CHUNK:] - bf[:, CHUNK:]).abs().mean().item()
    assert err["kv"] > 0.05 and abs(err["kv"] - err_hyb) < 0.25 * err_hyb
    assert (fake["kv"][:, CHUNK:] - hyb[:, CHUNK:]).abs().mean().item() < 0.5 * err_hyb
    assert 0 < err["k"] < err["kv"] and 0 < err["v"] < err["kv"]
    with pytest.raises(ValueError, match="parts"):
        FakeInt2KVSim(rot.layers, 32, 4, 16, 1, L, parts="q")
    # values with their own groups: coarser value groups move the output, bad ones are refused
    coarse_v = run(FakeInt2KVSim(rot.layers, 32, 4, 16, 1, L, parts="v", value_group_size=128,
                                 value_scale_dtype="float8_e4m3fn"))
    err_coarse = (coarse_v[:, CHUNK:] - bf[:, CHUNK:]).abs().mean().item()
    assert err_coarse > 0 and abs(err_coarse - err["v"]) > 0.01 * err["v"]
    with pytest.raises(ValueError, match="group size"):
        FakeInt2KVSim(rot.layers, 32, 4, 16, 1, L, value_group_size=48)


def test_fake_sim_key_debias_tracks_the_kernels(tiny, stream):
    """The fake simulator's key debias (C = 1) tracks the kernels' (HybridKVSim with
    key_debias) as closely as the plain reads track each other, and moves the logits."""
    from calibration.fidelity.sim_cache import FakeInt2KVSim
    _, sim_model, _, shape = tiny
    ids = torch.from_numpy(stream[:L][None])
    rot = baseline_rotations(shape, "tinylm-A", "hadamard", group_size=32)

    def run(sim):
        return _prefill_then_decode(sim_model, sim, ids)[:, CHUNK:]

    hyb, hyb_on = run(HybridKVSim(rot.layers, 32, 4, 16, 1, L)), run(HybridKVSim(rot.layers, 32, 4, 16, 1, L, key_debias=True))
    fake, fake_on = run(FakeInt2KVSim(rot.layers, 32, 4, 16, 1, L)), run(FakeInt2KVSim(rot.layers, 32, 4, 16, 1, L, key_debias=1.0))
    moved = (hyb_on - hyb).abs().mean().item()
    assert moved > 0.01
    to_on = (fake_on - hyb_on).abs().mean().item()
    assert to_on < 1.5 * (fake - hyb).abs().mean().item() and to_on < (fake_on - hyb).abs().mean().item()


def test_int2_parts_ablation_script(tinylm_dir, tmp_path):
    """benchmarks/fidelity_int2_parts.py: three oscar-eval runs on the same prompts, one JSON."""
    from benchmarks import fidelity_int2_parts
    shape = ModelShape.from_hf_config(json.loads((tinylm_dir / "config.json").read_text()))
    rot_path = tmp_path / "hadamard.safetensors"
    save_rotations(str(rot_path), baseline_rotations(shape, "tinylm-A", "hadamard", 32))
    out = tmp_path / "parts.json"
    assert fidelity_int2_parts.main(["--model", str(tinylm_dir), "--method", f"had={rot_path}", "--out", str(out),
                                     "--", "--ppl-len", "256", "--ppl-windows", "1", "--chunk", "64",
                                     "--passkey-trials", "0", "--corpus-mb", "0.3", "--sink", "4",
                                     "--recent", "16", "--device", "cpu"]) == 0
    res = json.loads(out.read_text())
    assert set(res["methods"]) == {"bf16", "had [INT2 kv-fake]", "had [INT2 k]", "had [INT2 v]"}
    assert res["settings"]["int2_parts"] == ["kv-fake", "k", "v"]
    assert [a[a.index("--int2-parts") + 1] for a in res["settings"]["argv"].values()] == ["kv-fake", "k", "v"]
    # each run read its own cache (one 256-token window: too short to order them by quality)
    ppl = [v["ppl_256"] for v in res["methods"].values()]
    assert all(1.0 < x < 100.0 for x in ppl) and len({round(x, 6) for x in ppl}) == 4


def test_hybrid_sim_with_value_groups_of_their_own_tracks_fake_quantisation(tiny, stream):
    """Keys G=32, values G=128, float8 scales through the kernels (HybridKVSim) track the same
    layout in PyTorch fake quantisation, and differ from values at the keys' group size."""
    from calibration.fidelity.sim_cache import FakeInt2KVSim
    _, sim_model, _, shape = tiny
    ids = torch.from_numpy(stream[:L][None])
    rot = baseline_rotations(shape, "tinylm-A", "hadamard", 32, value_group_size=128, scale_dtype="float8_e4m3fn")

    def run(sim):
        return _prefill_then_decode(sim_model, sim, ids)

    bf = run(Bf16KVSim(shape.num_layers, shape.num_kv_heads, shape.head_dim, 1, L))
    split = HybridKVSim(rot.layers, 32, 4, 16, 1, L, scale_dtype="float8_e4m3fn", value_group_size=128)
    assert (split.cache.layers[0].key_group_size, split.cache.layers[0].value_group_size) == (32, 128)
    hyb = run(split)
    fake = run(FakeInt2KVSim(rot.layers, 32, 4, 16, 1, L, scale_dtype="float8_e4m3fn", value_group_size=128))
    same = run(HybridKVSim(rot.layers, 32, 4, 16, 1, L, scale_dtype="float8_e4m3fn"))
    err = _gap_after_first_chunk(hyb, bf)
    assert err > 0.05 and _gap_after_first_chunk(hyb, fake) < 0.5 * err
    assert _gap_after_first_chunk(hyb, same) > 0.25 * err


def test_lockstep_keeps_bf16_and_compares_each_method_past_the_first_chunk(tiny, stream):
    """bf16 and two methods run chunk by chunk in lockstep: bf16's perplexity is the one it has
    alone, a copy of bf16 agrees everywhere, the INT2 cache disagrees past the first chunk only."""
    from calibration.fidelity import runner
    _, sim_model, _, shape = tiny
    bf16 = lambda: Bf16KVSim(shape.num_layers, shape.num_kv_heads, shape.head_dim, 1, L)
    alone = runner.perplexity(sim_model, bf16(), stream, L, 2, CHUNK)
    sims = {"bf16": bf16(), "copy": bf16(), "naive": _hybrid(shape, "naive", 4, 16, L)}
    got = runner.perplexity_lockstep(sim_model, sims, stream, L, 2, CHUNK, topk=(5, 16))
    assert {k: v for k, v in got["bf16"].items() if k != "seconds"} == {k: v for k, v in alone.items()
                                                                        if k != "seconds"}
    assert "agreement" not in got["bf16"]
    copy, naive = got["copy"]["agreement"], got["naive"]["agreement"]
    assert (copy["positions"], copy["from_position"]) == (2 * (L - CHUNK), CHUNK)
    assert copy["top1"] == 1.0 and abs(copy["kl"]) < 1e-6 and abs(copy["kl_topk"]) < 1e-6
    assert naive["kl"] > 0.01 and naive["top1"] < 1.0 and len(naive["by_window"]["kl"]) == 2
    assert 0 <= naive["kl_topk"] <= naive["kl"]
    inside = [b for k, b in naive["by_position"].items() if int(k.split("-")[1]) <= CHUNK]
    assert len(inside) == 2  # 0-16, 16-32: fresh BF16 K/V, the same up to the kernels' rounding
    assert all(b["kl"] < 0.01 * naive["kl"] and b["top1"] > 0.98 for b in inside)


def test_oscar_eval_reports_every_length_and_the_agreement(tinylm_dir, tmp_path, capsys):
    from calibration.fidelity import cli
    shape = ModelShape.from_hf_config(json.loads((tinylm_dir / "config.json").read_text()))
    rot_path = tmp_path / "naive.safetensors"
    save_rotations(str(rot_path), baseline_rotations(shape, "tinylm-A", "naive", 32))
    out = tmp_path / "fid.json"
    assert cli.main(["--model", str(tinylm_dir), "--method", f"naive={rot_path}", "--ppl-len", "128,256",
                     "--ppl-windows", "2", "--chunk", "64", "--passkey-trials", "0", "--corpus-mb", "0.3",
                     "--sink", "4", "--recent", "32", "--out", str(out), "--device", "cpu"]) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["ppl_len"] == [128, 256]
    bf16, naive = res["methods"]["bf16"], res["methods"]["naive"]
    for m in (bf16, naive):
        assert set(m["ppl_details"]) == {"128", "256"} and m["ppl_detail"] == m["ppl_details"]["128"]
        assert m["ppl_128"] == m["ppl_details"]["128"]["ppl"] and len(m["ppl_details"]["256"]["nll_by_window"]) == 2
    assert set(naive["agreement"]) == {"128", "256"} and "agreement" not in bf16
    assert naive["agreement"]["256"]["positions"] == 2 * (256 - 64)
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("oscar-eval: naive: "))
    printed = json.loads(line.split(": ", 2)[2].rsplit(" (", 1)[0])
    assert set(printed) == {"ppl_128", "ppl_256", "top1_128", "kl_128", "top1_256", "kl_256"}
