"""FlashInferExtend (oscar_kernels/flashinfer_extend.py) with a stand-in
flashinfer module: which batches it plans, with which index pointers and masks, when it
steps aside, and (FlashInfer's math in PyTorch) that its glue gives the reference's output.
FlashInfer itself runs on the GPU (tests/test_kernels_gpu.py)."""
import sys
import types

import pytest
import torch


class _Wrapper:
    def __init__(self, workspace, layout):
        assert layout == "NHD"
        self.plans = []

    def plan(self, qo_indptr, kv_indptr, **kw):
        self.plans.append((qo_indptr.tolist(), kv_indptr.tolist(), kw["causal"], kw["num_qo_heads"],
                           kw["num_kv_heads"], kw["head_dim_qk"], kw["sm_scale"], kw["q_data_type"]))


@pytest.fixture
def fi(monkeypatch):
    stub = types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=_Wrapper, merge_state=None)
    monkeypatch.setitem(sys.modules, "flashinfer", stub)
    from oscar_kernels.flashinfer_extend import FlashInferExtend
    return FlashInferExtend("cpu", workspace_bytes=16)


def test_plans_the_new_tokens_causally_and_the_prefix_without_mask(fi):
    fi.plan([0, 5, 130], [7, 1, 20], 32, 8, 128, 0.088)
    assert fi.fits and fi.has_prefix and fi.prefix_lens_host == [0, 5, 130]
    assert fi.new.plans == [([0, 7, 8, 28], [0, 7, 8, 28], True, 32, 8, 128, 0.088, torch.bfloat16)]
    assert fi.prefix.plans == [([0, 7, 8, 28], [0, 0, 5, 135], False, 32, 8, 128, 0.088, torch.bfloat16)]


def test_no_prefix_plans_only_the_new_tokens(fi):
    fi.plan([0, 0], [3, 4], 4, 2, 64, 0.125)
    assert fi.fits and not fi.has_prefix
    assert len(fi.new.plans) == 1 and fi.prefix.plans == []


def test_prefixes_over_the_scratch_cap_are_left_to_the_triton_path(fi):
    from oscar_kernels import flashinfer_extend
    fi.plan([flashinfer_extend.MAX_MATERIALIZED_TOKENS, 1], [3, 4], 4, 2, 64, 0.125)
    assert not fi.fits and fi.new.plans == [] and fi.prefix.plans == []


class _TorchRaggedPrefill:
    """FlashInfer's ragged prefill semantics in PyTorch (float32): per request, rows
    qo[b]:qo[b+1] attend to kv[b]:kv[b+1] (causal: bottom-right aligned), GQA; returns
    (o bf16, lse natural log)."""

    def __init__(self, workspace, layout):
        self.qo = self.kv = None

    def plan(self, qo_indptr, kv_indptr, **kw):
        self.qo, self.kv, self.causal, self.scale = qo_indptr.tolist(), kv_indptr.tolist(), kw["causal"], kw["sm_scale"]

    def run(self, q, k, v, return_lse=False):
        t, hq, d = q.shape
        gq = hq // k.shape[1]
        o = torch.zeros(t, hq, d)
        lse = torch.full((t, hq), float("-inf"))
        for b in range(len(self.qo) - 1):
            q0, q1, k0, k1 = self.qo[b], self.qo[b + 1], self.kv[b], self.kv[b + 1]
            if q1 == q0 or k1 == k0:
                continue
            kb = k[k0:k1].float().repeat_interleave(gq, 1)
            vb = v[k0:k1].float().repeat_interleave(gq, 1)
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), kb) * self.scale
            if self.causal:
                qi = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
                s = s.masked_fill(torch.arange(k1 - k0)[None, :] > qi, float("-inf"))
            lse[q0:q1] = torch.logsumexp(s, -1).transpose(0, 1)
            o[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vb)
        return o.bfloat16(), lse


def _torch_merge_state(va, sa, vb, sb):
    m = torch.maximum(sa, sb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(sa - m), torch.exp(sb - m)
    v = (va.float() * wa[..., None] + vb.float() * wb[..., None]) / (wa + wb)[..., None]
    return v.bfloat16(), m + torch.log(wa + wb)


def test_run_glues_rotation_materialisation_and_merge_like_the_reference(monkeypatch):
    """FlashInferExtend.run with FlashInfer's math in PyTorch and our kernels interpreted:
    the output equals reference_extend (prefix hits, an empty prefix, a late ring)."""
    import os

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreted kernels only on a machine without CUDA")
    from test_kernels_interpret import triton_extend_mod  # noqa: F401  (interpreted kernel modules)

    import importlib

    stub = types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=_TorchRaggedPrefill,
                                 merge_state=_torch_merge_state)
    monkeypatch.setitem(sys.modules, "flashinfer", stub)
    from oscar_kernels import testing as kc
    import kernel_helpers as kh
    from oscar_kernels import flashinfer_extend
    fe = importlib.reload(flashinfer_extend)  # bind the interpreted kernel modules
    prefix, new = [24, 0, 40], [5, 7, 3]
    sc = kc.build(prefix, H=2, D=64, G=16, S=4, W=8, page=8, valid_from=[24, 0, 0], seed=12)
    fi = fe.FlashInferExtend("cpu", workspace_bytes=16)
    fi.plan(prefix, new, 4, 2, 64, sc.sm_scale)

    def via(q, k_rot, v_rot, layer, index, rotation, r2t, rows, pre, qo, max_len, sm_scale, prefix_read=None):
        return fi.run(q, k_rot, v_rot, layer, index, rotation, r2t, rows, pre)
    kh.check_extend(sc, 4, new, via)
