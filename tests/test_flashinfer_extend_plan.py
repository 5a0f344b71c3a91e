"""FlashInferExtend's host side (oscar_kernels/flashinfer_extend.py) with a stand-in
flashinfer module: which batches it plans, with which index pointers and masks, and when it
steps aside. Its kernels run on the GPU (tests/test_kernels_gpu.py)."""
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
