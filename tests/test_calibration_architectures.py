"""oscar-calibrate on the architecture table (calibration/architectures.py): random-weight
models with the real attention geometry of Llama-3, Llama-3.2, Mistral, Qwen2.5, Qwen3,
Qwen3-MoE, Phi-3 (head_dim 96), GLM-4 and Gemma (head_dim 256), built from a config on CPU."""
import ast
import importlib.util
import json
import math
import os

import pytest
import torch

from calibration import architectures as archs
from calibration import text_sources
from calibration.calibrate import load_model, min_calibration_tokens, model_shape
from calibration.capture import attention_modules, capture_attention
from calibration.cli import main
from calibration.compose import VARIANTS, compose, sorted_eigh
from calibration.proxy import run_proxy
from calibration.transforms import (bit_reversal_permutation, block_hadamard_matrix, dealing_permutation,
                                    hadamard_any, hadamard_matrix, paley_hadamard)
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import (RotationsFileError, check_matches_model, load_rotations,
                                                   orthogonality_error)

ROWS = archs.ARCHITECTURES
IDS = [a.name for a in ROWS]


# ---------------------------------------------------------------- the table

def test_table_builds_the_geometry_it_states():
    assert len(set(IDS)) == len(IDS)
    for a in ROWS:
        cfg = archs.hf_config(a, archs.TOKENIZER_VOCAB)
        shape = ModelShape.from_hf_config(cfg)
        g = a.geometry
        assert (shape.architecture, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.num_layers) == (
            a.architecture, g["num_q_heads"], g["num_kv_heads"], g["head_dim"], g["num_layers"]), a.name
        assert 2 <= shape.num_layers <= 4
        assert not getattr(cfg, "sliding_window", None), f"{a.name}: a sliding window would make a hybrid"
    assert {a.head_dim for a in ROWS} == {64, 96, 128, 256}


def _sglang_entry_classes() -> set[str] | None:
    """EntryClass names of the installed SGLang's models, read with ast (sglang is not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = os.path.join(spec.submodule_search_locations[0], "srt", "models")
    names = set()
    for f in os.listdir(folder):
        if not f.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, f), encoding="utf-8-sig").read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
                vals = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                names |= {v.id for v in vals if isinstance(v, ast.Name)}
    return names


def test_every_architecture_is_an_sglang_entry_class():
    served = _sglang_entry_classes()
    if served is None:
        pytest.skip("sglang is not installed")
    assert [a.architecture for a in archs.ALL_ARCHITECTURES if a.architecture not in served] == []


# ---------------------------------------------------------------- rows with a layer pattern (hybrid, sliding)

PATTERN_ROWS = archs.LAYER_PATTERN_ARCHITECTURES
PATTERN_IDS = [a.name for a in PATTERN_ROWS]


@pytest.mark.parametrize("arch", PATTERN_ROWS, ids=PATTERN_IDS)
def test_pattern_row_has_the_full_attention_layers_it_states(arch):
    cfg = archs.hf_config(arch, archs.TOKENIZER_VOCAB)
    shape = ModelShape.from_hf_config(cfg)
    g = arch.geometry
    assert (shape.architecture, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.num_layers) == (
        arch.architecture, g["num_q_heads"], g["num_kv_heads"], g["head_dim"], g["num_layers"])
    assert shape.attention_layers == arch.full_attention_layers
    assert 0 < len(shape.attention_layers) < shape.num_layers  # both kinds, in the model's own order
    assert archs.get(arch.name) is arch


def test_pattern_rows_are_the_ones_stated():
    got = {a.name: (a.architecture, a.full_attention_layers) for a in PATTERN_ROWS}
    assert got == {"qwen3-next-80b-a3b": ("Qwen3NextForCausalLM", (3, 7)),
                   "gpt-oss-20b": ("GptOssForCausalLM", (1, 3)), "gemma-3-1b": ("Gemma3ForCausalLM", (5,))}
    assert all(a.full_attention_layers is None for a in ROWS)


@pytest.mark.parametrize("arch", PATTERN_ROWS, ids=PATTERN_IDS)
def test_capture_reports_the_full_attention_layers_only(arch):
    model = archs.build_model(arch, archs.TOKENIZER_VOCAB, seed=1)
    ids = torch.randint(0, archs.TOKENIZER_VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    seen = {}
    with torch.no_grad(), capture_attention(model, lambda l, q, k, v, o: seen.__setitem__(l, (q, k, v, o)),
                                            layers=arch.full_attention_layers):
        model(input_ids=ids, use_cache=False)
    assert tuple(sorted(seen)) == arch.full_attention_layers
    g = arch.geometry
    for q, k, v, o in seen.values():
        assert k.shape == v.shape == (1, g["num_kv_heads"], 24, g["head_dim"]) and o.shape == q.shape


def test_gpt_oss_capture_includes_the_learned_sinks():
    """gpt-oss has no SDPA path: capture runs its own eager attention, whose softmax has one more
    term per head (the sink logit); the captured o is that attention's output."""
    arch = archs.get("gpt-oss-20b")
    model = archs.build_model(arch, archs.TOKENIZER_VOCAB, seed=1)
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(0, archs.TOKENIZER_VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    seen = {}
    with torch.no_grad(), capture_attention(model, lambda l, q, k, v, o: seen.__setitem__(l, (q, k, v, o)),
                                            layers=(3,)):
        model(input_ids=ids, use_cache=False)
    q, k, v, o = seen[3]
    mod = attention_modules(model)[3]
    rep, t = arch.geometry["q_per_kv"], 24
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    logits = ((q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * mod.scaling).masked_fill(~causal, -math.inf)
    sinks = mod.sinks.detach().reshape(1, -1, 1, 1).expand(1, -1, t, 1)
    att = torch.softmax(torch.cat([logits, sinks], -1).double(), -1)[..., :-1].float()
    torch.testing.assert_close(att @ v.repeat_interleave(rep, 1), o, rtol=1e-4, atol=1e-5)
    plain = torch.softmax(logits.double(), -1).float() @ v.repeat_interleave(rep, 1)
    assert not torch.allclose(plain, o, rtol=1e-3, atol=1e-4)  # the sinks take mass


def test_no_attention_module_for_a_stated_layer_is_one_line():
    from calibration.capture import full_attention_modules

    model = archs.build_model(archs.get("qwen3-next-80b-a3b"), archs.TOKENIZER_VOCAB)
    assert [m.layer_idx for m in full_attention_modules(model, (3, 7))] == [3, 7]
    with pytest.raises(ValueError, match=r"^Qwen3NextForCausalLM: no attention module with layer_idx/o_proj "
                                         r"found for the full-attention layer\(s\) 0 named by its config "
                                         r"\(attention modules found at layers 3, 7\)$"):
        full_attention_modules(model, (0, 3))


def test_calibrate_on_a_config_without_full_attention_layers_is_one_line(tmp_path, capsys):
    arch = archs.get("gpt-oss-20b")
    model_dir = str(tmp_path / "all-sliding")
    os.makedirs(model_dir)
    cfg = archs.hf_config(arch, archs.TOKENIZER_VOCAB)
    cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    cfg.save_pretrained(model_dir)
    assert main(["--model", model_dir, "--out", str(tmp_path / "x.safetensors"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"oscar-calibrate: error: {model_dir}: its config names no full-attention layer among its 4 "
                   f"layers (layer_types), so there is nothing for the INT2 cache to hold"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", PATTERN_ROWS, ids=PATTERN_IDS)
def test_calibrate_writes_exactly_the_full_attention_layers(tmp_path, arch, capsys):
    from safetensors import safe_open

    model_dir = archs.build_model_dir(arch, str(tmp_path / arch.name), seed=0)
    out = str(tmp_path / "r.safetensors")
    assert main(["--model", model_dir, "--out", out, "--tokens", str(min_calibration_tokens(arch.head_dim)),
                 "--seq-len", "256", "--device", "cpu", "--quiet"]) == 0
    assert "error" not in capsys.readouterr().err
    with safe_open(out, framework="pt") as f:
        layers, suffixes = json.loads(f.metadata()["layers"]), {int(k.split(".")[1]) for k in f.keys()}
    assert tuple(layers) == tuple(sorted(suffixes)) == arch.full_attention_layers
    shape = model_shape(model_dir)
    rot = load_rotations(out, expect=shape)
    assert rot.meta.calib_tokens == min_calibration_tokens(arch.head_dim)
    for lr in rot.layers:
        assert orthogonality_error(lr.k_rot) < 1e-5
        assert not torch.allclose(lr.k_rot, torch.eye(arch.head_dim).expand_as(lr.k_rot))
    every = ModelShape(shape.architecture, shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
    with pytest.raises(RotationsFileError, match="but the model's full-attention layers are 0,1,2"):
        check_matches_model(rot.meta, every, out)


# ---------------------------------------------------------------- capture on each architecture

@pytest.mark.parametrize("arch", ROWS, ids=IDS)
def test_capture_is_what_the_model_caches_and_attends_with(arch):
    """Captured k/v are the KV cache's contents; q, k, v reproduce the captured per-head output
    o with query head h reading KV head h // (Hq / Hkv); o through o_proj is the module's output."""
    from transformers import DynamicCache

    model = archs.build_model(arch, archs.TOKENIZER_VOCAB, seed=1)
    g = arch.geometry
    ids = torch.randint(0, archs.TOKENIZER_VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    seen, out = {}, {}
    mods = attention_modules(model)
    assert len(mods) == g["num_layers"]
    hooks = [m.register_forward_hook(lambda mod, a, o: out.__setitem__(mod.layer_idx, o[0])) for m in mods]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad(), capture_attention(model, lambda l, q, k, v, o: seen.__setitem__(l, (q, k, v, o))):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    rep, t, d = g["q_per_kv"], ids.shape[1], g["head_dim"]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for layer, mod in enumerate(mods):
        q, k, v, o = seen[layer]
        assert q.shape == o.shape == (1, g["num_q_heads"], t, d) and k.shape == v.shape == (1, g["num_kv_heads"], t, d)
        assert torch.equal(k, cache.layers[layer].keys) and torch.equal(v, cache.layers[layer].values)
        logits = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * mod.scaling
        att = torch.softmax(logits.masked_fill(~causal, -math.inf).double(), -1).float()
        torch.testing.assert_close(att @ v.repeat_interleave(rep, 1), o, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mod.o_proj(o.transpose(1, 2).reshape(1, t, -1)), out[layer], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- oscar-calibrate on each architecture

def _held_out(tok, n: int = 2, seq: int = 256):
    files = text_sources.shuffled(text_sources.stdlib_test_files(), 0)
    return list(text_sources.token_stream(tok, text_sources.read_texts(files), seq, n * seq))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ROWS, ids=IDS)
def test_calibrate_writes_a_file_that_loads_for_that_model(tmp_path, arch, capsys):
    model_dir = archs.build_model_dir(arch, str(tmp_path / arch.name), seed=0)
    shape = model_shape(model_dir)
    d = arch.head_dim
    files = {}
    for recipe in ("oscar", "naive"):
        files[recipe] = str(tmp_path / f"{recipe}.safetensors")
        # the minimum budget: 8 x head_dim tokens, in whole windows of 256
        assert main(["--model", model_dir, "--out", files[recipe], "--recipe", recipe, "--tokens",
                     str(min_calibration_tokens(d)), "--seq-len", "256", "--device", "cpu", "--quiet"]) == 0
    assert "error" not in capsys.readouterr().err
    rots = {r: load_rotations(f, expect=shape) for r, f in files.items()}
    m = rots["oscar"].meta
    layout = KVLayout.resolve(d)
    assert (m.num_q_heads, m.num_kv_heads, m.head_dim) == (arch.geometry["num_q_heads"], arch.geometry["num_kv_heads"], d)
    assert (m.group_size, m.value_group_size, m.calib_tokens) == (layout.key_group_size, layout.value_group_size,
                                                                  min_calibration_tokens(d))
    for lr in rots["oscar"].layers:
        assert orthogonality_error(lr.k_rot) < 1e-5 and orthogonality_error(lr.v_rot) < 1e-5
        assert not torch.allclose(lr.k_rot, torch.eye(d).expand_as(lr.k_rot))
    other = ModelShape(shape.architecture, shape.num_layers, shape.num_q_heads, shape.num_kv_heads * 2, d)
    with pytest.raises(RotationsFileError, match="num_kv_heads"):
        check_matches_model(m, other, files["oscar"])
    # the rotations act on this model's own K/V: INT2 output error below R = I on held-out text
    model, tok = load_model(model_dir, "cpu", "float32")
    res = run_proxy(model, _held_out(tok), rots, progress=False)
    oscar, naive = res["oscar"]["mean"], res["naive"]["mean"]
    assert oscar["out_rel"] < naive["out_rel"], res


def test_too_small_budget_is_one_line_for_head_dim_96(tmp_path, capsys):
    arch = archs.get("phi-3-mini-4k")
    model_dir = str(tmp_path / "cfg-only")
    os.makedirs(model_dir)
    archs.hf_config(arch, archs.TOKENIZER_VOCAB).save_pretrained(model_dir)  # the check runs before loading
    assert main(["--model", model_dir, "--out", str(tmp_path / "x.safetensors"), "--tokens", "700",
                 "--seq-len", "100", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["oscar-calibrate: error: --tokens 700 is too few: the head_dim 96 statistics need at least "
                   "768 tokens (8 x head_dim)"]


# ---------------------------------------------------------------- head_dim 96: Hadamard, permutation, layout

@pytest.mark.parametrize("n", [12, 20, 24, 48, 96])
def test_hadamard_any_is_a_hadamard_matrix(n):
    h = hadamard_any(n)
    assert orthogonality_error(h) < 1e-12
    assert torch.allclose(h.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64), atol=1e-15)


def test_hadamard_any_is_sylvester_for_powers_of_two_and_paley_sylvester_else():
    for n in (1, 2, 64, 128):
        assert torch.equal(hadamard_any(n), hadamard_matrix(n))
    torch.testing.assert_close(hadamard_any(96), torch.kron(hadamard_matrix(8), paley_hadamard(11)))
    with pytest.raises(ValueError, match="^no Hadamard matrix of order 36 is built here"):
        hadamard_any(36)
    with pytest.raises(ValueError, match="prime q = 3 mod 4"):
        paley_hadamard(13)


def test_dealing_permutation_generalises_bit_reversal():
    for n in (1, 8, 64, 128):
        assert torch.equal(dealing_permutation(n), bit_reversal_permutation(n))
    p = dealing_permutation(96)
    assert sorted(p.tolist()) == list(range(96))
    # like the bit reversal: key group b of 24 (and half b of 48) holds ranks r = bitrev(b) mod 4 (mod 2)
    assert [sorted(set((p[24 * b:24 * b + 24] % 4).tolist())) for b in range(4)] == [[0], [2], [1], [3]]
    assert [sorted(set((p[48 * b:48 * b + 48] % 2).tolist())) for b in range(2)] == [[0], [1]]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("group", [24, 96, 32])
def test_every_variant_is_orthogonal_at_head_dim_96(variant, group):
    a = torch.randn(400, 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, u = sorted_eigh(a.T @ a)
    assert orthogonality_error(compose(u, variant, group)) < 1e-10
    assert orthogonality_error(block_hadamard_matrix(96, group)) < 1e-12


def test_layout_of_head_dim_96_is_whole_planes():
    assert KVLayout.resolve(96) == KVLayout(24, 96, "float8_e4m3fn")
    assert KVLayout.resolve(96).bytes_per_token_per_head(96) == 2 * 24 + (4 + 1) * 2
    for g in (24, 48, 96, 32, 8):
        KVLayout(g, g, "float16").check(96)
    with pytest.raises(ValueError, match=r"^group size 12 must be a power of two dividing head_dim 96, "
                                         r"or 24, 48 or 96 \(whole D/4 planes\)$"):
        KVLayout(12, 96, "float16").check(96)
    with pytest.raises(ValueError, match="^group size 24 must be a power of two dividing head_dim 128$"):
        KVLayout(24, 128, "float16").check(128)
