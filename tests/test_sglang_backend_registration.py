"""The `oscar` sglang.srt.plugins entry point on CPU: discovery the way SGLang's
load_plugins() does it, registration (idempotent) through the bridge and the hooks it installs."""
import importlib.metadata
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

from sglang_cases import write_hadamard_file  # noqa: E402
from sglang_ext import plugin, sglang_bridge  # noqa: E402
from sglang_ext.settings import OSCAR_KV_DTYPE  # noqa: E402
from test_sglang_pool import fake_configurator, small_pool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_setup_py_declares_the_entry_point():
    decl = re.search(r'"sglang\.srt\.plugins":\s*\[\s*"([^"]+)"', (ROOT / "setup.py").read_text())
    assert decl and decl.group(1).replace(" ", "") == plugin.ENTRY_POINT.replace(" ", "")


def test_sglang_discovers_the_entry_point(tmp_path, monkeypatch):
    """With the checkout's metadata on sys.path, SGLang's own discovery loads
    sglang_ext.plugin:register; SGLANG_PLUGINS, when set, must name it."""
    plugin.write_entry_point_metadata(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert found["oscar"][0] is plugin.register
    monkeypatch.setenv("SGLANG_PLUGINS", "oscar")
    assert set(load_plugins_by_group(GENERAL_PLUGINS_GROUP)) == {"oscar"}
    monkeypatch.setenv("SGLANG_PLUGINS", "some-other-plugin")
    assert "oscar" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)


@pytest.fixture(scope="module")
def activated():
    plugin.activate()
    plugin.activate()  # idempotent
    yield


def test_registration_is_idempotent(activated):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    plugin.register()
    assert ATTENTION_BACKEND_CHOICES.count("oscar") == 1
    assert ATTENTION_BACKENDS["oscar"] is plugin.create_oscar_backend
    hooks = plugin.hooks()
    assert {h.target for h in hooks} == set(sglang_bridge.HOOK_TARGETS.values())
    for h in hooks:
        assert [fn for _, fn, _ in HookRegistry._hooks[h.target]].count(h.fn) == 1, h.target
        assert h.target in HookRegistry._patched, h.target


def test_the_bridge_is_the_only_module_that_imports_sglang():
    """Every SGLang symbol sglang_ext uses is named in sglang_bridge: no other module of the
    package imports sglang (at the top or inside a function)."""
    import ast

    importers = set()
    for path in sorted((ROOT / "sglang_ext").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(n == "sglang" or n.startswith("sglang.") for n in names):
                importers.add(path.name)
    assert importers == {"sglang_bridge.py"}


def test_a_missing_sglang_symbol_is_one_error_naming_it_and_installs_nothing():
    def hook(result, *args):
        return None

    good = sglang_bridge.Hook(sglang_bridge.HOOK_TARGETS["check_server_args"], hook, HookType.AFTER)
    for target, why in (("sglang.srt.server_args.ServerArgs.no_such_method", "not found"),
                        ("sglang.srt.no_such_module.f", "not found"),
                        ("sglang.srt.server_args.ServerArgs", "is a class")):
        with pytest.raises(sglang_bridge.SglangBridgeError) as e:
            sglang_bridge.install_hooks([good, sglang_bridge.Hook(target, hook, HookType.AFTER)])
        msg = str(e.value)
        assert "\n" not in msg and target in msg and why in msg and "needs sglang==0.5.17, found 0.5.17" in msg
        assert hook not in [fn for _, fn, _ in HookRegistry._hooks.get(good.target, [])]


def test_kv_cache_dtype_hook(activated):
    from sglang.srt.mem_cache import kv_cache_dtype

    kw = dict(model=None, model_dtype=torch.bfloat16, is_draft_worker=False, is_dflash=False,
              speculative_draft_attention_backend=None)
    assert kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype=OSCAR_KV_DTYPE, **kw) \
        == (OSCAR_KV_DTYPE, torch.bfloat16)
    assert kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype="bf16", **kw) \
        == (None, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype=OSCAR_KV_DTYPE,
                                                **{**kw, "model_dtype": torch.float32})


def test_sizing_hooks(activated, tmp_path):
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang_ext.pool import plan_for_configurator

    from sglang_cases import SMALL_QWEN3

    kvc = fake_configurator(write_hadamard_file(tmp_path / "r.safetensors", SMALL_QWEN3),
                            max_running_requests=7)
    plan = plan_for_configurator(kvc)
    # SGLang's own cell-size method, patched
    assert DefaultPoolConfigurator._compute_cell_size(None, kvc, 2) == plan.bytes_per_token
    budget = 50 << 20
    sized = plugin.profile_available_bytes_hook(budget, kvc, 0)
    assert sized == plan.max_total_tokens(budget) * plan.bytes_per_token
    assert sized // plan.bytes_per_token // plan.page_size * plan.page_size == plan.max_total_tokens(budget)
    with pytest.raises(ValueError, match="fixed reserve"):
        plugin.profile_available_bytes_hook(plan.fixed_bytes, kvc, 0)
    assert plugin.resolve_max_num_reqs_hook(2048, kvc, 10**6) == 7
    assert plugin.resolve_max_num_reqs_hook(3, kvc, 10**6) == 3
    other = SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="auto"))
    assert plugin.profile_available_bytes_hook(budget, other, 0) is None


def test_fused_rope_store_is_off_for_the_oscar_pool(activated):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models import utils

    fused_on = lambda fb: True  # what SGLang answers for a bf16 pool on CUDA  # noqa: E731
    fb = SimpleNamespace()
    with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=small_pool()))):
        assert plugin.enable_fused_set_kv_buffer_hook(fused_on, fb) is False
        assert utils.enable_fused_set_kv_buffer(fb) is False  # the patched function
    with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=object()))):
        assert plugin.enable_fused_set_kv_buffer_hook(fused_on, fb) is True
    patched = sys.modules["sglang.srt.models.utils"].enable_fused_set_kv_buffer
    assert patched.__wrapped__ is not patched


def test_deterministic_truncation_hook_aligns_chunks_for_oscar_only(activated):
    """With --enable-deterministic-inference SGLang's scheduler cuts prompts at multiples of
    truncation_align_size; for oscar_int2 that is --chunked-prefill-size (page-aligned)."""
    def run(**kw):
        sa = SimpleNamespace(**{**dict(enable_deterministic_inference=True, kv_cache_dtype=OSCAR_KV_DTYPE,
                                       page_size=64, chunked_prefill_size=1000), **kw})
        sched = SimpleNamespace(server_args=sa, truncation_align_size="theirs")
        plugin.deterministic_truncation_hook(None, sched)
        return sched.truncation_align_size

    assert run() == 960
    assert run(chunked_prefill_size=-1) is None and run(chunked_prefill_size=32) is None
    assert run(kv_cache_dtype="bf16") == "theirs"
    assert run(enable_deterministic_inference=False) == "theirs"
    assert "sglang.srt.managers.scheduler.Scheduler.init_deterministic_inference_config" in HookRegistry._patched
