"""benchmarks/attention_mass.py: its attention against PyTorch's SDPA, and its mass and kept-token
error on a tiny random Llama with a random rotation."""
from __future__ import annotations

import pytest
import torch

from benchmarks import attention_mass
from oscar_kernels.contract.layout import KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import Rotations, make_meta
from oscar_kernels.testing import random_rotation
from tests.calibration_helpers import save_tiny_model_dir


def test_attention_is_causal_gqa_sdpa_for_the_later_queries():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, 24, 16, generator=g) for h in (4, 2, 2))
    p, o = attention_mass.attention(q, k, v, q_from=10)
    ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                           enable_gqa=True)[0]
    assert p.shape == (4, 14, 24) and torch.allclose(p.sum(-1), torch.ones(4, 14))
    assert torch.allclose(o, ref[:, 10:], atol=1e-5)
    assert p[:, 0, 11:].abs().max() == 0  # query 10 sees keys 0..10 only


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_model_dir(tmp_path_factory.mktemp("llama"), family="llama", num_layers=2, q_heads=4,
                               kv_heads=2, head_dim=32)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _rotations(layers: int, h: int, d: int):
    g = torch.Generator().manual_seed(1)
    meta = make_meta(ModelShape("LlamaForCausalLM", layers, 4, h, d), "tiny", KVLayout(8, 8, "float16"), "oscar")
    return Rotations(meta, [random_rotation(h, d, g) for _ in range(layers)])


def test_mass_splits_the_cache_and_keeping_the_whole_history_leaves_no_error(tiny):
    model, tok = tiny
    sink, recent, chunk, n = 4, 16, 64, 128
    hist = chunk - recent - sink
    window = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(2))
    res = attention_mass.run(model, window, _rotations(2, 2, 32), sink, recent, chunk, [0, 4, hist], 5, tok)
    m = res["mass"]
    assert sum(m.values()) == pytest.approx(1.0, abs=2e-3) and min(m.values()) > 0
    err = {int(k): e for k, e in res["output_error_by_kept"].items()}
    assert err[0] > 1e-4  # INT2 keys in the history change the outputs
    assert err[4] < err[0]  # keeping the four keys that take the most attention helps
    assert err[hist] < 1e-8  # the whole history in BF16: only rotation round-off is left
    top = res["top_history_tokens"]
    assert len(top) == 5 and all(sink <= t["position"] < chunk - recent for t in top)
    assert [t["mass"] for t in top] == sorted((t["mass"] for t in top), reverse=True)
