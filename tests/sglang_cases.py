"""Builders shared by the sglang_ext tests (CPU and GPU): rotations files and small
model configs."""
from __future__ import annotations

import torch

from calibration.transforms import hadamard_matrix
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import Rotations, make_meta, no_clip, save_rotations
from oscar_kernels.hybrid_cache import LayerRotation

# A small Qwen3-shaped config (2 layers, GQA 4 query / 2 KV heads of dim 64).
SMALL_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "hidden_size": 256}


def hadamard_rotations(shape: ModelShape, group_size: int, model_name: str = "test") -> Rotations:
    """The ``hadamard`` recipe (R = H for every layer and KV head, no clip)."""
    h = hadamard_matrix(shape.head_dim, torch.float32)
    rot = h.expand(shape.num_kv_heads, -1, -1).contiguous()
    lo, hi = no_clip(shape.num_kv_heads, shape.head_dim)
    layers = [LayerRotation(rot.clone(), rot.clone(), lo.clone(), hi.clone(), lo.clone(), hi.clone())
              for _ in shape.attention_layers]
    return Rotations(make_meta(shape, model_name, KVLayout(group_size, group_size, "float16"), "hadamard"), layers)


def write_distinct_heads_file(path, config, group_size: int = 32, seed: int = 0,
                              scale_dtype: str = "float16", value_group_size: int | None = None,
                              key_group_sizes=None) -> str:
    """A valid rotations file whose every (layer, KV head) has its own random orthogonal
    matrices, so a wrong head slice is visible (values in groups of ``value_group_size``,
    default ``group_size``; ``key_group_sizes``: the keys' groups per covered layer, a version-4 file)."""
    shape = ModelShape.from_hf_config(config)
    g = torch.Generator().manual_seed(seed)

    def orth():
        q, _ = torch.linalg.qr(torch.randn(shape.num_kv_heads, shape.head_dim, shape.head_dim, generator=g,
                                           dtype=torch.float64))
        return q.float().contiguous()

    lo, hi = no_clip(shape.num_kv_heads, shape.head_dim)
    layers = [LayerRotation(orth(), orth(), lo.clone(), hi.clone(), lo.clone(), hi.clone())
              for _ in shape.attention_layers]
    layout = KVLayout(group_size, group_size if value_group_size is None else value_group_size, scale_dtype)
    meta = make_meta(shape, "test", layout, "oscar")
    if key_group_sizes is not None:
        meta.key_group_sizes = tuple(key_group_sizes)
    save_rotations(str(path), Rotations(meta, layers))
    return str(path)


def write_hadamard_file(path, config, group_size: int = 32) -> str:
    """A valid rotations file for the model described by ``config`` (dict or HF config)."""
    save_rotations(str(path), hadamard_rotations(ModelShape.from_hf_config(config), group_size))
    return str(path)


def calibrate_tinylm_rotations(model_dir, out) -> str:
    """oscar-calibrate (recipe oscar, 8k tokens) on the checkout's own Python sources into
    ``out``, as the GPU server tests use it; the CLI's last lines on failure."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = [str(root / d) for d in ("calibration", "oscar_kernels", "sglang_ext")]
    cmd = [sys.executable, "-m", "calibration.cli", "--model", str(model_dir), "--out", str(out),
           "--recipe", "oscar", "--tokens", "8192", "--seq-len", "1024", "--clip-sample", "2048",
           "--quiet", "--data", *data]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"oscar-calibrate failed:\n{done.stderr[-3000:]}"
    return str(out)


def prefill_in_chunks(sim, check, row: int, rid: str, prompt: int, chunk: int) -> None:
    """Request ``rid`` on request row ``row`` prefilled ``prompt`` tokens in chunks of ``chunk``
    through ``sim.extend``; ``check(sim, outs, row, rid, prefix, positions, content, valid_from)``
    after each chunk."""
    for start in range(0, prompt, chunk):
        new = min(chunk, prompt - start)
        outs = sim.extend([dict(rid=rid, row=row, content=rid, prefix=start, new=new)])
        check(sim, outs, row, rid, start, list(range(start, start + new)), rid, 0)


def stdlib_token_ids(model_dir, need: int) -> list[int]:
    """The first ``need`` token ids of the standard library's test sources (shuffled, seed 0) under
    ``model_dir``'s tokenizer: prompt text for the GPU server tests of random-weight models."""
    from transformers import AutoTokenizer

    from calibration.text_sources import read_texts, shuffled, stdlib_test_files

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out: list[int] = []
    for text in read_texts(shuffled(stdlib_test_files(), 0)):
        out.extend(tok(text, add_special_tokens=False)["input_ids"])
        if len(out) >= need:
            return out[:need]
    raise AssertionError(f"only {len(out)} tokens of text")


def calibrate_on_gpu(model_dir, out) -> str:
    """oscar-calibrate's defaults on CUDA (16,384 tokens in windows of 1,024) into ``out``, as the
    architecture rows' GPU server tests use it; its last lines on failure."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "calibration.cli", "--model", str(model_dir), "--out", str(out),
                           "--device", "cuda", "--tokens", "16384", "--seq-len", "1024", "--quiet"],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr.strip().splitlines()[-3:]
    return str(out)


def generate(server, input_ids, new: int, top: int = 0) -> dict:
    """Greedy /generate of ``new`` tokens (ignore_eos), with the ``top`` most likely tokens per
    position when ``top``; checked to have produced ``new`` tokens."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.0,
                                                        "ignore_eos": True}}
    if top:
        body.update(return_logprob=True, top_logprobs_num=top)
    out = server.post("/generate", body)
    assert isinstance(out, dict) and len(out["output_ids"]) == new, str(out)[:500]
    return out


def gpu_model_dir(arch: str, tmp_path_factory) -> str:
    """A random-weight model folder of architecture row ``arch`` (calibration.architectures) for a
    GPU server test; skipped without CUDA."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from calibration import architectures

    return architectures.build_model_dir(arch, str(tmp_path_factory.mktemp("model") / arch))
