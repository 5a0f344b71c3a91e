"""--kv-cache-dtype oscar_int2 flags, settings and start-up refusals (CPU, no server).

Two levels:
- the refusal rules are called directly on a ServerArgs built *without* __post_init__
  (``bare_args``): the narrowest testable unit, no platform needed;
- the whole path (parser -> from_cli_args -> __post_init__ with our hooks, or
  sgl.Engine-style keywords) runs for real with ``--device cpu``, which SGLang 0.5.17
  resolves without an accelerator.
"""
import argparse
import dataclasses
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from sglang_cases import SMALL_QWEN3, write_hadamard_file

from sglang_ext.settings import (DEFAULT_PAGE_SIZE, DEFAULT_RECENT_WINDOW, DEFAULT_SINK_TOKENS,
                                 FLAGS, OSCAR_KV_DTYPE, WARMUP_NAME, OscarConfigError, OscarSettings,
                                 is_oscar, oscar_settings)

pytest.importorskip("sglang")
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402

from sglang_ext import plugin, refusals  # noqa: E402
from sglang_ext.server_args_hooks import OPTION_GROUP_TITLE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
plugin.activate()
plugin.activate()  # idempotent


_ENV_NAMES = [e for e, _ in refusals._ENV_RULES]


@pytest.fixture(autouse=True)
def clean_env():
    """Each test starts without the environment variables that refusals read and leaves
    the environment as it found it."""
    saved = {k: os.environ.pop(k) for k in _ENV_NAMES if k in os.environ}
    yield
    for k in _ENV_NAMES:
        os.environ.pop(k, None)
    os.environ.update(saved)


@pytest.fixture
def tiny_rot(tmp_path, real_model_dir):
    import json

    cfg = json.loads((real_model_dir / "config.json").read_text())
    return write_hadamard_file(tmp_path / "tiny.safetensors", cfg, group_size=32)


@pytest.fixture
def small_rot(tmp_path):
    return write_hadamard_file(tmp_path / "small.safetensors", SMALL_QWEN3, group_size=32)


def bare_args(**kw) -> ServerArgs:
    """A ServerArgs with the given fields and no __post_init__ (no platform, no model)."""
    with mock.patch.object(ServerArgs, "__post_init__", lambda self: None):
        return ServerArgs(model_path="dummy", **kw)


def oscar_bare(rot, **kw) -> ServerArgs:
    return bare_args(kv_cache_dtype=OSCAR_KV_DTYPE, oscar_rotations=rot, **kw)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(p)
    return p


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ install / parser

def test_server_args_hooks_and_fields_installed_once():
    for name in ("add_cli_args", "__init__", "__post_init__", "check_server_args"):
        f = ServerArgs.__dict__[name]
        f = getattr(f, "__func__", f)
        assert hasattr(f, "__wrapped__"), f"{name} not hooked"
        assert not hasattr(f.__wrapped__, "__wrapped__"), f"{name} hooked twice"
    assert isinstance(ServerArgs.__dict__["add_cli_args"], staticmethod)
    names = [f.name for f in dataclasses.fields(ServerArgs)]
    assert [n for n in names if n.startswith("oscar_")] == [f.field for f in FLAGS]
    assert all(getattr(ServerArgs, f.field) is None for f in FLAGS)


def test_parser_accepts_choice_and_oscar_flags():
    p = parser()
    a = p.parse_args(["--model-path", "m", "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", "r.st",
                      "--oscar-sink-tokens", "8", "--oscar-recent-window", "64", "--oscar-sink-slots", "3",
                      "--oscar-extend-prefix", "bf16"])
    assert (a.kv_cache_dtype, a.oscar_rotations, a.oscar_sink_tokens, a.oscar_recent_window,
            a.oscar_sink_slots, a.oscar_extend_prefix) == (OSCAR_KV_DTYPE, "r.st", 8, 64, 3, "bf16")
    b = p.parse_args(["--model-path", "m"])
    assert all(getattr(b, f.field) is None for f in FLAGS)
    assert b.kv_cache_dtype == "auto"
    help_text = p.format_help()
    assert OPTION_GROUP_TITLE in help_text and OSCAR_KV_DTYPE in help_text
    for f in FLAGS:
        assert f.cli in help_text


@pytest.mark.parametrize("argv", [["--oscar-sink-tokens", "x"], ["--kv-cache-dtype", "oscar_int3"]])
def test_parser_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--model-path", "m", *argv])


# ------------------------------------------------------------------ settings

def test_settings_from_the_fields_with_defaults(small_rot):
    sa = bare_args(kv_cache_dtype=OSCAR_KV_DTYPE, oscar_rotations=small_rot)
    assert oscar_settings(sa) == OscarSettings(small_rot, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_WINDOW, None)
    sa = bare_args(kv_cache_dtype=OSCAR_KV_DTYPE, oscar_rotations=small_rot, oscar_sink_tokens=4,
                   oscar_recent_window=32, oscar_sink_slots=7, oscar_extend_prefix="bf16")
    assert oscar_settings(sa) == OscarSettings(small_rot, 4, 32, 7, "bf16")


@pytest.mark.parametrize("kw,match", [
    ({}, "needs --oscar-rotations"),
    ({"oscar_rotations": "/nonexistent/r.safetensors"}, "no such file"),
    ({"oscar_sink_tokens": "four"}, "--oscar-sink-tokens='four' is not an integer"),
    ({"oscar_sink_tokens": 2.5}, "--oscar-sink-tokens=2.5 is not an integer"),
    ({"oscar_sink_tokens": -1}, "--oscar-sink-tokens=-1 must be >= 0"),
    ({"oscar_recent_window": 0}, "--oscar-recent-window=0 must be >= 1"),
    ({"oscar_sink_slots": 0}, "--oscar-sink-slots=0 must be >= 1"),
    ({"oscar_extend_prefix": "fp8"}, "--oscar-extend-prefix='fp8': choose from auto, int2, bf16, flashinfer"),
])
def test_settings_bad_input_one_line(kw, match, small_rot):
    if kw and "oscar_rotations" not in kw:
        kw = {"oscar_rotations": small_rot, **kw}
    sa = bare_args(kv_cache_dtype=OSCAR_KV_DTYPE, **kw)
    with pytest.raises(OscarConfigError) as ei:
        oscar_settings(sa)
    assert match in one_line(ei)


def test_settings_bad_field_names_the_flag(small_rot):
    sa = bare_args(kv_cache_dtype=OSCAR_KV_DTYPE)
    sa.oscar_rotations, sa.oscar_recent_window = small_rot, -3
    with pytest.raises(OscarConfigError) as ei:
        oscar_settings(sa)
    assert "--oscar-recent-window=-3 must be >= 1" in one_line(ei)


def test_settings_only_for_oscar():
    assert not is_oscar(bare_args())
    with pytest.raises(OscarConfigError):
        oscar_settings(bare_args(kv_cache_dtype="fp8_e4m3"))


# ------------------------------------------------------------------ refusals (direct)

REFUSED = [
    ({"enable_hierarchical_cache": True}, "--hicache-io-backend kernel"),
    ({"enable_hierarchical_cache": True, "hicache_io_backend": "direct", "hicache_storage_backend": "mooncake"},
     "--hicache-storage-backend mooncake"),
    ({"enable_lmcache": True}, "--enable-lmcache"),
    ({"enable_flexkv": True}, "--enable-flexkv"),
    ({"disaggregation_mode": "prefill"}, "--disaggregation-mode"),
    ({"disaggregation_decode_enable_offload_kvcache": True}, "--disaggregation-decode-enable-offload-kvcache"),
    ({"enable_page_major_kv_layout": True}, "--enable-page-major-kv-layout"),
    ({"enable_unified_memory": True}, "--enable-unified-memory"),
    ({"enable_hisparse": True}, "--enable-hisparse"),
    ({"speculative_algorithm": "DFLASH"}, "--speculative-algorithm"),
    ({"dcp_size": 2}, "--dcp-size"),
    ({"enable_prefill_cp": True}, "--enable-prefill-cp"),
    ({"attn_cp_size": 2}, "--attn-cp-size"),
    ({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
    ({"enable_pdmux": True}, "--enable-pdmux"),
    ({"dllm_algorithm": "LowConfidence"}, "--dllm-algorithm"),
    ({"prefill_only_disable_kv_cache": True}, "--prefill-only-disable-kv-cache"),
    ({"kv_canary": "log"}, "--kv-canary"),
    ({"attention_backend": "triton"}, "--attention-backend triton"),
    ({"decode_attention_backend": "flashinfer"}, "--decode-attention-backend flashinfer"),
    ({"prefill_attention_backend": "fa3"}, "--prefill-attention-backend fa3"),
    ({"cuda_graph_backend_prefill": "tc_piecewise"}, "--cuda-graph-backend-prefill tc_piecewise"),
    ({"cuda_graph_backend_prefill": "full"}, "--cuda-graph-backend-prefill full"),
    ({"cuda_graph_backend_decode": "tc_piecewise"}, "--cuda-graph-backend-decode tc_piecewise"),
    ({"page_size": DEFAULT_SINK_TOKENS - 1},
     f"--oscar-sink-tokens {DEFAULT_SINK_TOKENS} exceeds --page-size {DEFAULT_SINK_TOKENS - 1}"),
]


def test_every_flag_rule_names_a_real_0_5_17_field():
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    missing = [r[0] for r in refusals._FLAG_RULES if r[0] not in fields]
    assert not missing, missing
    for field, _, flag, _ in refusals._FLAG_RULES:
        assert flag in parser()._option_string_actions, flag


def test_refusal_list_covers_every_flag_rule():
    covered = {k for kw, _ in REFUSED for k in kw}
    assert {r[0] for r in refusals._FLAG_RULES} <= covered


@pytest.mark.parametrize("kw,flag", REFUSED, ids=[f for _, f in REFUSED])
def test_each_refusal_is_one_line_naming_the_flag(kw, flag, small_rot):
    sa = oscar_bare(small_rot, **kw)
    with pytest.raises(OscarConfigError) as ei:
        refusals.check_oscar_server_args(sa)
    msg = one_line(ei)
    assert flag in msg and OSCAR_KV_DTYPE in msg


@pytest.mark.parametrize("env", [e for e, _ in refusals._ENV_RULES])
def test_env_refusals(env, small_rot, monkeypatch):
    monkeypatch.setenv(env, "1")
    with pytest.raises(OscarConfigError) as ei:
        refusals.check_oscar_server_args(oscar_bare(small_rot, page_size=64))
    assert env in one_line(ei)


def test_accepted_configuration_passes(small_rot):
    sa = oscar_bare(small_rot, page_size=64, disable_radix_cache=True, cuda_graph_backend_decode="full")
    refusals.check_oscar_server_args(sa)
    sa = oscar_bare(small_rot, page_size=DEFAULT_SINK_TOKENS, attention_backend="oscar")  # S = page
    refusals.check_oscar_server_args(sa)


def test_missing_rotations_refused():
    sa = bare_args(kv_cache_dtype=OSCAR_KV_DTYPE, page_size=64)
    with pytest.raises(OscarConfigError) as ei:
        refusals.check_oscar_server_args(sa)
    assert "--oscar-rotations" in one_line(ei)


def test_stray_oscar_field_without_oscar_dtype_refused(small_rot):
    sa = bare_args(oscar_rotations=small_rot)  # the field given without the dtype
    with pytest.raises(OscarConfigError) as ei:
        refusals.check_oscar_server_args(sa)
    assert "--oscar-rotations given but --kv-cache-dtype is 'auto'" in one_line(ei)


def test_non_oscar_configurations_untouched():
    sa = bare_args(enable_hierarchical_cache=True, attention_backend="triton")
    refusals.apply_oscar_defaults(sa)
    refusals.check_oscar_server_args(sa)
    assert sa.attention_backend == "triton" and sa.page_size is None


def test_defaults_applied_before_resolution(small_rot):
    sa = oscar_bare(small_rot)
    refusals.apply_oscar_defaults(sa)
    assert (sa.attention_backend, sa.page_size, sa.disable_prefill_cuda_graph) == ("oscar", DEFAULT_PAGE_SIZE, True)
    sa = oscar_bare(small_rot, page_size=128)
    refusals.apply_oscar_defaults(sa)
    assert sa.page_size == 128


def test_prefix_read_warmup_added_after_the_users_own(small_rot):
    sa = oscar_bare(small_rot)
    refusals.apply_oscar_defaults(sa)
    assert sa.warmups == WARMUP_NAME
    sa = oscar_bare(small_rot, warmups="voice_chat")
    refusals.apply_oscar_defaults(sa)
    refusals.apply_oscar_defaults(sa)  # idempotent
    assert sa.warmups == f"voice_chat,{WARMUP_NAME}"
    sa = oscar_bare(small_rot, skip_server_warmup=True)
    refusals.apply_oscar_defaults(sa)
    assert sa.warmups is None
    sa = bare_args()
    refusals.apply_oscar_defaults(sa)
    assert sa.warmups is None


def _fake_model_config(**kw):
    from sglang.srt.configs.model_config import AttentionArch

    base = dict(attention_arch=AttentionArch.MHA, is_hybrid_swa=False, is_draft_model=False,
                linear_attn_registry_result=None,
                hf_config=SimpleNamespace(architectures=["X"], get_text_config=lambda: None))
    base.update(kw)
    return SimpleNamespace(**base)


def _model_kind(kind: str) -> dict:
    from sglang.srt.configs import NemotronHConfig
    from sglang.srt.configs.model_config import AttentionArch

    return {"mla": {"attention_arch": AttentionArch.MLA},
            "swa": {"is_hybrid_swa": True},
            "mamba": {"hf_config": NemotronHConfig()}}[kind]


@pytest.mark.parametrize("kind,match", [("mla", "uses MLA"), ("swa", "hybrid sliding-window"),
                                        ("mamba", "Mamba/linear-attention")])
def test_model_kinds_refused(kind, match, small_rot):
    sa = oscar_bare(small_rot, page_size=64)
    sa.model_path = "some/model"
    fake = _fake_model_config(**_model_kind(kind))
    with mock.patch.object(ServerArgs, "get_model_config", lambda self: fake):
        with pytest.raises(OscarConfigError) as ei:
            refusals.check_oscar_server_args(sa)
    assert match in one_line(ei)


# ------------------------------------------------------------------ whole path on CPU

def _prepare(real_model_dir, *extra):
    return prepare_server_args(["--model-path", str(real_model_dir), "--device", "cpu", *extra])


def test_plugin_path_end_to_end(real_model_dir, tiny_rot):
    sa = _prepare(real_model_dir, "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", tiny_rot,
                  "--oscar-sink-tokens", "8", "--oscar-recent-window", "64")
    assert (sa.oscar_rotations, sa.oscar_sink_tokens, sa.oscar_recent_window) == (tiny_rot, 8, 64)
    assert oscar_settings(sa) == OscarSettings(tiny_rot, 8, 64, None)
    assert sa.attention_backend == "oscar" and sa.page_size == DEFAULT_PAGE_SIZE
    assert sa.cuda_graph_config.prefill.backend == "disabled"
    sa.check_server_args()  # the backstop hook passes on an accepted configuration


def test_deterministic_inference_keeps_oscar_and_drops_the_radix_cache(real_model_dir, tiny_rot):
    """oscar is one of SGLang's deterministic backends (batch-invariant decode, INT2 prefix
    read) but not of its deterministic radix-cache backends: SGLang turns the radix cache off."""
    sa = _prepare(real_model_dir, "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", tiny_rot,
                  "--enable-deterministic-inference")
    assert sa.attention_backend == "oscar" and sa.disable_radix_cache
    sa.check_server_args()


def test_plugin_path_yaml_config(real_model_dir, tiny_rot, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model-path: {real_model_dir}\ndevice: cpu\nkv-cache-dtype: {OSCAR_KV_DTYPE}\n"
                   f"oscar-rotations: {tiny_rot}\noscar-sink-slots: 5\npage-size: 32\n")
    sa = prepare_server_args(["--config", str(cfg)])
    assert oscar_settings(sa) == OscarSettings(tiny_rot, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_WINDOW, 5)
    assert sa.page_size == 32


@pytest.mark.parametrize("extra,match", [
    (["--enable-hierarchical-cache"], "--hicache-io-backend kernel (SGLang's default for "
     "--enable-hierarchical-cache) cannot carry oscar_int2 cells"),
    (["--attention-backend", "triton"], "--attention-backend triton is not supported"),
    (["--enable-deterministic-inference", "--oscar-extend-prefix", "flashinfer", "--oscar-key-debias", "off"],
     "--oscar-extend-prefix flashinfer is not batch-invariant"),
    (["--oscar-extend-prefix", "flashinfer", "--oscar-key-debias", "on"],
     "--oscar-extend-prefix flashinfer cannot apply --oscar-key-debias on"),
    (["--oscar-key-debias", "maybe"], "--oscar-key-debias='maybe': choose from on, off"),
    (["--enable-deterministic-inference", "--enable-mixed-chunk"],
     "--enable-mixed-chunk with --enable-deterministic-inference is not supported"),
    (["--cuda-graph-backend-prefill", "tc_piecewise"], "--cuda-graph-backend-prefill tc_piecewise"),
    (["--cuda-graph-config", '{"prefill": {"backend": "breakable"}}'], "--cuda-graph-backend-prefill breakable"),
    (["--page-size", str(DEFAULT_SINK_TOKENS // 2)], f"exceeds --page-size {DEFAULT_SINK_TOKENS // 2}"),
    (["--oscar-sink-tokens", "100", "--page-size", "64"], "--oscar-sink-tokens 100 exceeds --page-size 64: "
     "--kv-cache-dtype oscar_int2 keeps the sinks on a sequence's first page (use --page-size 128, or "
     "--oscar-sink-tokens 64 or fewer)"),
    (["--speculative-algorithm", "DFLASH"], "--speculative-algorithm DFLASH is not supported"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "{model}", "--speculative-num-steps",
      "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"],
     "--speculative-eagle-topk 2 with EAGLE3 is not supported"),
    (["--speculative-algorithm", "NEXTN", "--speculative-adaptive"], "--speculative-adaptive with NEXTN is not supported"),
    (["--speculative-algorithm", "NGRAM", "--cuda-graph-backend-decode", "full"],
     "--cuda-graph-backend-decode full is not supported with --kv-cache-dtype oscar_int2: use disabled "
     "(--cuda-graph-backend-decode or --cuda-graph-config) under --speculative-algorithm"),
])
def test_refusals_through_post_init(extra, match, real_model_dir, tiny_rot):
    extra = [a.replace("{model}", str(real_model_dir)) for a in extra]
    with pytest.raises(OscarConfigError) as ei:
        _prepare(real_model_dir, "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", tiny_rot, *extra)
    assert match in one_line(ei)


@pytest.mark.parametrize("width", [None, "1", "4"])
def test_ngram_is_served_with_tree_drafts_and_no_decode_graph(width, real_model_dir, tiny_rot):
    """NGRAM resolves under oscar_int2 (SGLang's own refusal of tree drafts on paged backends
    other than flashinfer is lifted by the _handle_ngram hook: the draft tree keeps its width),
    with the decode CUDA graph (SGLang's verify graph under speculation) off."""
    extra = [] if width is None else ["--speculative-ngram-max-bfs-breadth", width]
    sa = _prepare(real_model_dir, "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", tiny_rot,
                  "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "8", *extra)
    topk = 10 if width is None else int(width)  # SGLang's default --speculative-ngram-max-bfs-breadth
    assert sa.speculative_algorithm == "NGRAM" and sa.speculative_eagle_topk == topk
    assert sa.speculative_num_steps == 8 // topk and sa.speculative_num_draft_tokens == 8  # as SGLang sets it
    assert sa.page_size == DEFAULT_PAGE_SIZE and sa.attention_backend == "oscar"
    assert sa.cuda_graph_config.decode.backend == "disabled"
    sa.check_server_args()


def test_standalone_resolves_to_a_chain_with_an_ordinary_draft_backend(real_model_dir, tiny_rot):
    """STANDALONE (the model drafting for itself) resolves under oscar_int2 with SGLang's own
    defaults (3 steps, topk 1, 4 drafts), the target on oscar, the draft on Triton, decode graphs
    off; a tree (--speculative-eagle-topk 2) is refused in one line once SGLang has resolved it."""
    spec = ["--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", tiny_rot, "--speculative-algorithm",
            "STANDALONE", "--speculative-draft-model-path", str(real_model_dir)]
    sa = _prepare(real_model_dir, *spec)
    assert (sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens) == (3, 1, 4)
    assert (sa.attention_backend, sa.speculative_draft_attention_backend) == ("oscar", "triton")
    assert sa.cuda_graph_config.decode.backend == "disabled"
    sa.check_server_args()
    with pytest.raises(OscarConfigError) as ei:
        _prepare(real_model_dir, *spec, "--speculative-num-steps", "2", "--speculative-eagle-topk", "2",
                 "--speculative-num-draft-tokens", "4")
    assert one_line(ei).startswith("--speculative-eagle-topk 2 with STANDALONE is not supported")


@pytest.mark.parametrize("algo, resolved", [("EAGLE", "EAGLE"), ("EAGLE3", "EAGLE3"), ("NEXTN", "EAGLE")])
def test_eagle_family_resolves_like_standalone(algo, resolved, real_model_dir, tiny_rot):
    """EAGLE / EAGLE3 / NEXTN (SGLang resolves NEXTN to EAGLE) resolve under oscar_int2 as
    STANDALONE does: a chain of (3, 1, 4) -- SGLang itself would pick a tree of (5, 4, 8) for this
    Llama target, as the run without oscar_int2 shows --, the target on oscar, the draft on Triton,
    decode graphs off."""
    spec = ["--speculative-algorithm", algo, "--speculative-draft-model-path", str(real_model_dir)]
    sa = _prepare(real_model_dir, "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", tiny_rot, *spec)
    assert sa.speculative_algorithm == resolved
    assert (sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens) == (3, 1, 4)
    assert (sa.attention_backend, sa.speculative_draft_attention_backend) == ("oscar", "triton")
    assert sa.cuda_graph_config.decode.backend == "disabled"
    sa.check_server_args()
    plain = _prepare(real_model_dir, *spec)
    assert (plain.speculative_num_steps, plain.speculative_eagle_topk, plain.speculative_num_draft_tokens) == (5, 4, 8)
    given = _prepare(real_model_dir, "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", tiny_rot, *spec,
                     "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", "6")
    assert (given.speculative_num_steps, given.speculative_eagle_topk, given.speculative_num_draft_tokens) == (5, 1, 6)


def test_ngram_tree_refusal_stays_for_other_kv_caches(real_model_dir):
    """The hook passes through: without oscar_int2 SGLang's own check still refuses."""
    with pytest.raises(ValueError, match="only supported for the 'flashinfer' backend"):
        _prepare(real_model_dir, "--speculative-algorithm", "NGRAM", "--page-size", "16",
                 "--attention-backend", "triton")


def test_rotations_for_another_model_refused(real_model_dir, small_rot):
    with pytest.raises(OscarConfigError) as ei:
        _prepare(real_model_dir, "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", small_rot)
    assert one_line(ei).startswith("--oscar-rotations: oscar rotations file ")
    assert "made for architecture=Qwen3ForCausalLM (test), but the served model has architecture=LlamaForCausalLM" in str(ei.value)


def test_tp_split_refused(real_model_dir, tiny_rot):
    sa = oscar_bare(tiny_rot, page_size=64, tp_size=2)  # 9 query heads
    sa.model_path = str(real_model_dir)
    with mock.patch.object(ServerArgs, "get_model_config",
                           lambda self: _fake_model_config(hf_config=_model_hf(real_model_dir))):
        with pytest.raises(OscarConfigError) as ei:
            refusals.check_oscar_server_args(sa)
    assert one_line(ei).startswith("--tp-size 2: 9 query heads cannot be split over tp_size 2")


def _model_hf(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def test_stray_cli_flag_refused(real_model_dir, tiny_rot):
    with pytest.raises(OscarConfigError) as ei:
        _prepare(real_model_dir, "--oscar-rotations", tiny_rot)
    assert "add --kv-cache-dtype oscar_int2" in one_line(ei)


def test_bf16_serving_unchanged(real_model_dir):
    sa = _prepare(real_model_dir)
    assert sa.kv_cache_dtype == "auto" and sa.attention_backend != "oscar"
    assert all(getattr(sa, f.field) is None for f in FLAGS)


# ------------------------------------------------------------------ fields as keywords

def test_engine_keywords_are_server_args_fields(real_model_dir, tiny_rot):
    """sgl.Engine(**kw) builds ServerArgs(**kw): the oscar keywords are taken like SGLang's
    own fields, resolved by the same __post_init__, and kept by dataclasses.replace/asdict."""
    sa = ServerArgs(model_path=str(real_model_dir), device="cpu", kv_cache_dtype=OSCAR_KV_DTYPE,
                    oscar_rotations=tiny_rot, oscar_sink_tokens=4, oscar_sink_slots=2,
                    oscar_extend_prefix="bf16")
    assert oscar_settings(sa) == OscarSettings(tiny_rot, 4, DEFAULT_RECENT_WINDOW, 2, "bf16")
    assert sa.attention_backend == "oscar" and sa.page_size == DEFAULT_PAGE_SIZE
    assert dataclasses.asdict(sa)["oscar_sink_slots"] == 2
    with pytest.raises(OscarConfigError) as ei:
        ServerArgs(model_path=str(real_model_dir), device="cpu", oscar_rotations=tiny_rot)
    assert "--oscar-rotations given but --kv-cache-dtype is 'auto'" in one_line(ei)
    with pytest.raises(TypeError, match="oscar_rotation"):
        ServerArgs(model_path=str(real_model_dir), device="cpu", oscar_rotation=tiny_rot)  # a typo stays one


def test_bare_replace_keeps_the_oscar_fields(small_rot):
    sa = oscar_bare(small_rot, oscar_recent_window=32)
    with mock.patch.object(ServerArgs, "__post_init__", lambda self: None):
        copy = dataclasses.replace(sa, page_size=128)
    assert (copy.oscar_rotations, copy.oscar_recent_window, copy.page_size) == (small_rot, 32, 128)


@pytest.mark.slow
def test_the_settings_reach_a_spawned_process_with_the_server_args(real_model_dir, tiny_rot):
    """SGLang starts its scheduler processes with multiprocessing's spawn and hands them the
    ServerArgs object (pickled): the oscar fields arrive with it, no environment needed, and
    the child reads the same settings without having loaded the plugin."""
    sa = _prepare(real_model_dir, "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", tiny_rot,
                  "--oscar-sink-tokens", "8", "--oscar-extend-prefix", "int2")
    assert not any(k.startswith("SGLANG_OSCAR") for k in os.environ)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(oscar_settings, sa).result(timeout=600)
    assert got == OscarSettings(tiny_rot, 8, DEFAULT_RECENT_WINDOW, None, "int2") == oscar_settings(sa)


# ------------------------------------------------------------------ launcher

def _serve(argv, reason=None, backend_registered=True):
    """launcher.main with the server start and the process-tree kill mocked out, and the
    CUDA-only check passed (these tests resolve ServerArgs with --device cpu)."""
    from sglang.srt.layers.attention import attention_registry

    from sglang_ext import launcher

    backends = dict(attention_registry.ATTENTION_BACKENDS)
    if backend_registered:
        backends["oscar"] = object()
    else:
        backends.pop("oscar", None)
    with mock.patch.object(launcher, "_plugin_visible_to_subprocesses", return_value=reason), \
            mock.patch.object(launcher, "device_problem", return_value=None), \
            mock.patch.dict(attention_registry.ATTENTION_BACKENDS, backends, clear=True), \
            mock.patch("sglang_ext.sglang_bridge.run_server") as run, \
            mock.patch("sglang_ext.sglang_bridge.kill_process_tree") as kill:
        rc = launcher.main(argv)
    return rc, run, kill


def test_launcher_serves_through_sglang_launch_path(real_model_dir, tiny_rot):
    rc, run, kill = _serve(["serve", str(real_model_dir), "--device", "cpu", "--kv-cache-dtype", OSCAR_KV_DTYPE,
                            "--oscar-rotations", tiny_rot])
    assert rc == 0 and run.call_count == 1 and kill.call_count == 1
    sa = run.call_args.args[0]
    assert sa.model_path == str(real_model_dir) and oscar_settings(sa).rotations_path == tiny_rot


@pytest.mark.parametrize("argv_tail,kw,match", [
    ([], {}, "needs --oscar-rotations"),
    (["--oscar-rotations", "ROT"], {"reason": "the 'oscar' SGLang plugin entry point is not installed"},
     "entry point is not installed"),
    (["--oscar-rotations", "ROT"], {"backend_registered": False}, "did not register its attention backend"),
    (["--oscar-rotations", "ROT", "--enable-hierarchical-cache"], {}, "add --hicache-io-backend direct"),
    (["--oscar-rotations", "ROT", "--oscar-sink-tokens", "100", "--page-size", "64"], {},
     "(use --page-size 128, or --oscar-sink-tokens 64 or fewer)"),
])
def test_launcher_bad_configuration_one_line_exit_2(argv_tail, kw, match, real_model_dir, tiny_rot, capsys):
    argv_tail = [tiny_rot if a == "ROT" else a for a in argv_tail]
    rc, run, _ = _serve(["--model-path", str(real_model_dir), "--device", "cpu",
                         "--kv-cache-dtype", OSCAR_KV_DTYPE, *argv_tail], **kw)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and run.call_count == 0
    assert err and err[-1].startswith("oscar-sglang: ") and match in err[-1]


def test_launcher_refuses_a_device_other_than_cuda_from_a_config_file(real_model_dir, tmp_path, capsys):
    from sglang_ext import launcher

    cfg = tmp_path / "server.yaml"
    cfg.write_text(f"model-path: {real_model_dir}\ndevice: cpu\n")
    with mock.patch.object(launcher, "device_problem", wraps=launcher.device_problem) as check, \
            mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("sglang_ext.sglang_bridge.run_server") as run:
        rc = launcher.main(["--config", str(cfg)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and run.call_count == 0 and [c.args for c in check.call_args_list] == [(None,), ("cpu",)]
    assert err[-1].startswith("oscar-sglang: --device cpu is not supported: oscar-sglang serves on CUDA GPUs only")


def test_launcher_says_in_one_line_what_the_installed_sglang_lacks(capsys):
    """A hook target that the installed SGLang does not have: the plugin's registration
    refuses with one line naming it, and nothing starts."""
    from sglang_ext import launcher, sglang_bridge

    wrong = "sglang.srt.server_args.ServerArgs.add_cli_argz"
    with mock.patch.object(plugin, "_registered", False), \
            mock.patch.dict(sglang_bridge.HOOK_TARGETS, {"cli_args": wrong}), \
            mock.patch.object(launcher, "device_problem", return_value=None), \
            mock.patch("sglang_ext.sglang_bridge.run_server") as run:
        rc = launcher.main(["--model-path", "m"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and run.call_count == 0
    assert err[-1] == (f"oscar-sglang: needs sglang==0.5.17, found 0.5.17: hook target {wrong} not found "
                       f"(AttributeError: type object 'ServerArgs' has no attribute 'add_cli_argz')")


def test_launcher_bf16_needs_no_plugin(real_model_dir):
    rc, run, _ = _serve([str(real_model_dir), "--device", "cpu"], reason="not installed", backend_registered=False)
    assert rc == 0 and run.call_args.args[0].kv_cache_dtype == "auto"


@pytest.mark.slow
def test_launcher_help_all_is_the_oscar_flags_then_sglangs():
    r = subprocess.run([sys.executable, "-m", "sglang_ext.launcher", "--help-all"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage: oscar-sglang") and OPTION_GROUP_TITLE in r.stdout
    for flag in ("--model-path", "--kv-cache-dtype", "--mem-fraction-static", "--chunked-prefill-size",
                 *(f.cli for f in FLAGS)):
        assert flag in r.stdout, flag
    assert r.stdout.index(OPTION_GROUP_TITLE) < r.stdout.index("--mem-fraction-static")
