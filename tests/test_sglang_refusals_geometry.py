"""Start-up refusal of attention geometries the Triton kernels cannot serve (issue 30), on
CPU: model folders hold only a config.json (calibration.architectures' rows, or a row with
its head geometry changed), read by SGLang 0.5.17's own ModelConfig; nothing is downloaded."""
import dataclasses

import pytest
import torch

from calibration import architectures
from sglang_cases import write_distinct_heads_file

from oscar_kernels.hybrid_cache import LayerRotation, allocate_layer
from sglang_ext.settings import OSCAR_KV_DTYPE, OscarConfigError

pytest.importorskip("sglang")
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from sglang_ext import plugin, refusals  # noqa: E402

plugin.activate()

_KERNEL_LIMIT = "the Triton kernels need a power-of-two head_dim >= 64"


def _model_dir(tmp_path, arch):
    """A folder with arch's config.json and a rotations file made for it (random orthogonal
    per head, groups of 16: valid for every head_dim here)."""
    cfg = architectures.hf_config(arch, architectures.TOKENIZER_VOCAB)
    cfg.save_pretrained(tmp_path)
    rot = write_distinct_heads_file(tmp_path / "rot.safetensors", cfg.to_dict(), group_size=16)
    return str(tmp_path), rot


def _start(tmp_path, arch, *extra):
    model, rot = _model_dir(tmp_path, arch)
    return prepare_server_args(["--model-path", model, "--device", "cpu", "--kv-cache-dtype", OSCAR_KV_DTYPE,
                                "--oscar-rotations", rot, *extra])


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


def _kernels_serve(head_dim: int) -> bool:
    return head_dim >= 64 and head_dim & (head_dim - 1) == 0


def test_the_table_has_a_refused_row():
    """Phi-3's head_dim 96 is the row the refusal is for (so the next test refuses something)."""
    assert not _kernels_serve(architectures.get("phi-3-mini-4k").head_dim)


@pytest.mark.parametrize("arch", architectures.ARCHITECTURES, ids=lambda a: a.name)
def test_architecture_rows_start_or_are_refused_in_one_line(arch, tmp_path):
    if _kernels_serve(arch.head_dim):
        sa = _start(tmp_path, arch)
        assert sa.attention_backend == "oscar"
        return
    with pytest.raises(OscarConfigError) as ei:
        _start(tmp_path, arch)
    msg = _one_line(ei)
    assert msg == (f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve {arch.architecture}: "
                   f"head_dim {arch.head_dim} ({_KERNEL_LIMIT})")


def _llama_with(**over):
    base = architectures.get("llama-3.2-1b")
    return dataclasses.replace(base, name="llama-variant", config={**base.config, **over})


@pytest.mark.parametrize("head_dim", [32, 48, 80, 96, 192, 64, 128, 256])
def test_head_dims_other_than_powers_of_two_from_64_are_refused(head_dim, tmp_path):
    arch = _llama_with(head_dim=head_dim)
    if _kernels_serve(head_dim):
        assert _start(tmp_path, arch).attention_backend == "oscar"
        return
    with pytest.raises(OscarConfigError) as ei:
        _start(tmp_path, arch)
    assert f"head_dim {head_dim} ({_KERNEL_LIMIT})" in _one_line(ei)


def test_head_dim_refused_before_the_rotations_file_is_read(tmp_path):
    """A Phi-3 file calibrates and validates, but the model's head_dim is what to hear about:
    the refusal comes first even when the file is for another model."""
    model, _ = _model_dir(tmp_path, architectures.get("phi-3-mini-4k"))
    other = tmp_path / "other"
    other.mkdir()
    _, rot = _model_dir(other, architectures.get("llama-3.2-1b"))
    with pytest.raises(OscarConfigError) as ei:
        prepare_server_args(["--model-path", model, "--device", "cpu", "--kv-cache-dtype", OSCAR_KV_DTYPE,
                             "--oscar-rotations", rot])
    assert "head_dim 96" in _one_line(ei) and "--oscar-rotations" not in str(ei.value)


def test_value_head_dim_other_than_the_key_head_dim_is_refused(tmp_path):
    with pytest.raises(OscarConfigError) as ei:
        _start(tmp_path, _llama_with(v_head_dim=32))
    assert _one_line(ei).endswith("value head_dim 32 differs from the key head_dim 64 "
                                  "(the INT2 cache needs one head_dim)")


def test_query_heads_not_a_multiple_of_kv_heads_is_refused(tmp_path):
    with pytest.raises(OscarConfigError) as ei:
        _start(tmp_path, _llama_with(hidden_size=768, num_attention_heads=12, num_key_value_heads=8))
    assert _one_line(ei).endswith("12 query heads are not a multiple of 8 KV heads")


def test_the_refusal_agrees_with_the_kernels_own_checks():
    """kernel_head_dim_problem refuses exactly the head dims that decode's and extend's
    host checks raise on (every multiple of 4 up to 512; groups of D/4 store them all)."""
    from oscar_kernels import triton_decode, triton_extend

    for d in range(4, 513, 4):
        layer = allocate_layer(8, 1, d, d // 4, 0, 0, 1, 1, torch.float16)
        eye = torch.eye(d)[None]
        lo, hi = torch.full((1, d), -float("inf")), torch.full((1, d), float("inf"))
        rotation = LayerRotation(eye, eye, lo, hi, lo, hi)
        q = torch.zeros(0, 2, d, dtype=torch.bfloat16)
        kv = torch.zeros(0, 1, d, dtype=torch.bfloat16)
        rows = torch.zeros(0, dtype=torch.int32)
        r2t = torch.zeros(1, 8, dtype=torch.int32)
        raised = []
        for run in (lambda: triton_decode.check_decode_inputs(q, layer, rotation, rows, rows),
                    lambda: triton_extend.triton_extend(q, kv, kv, layer, None, rotation, r2t, rows, rows,
                                                        torch.zeros(1, dtype=torch.int32), 0, 1.0)):
            try:
                run()
                raised.append(False)
            except ValueError as e:
                assert f"head_dim {d}" in str(e), str(e)
                raised.append(True)
        refused = refusals.kernel_head_dim_problem(d) is not None
        assert raised == [refused, refused], (d, raised, refused)
