"""oscar-eval per layer (issue 46): a group size per layer through the kernels' reference path
(--layer-rotations) and BF16 layers to charge the INT2 loss to layers (--bf16-layers); CPU, tinylm-A."""
from __future__ import annotations

import json

import pytest
import torch

from calibration.fidelity.args import layer_list
from calibration.fidelity.baseline_rotations import baseline_rotations
from calibration.fidelity.sim_cache import Bf16KVSim, HybridKVSim, LayerSplitKVSim, per_layer_groups
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import save_rotations

from test_fidelity import L, _gap_after_first_chunk, _prefill_then_decode, stream, tiny  # noqa: F401 (fixtures)

FP8 = "float8_e4m3fn"


def _rot(shape, recipe, g, vg=128):
    return baseline_rotations(shape, "tinylm-A", recipe, g, value_group_size=vg, scale_dtype=FP8)


def test_layer_list_and_per_layer_groups():
    assert layer_list("5-7,0,3") == [0, 3, 5, 6, 7]
    for bad in ("", "1,1", "2-x", "a"):
        with pytest.raises(Exception):
            layer_list(bad)
    assert per_layer_groups(3, 32, 128) == [(32, 128)] * 3
    assert per_layer_groups(3, [8, 32, 32]) == [(8, 8), (32, 32), (32, 32)]
    with pytest.raises(ValueError, match="2 key group sizes for 3 layers"):
        per_layer_groups(3, [8, 32])


def test_layer_split_is_bf16_or_int2_at_its_ends_and_between_them_in_the_middle(tiny, stream):
    """No BF16 layer: the INT2 simulator's logits; every layer BF16: the BF16 cache's; one half BF16:
    strictly between, and the two halves' shares of the INT2 error are both real."""
    _, sim_model, _, shape = tiny
    ids = torch.from_numpy(stream[:L][None])
    rot = _rot(shape, "naive", 32)
    n = shape.num_layers
    bf16 = lambda: Bf16KVSim(n, shape.num_kv_heads, shape.head_dim, 1, L)
    hyb = lambda: HybridKVSim(rot.layers, 32, 4, 16, 1, L, scale_dtype=FP8, value_group_size=128)
    run = lambda sim: _prefill_then_decode(sim_model, sim, ids)
    ref, int2 = run(bf16()), run(hyb())
    assert torch.equal(run(LayerSplitKVSim(hyb(), bf16(), [])), int2)
    assert torch.equal(run(LayerSplitKVSim(hyb(), bf16(), range(n))), ref)
    full = _gap_after_first_chunk(int2, ref)
    low, high = (_gap_after_first_chunk(run(LayerSplitKVSim(hyb(), bf16(), half)), ref)
                 for half in (range(n // 2), range(n // 2, n)))
    assert full > 0.05 and 0.05 * full < low < full and 0.05 * full < high < full
    with pytest.raises(ValueError, match="outside"):
        LayerSplitKVSim(hyb(), bf16(), [n])


def test_head_split_is_bf16_or_int2_at_its_ends_and_between_them_in_the_middle(tiny, stream):
    """No BF16 KV head: the INT2 simulator's logits; every KV head BF16: the BF16 cache's; one head
    BF16: strictly between."""
    _, sim_model, _, shape = tiny
    ids = torch.from_numpy(stream[:L][None])
    rot = _rot(shape, "naive", 32)
    n, h = shape.num_layers, shape.num_kv_heads
    bf16 = lambda: Bf16KVSim(n, h, shape.head_dim, 1, L)
    hyb = lambda: HybridKVSim(rot.layers, 32, 4, 16, 1, L, scale_dtype=FP8, value_group_size=128)
    run = lambda sim: _prefill_then_decode(sim_model, sim, ids)
    ref, int2 = run(bf16()), run(hyb())
    assert torch.equal(run(LayerSplitKVSim(hyb(), bf16(), bf16_kv_heads=[])), int2)
    assert torch.equal(run(LayerSplitKVSim(hyb(), bf16(), bf16_kv_heads=range(h))), ref)
    full = _gap_after_first_chunk(int2, ref)
    one = _gap_after_first_chunk(run(LayerSplitKVSim(hyb(), bf16(), bf16_kv_heads=[0])), ref)
    assert 0.05 * full < one < full
    with pytest.raises(ValueError, match="KV heads"):
        LayerSplitKVSim(hyb(), bf16(), bf16_kv_heads=[h])


def test_a_layer_takes_its_rotations_and_groups_from_another_file(tiny, stream):
    """Layer 0 at key groups 8 (the g8 file's rotation) and the rest at 32: with every other layer
    in BF16, its logits are exactly the uniform g8 cache's, and not the uniform g32 cache's."""
    _, sim_model, _, shape = tiny
    ids = torch.from_numpy(stream[:L][None])
    n = shape.num_layers
    a, b = _rot(shape, "naive", 32), _rot(shape, "hadamard", 8)
    mixed_layers = [b.layers[0], *a.layers[1:]]
    mixed = HybridKVSim(mixed_layers, [8] + [32] * (n - 1), 4, 16, 1, L, scale_dtype=FP8,
                        value_group_size=[128] * n)
    assert mixed.layer_groups == [(8, 128)] + [(32, 128)] * (n - 1)
    rest = range(1, n)
    run = lambda sim: _prefill_then_decode(
        sim_model, LayerSplitKVSim(sim, Bf16KVSim(n, shape.num_kv_heads, shape.head_dim, 1, L), rest), ids)
    got = run(mixed)
    want = run(HybridKVSim(b.layers, 8, 4, 16, 1, L, scale_dtype=FP8, value_group_size=128))
    other = run(HybridKVSim(a.layers, 32, 4, 16, 1, L, scale_dtype=FP8, value_group_size=128))
    assert torch.equal(got, want) and _gap_after_first_chunk(got, other) > 0.01
    debiased = lambda layers, g: run(HybridKVSim(layers, g, 4, 16, 1, L, scale_dtype=FP8, value_group_size=128,
                                                 key_debias=True))
    assert torch.equal(debiased(mixed_layers, [8] + [32] * (n - 1)), debiased(b.layers, 8))


def _spy_on_built_caches(cli, monkeypatch) -> list:
    """The HybridKVSim instances oscar-eval builds, in order."""
    built = []

    class HybridSpy(cli.HybridKVSim):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    monkeypatch.setattr(cli, "HybridKVSim", HybridSpy)
    return built


def _small_eval(model_dir, method: str, out) -> list[str]:
    """oscar-eval arguments of one tiny perplexity window, no BF16 run."""
    return ["--model", str(model_dir), "--method", method, "--no-bf16", "--ppl-len", "128", "--ppl-windows", "1",
            "--chunk", "64", "--passkey-trials", "0", "--corpus-mb", "0.3", "--sink", "4", "--recent", "16",
            "--device", "cpu", "--out", str(out)]


def test_oscar_eval_layer_options(tinylm_dir, tmp_path, monkeypatch):
    """--layer-rotations builds the kernels' cache with the other file's groups at its layers and
    records them; --bf16-layers wraps every method's cache; bad uses are refused."""
    from calibration.fidelity import cli
    shape = ModelShape.from_hf_config(json.loads((tinylm_dir / "config.json").read_text()))
    base, g8 = tmp_path / "base.safetensors", tmp_path / "g8.safetensors"
    save_rotations(str(base), _rot(shape, "hadamard", 32))
    save_rotations(str(g8), _rot(shape, "hadamard", 8, vg=64))
    built = _spy_on_built_caches(cli, monkeypatch)
    out = tmp_path / "fid.json"
    common = _small_eval(tinylm_dir, f"h={base}", out)
    assert cli.main([*common, "--layer-rotations", f"{g8}:1,3-4", "--bf16-layers", "7", "--bf16-kv-heads", "1"]) == 0
    groups = [(8, 64) if i in (1, 3, 4) else (32, 128) for i in range(shape.num_layers)]
    assert built[-1].layer_groups == groups
    s = json.loads(out.read_text())["settings"]
    assert s["rotations"]["h"]["layer_groups"] == [list(g) for g in groups] and s["bf16_layers"] == [7]
    assert s["bf16_kv_heads"] == [1]
    assert s["layer_rotations"][0]["layers"] == [1, 3, 4] and s["layer_rotations"][0]["group_size"] == 8
    assert s["group_size"] == 32  # the method's own file
    for extra, why in ((["--layer-rotations", f"{g8}:1", "--int2-parts", "kv-fake"], "int2-parts kv"),
                       (["--layer-rotations", f"{g8}:1", "--layer-rotations", f"{g8}:1,2"], "given twice"),
                       (["--layer-rotations", f"{g8}:{shape.num_layers}"], "outside"),
                       (["--bf16-layers", str(shape.num_layers)], "outside"),
                       (["--bf16-kv-heads", str(shape.num_kv_heads)], "outside")):
        with pytest.raises(SystemExit, match=why):
            cli.main([*common, *extra])


def test_oscar_eval_serves_a_files_own_key_groups_per_layer(tinylm_dir, tmp_path, monkeypatch):
    """A version-4 file (key groups per layer) builds the kernels' cache with each layer's groups and
    records them; the fake-quantisation ablations, which take one group size, refuse it."""
    import dataclasses

    from calibration.fidelity import cli
    shape = ModelShape.from_hf_config(json.loads((tinylm_dir / "config.json").read_text()))
    rot = _rot(shape, "hadamard", 32)
    keys = [8 if i % 3 == 0 else 32 for i in range(shape.num_layers)]
    path = tmp_path / "per_layer.safetensors"
    save_rotations(str(path), dataclasses.replace(rot, meta=dataclasses.replace(rot.meta, key_group_sizes=keys)))
    built = _spy_on_built_caches(cli, monkeypatch)
    out = tmp_path / "fid.json"
    common = _small_eval(tinylm_dir, f"p={path}", out)
    assert cli.main(common) == 0
    assert built[-1].layer_groups == [(g, 128) for g in keys]
    assert json.loads(out.read_text())["settings"]["rotations"]["p"]["layer_groups"] == [[g, 128] for g in keys]
    with pytest.raises(SystemExit, match="sets key groups per layer"):
        cli.main([*common, "--int2-parts", "kv-fake"])
