"""Hybrid sliding-window models (gpt-oss) under --kv-cache-dtype oscar_int2, on CPU.

The full-attention layers' KV lives in an OscarKVPool inside SGLang's own SWAKVPool (whose
sliding-window pool is SGLang's BF16 MHATokenToKVPool, its slots reached through the real
SWATokenToKVPoolAllocator's full->SWA mapping); OscarSWAAttnBackend sends the full-attention
layers to OscarAttnBackend (learned sinks passed on) and the sliding-window layers to SGLang's
Triton backend. Model folders hold only a config.json (calibration.architectures' gpt-oss-20b
and gemma-3-1b rows), read by SGLang 0.5.17's own ModelConfig.

Real SGLang objects throughout (ModelConfig, ServerArgs, SWAKVPool, MHATokenToKVPool,
SWATokenToKVPoolAllocator, HybridSWAPoolConfigurator, ReqToTokenPool, RadixAttention,
TritonAttnBackend's constructor); the one stand-in: TritonAttnBackend's metadata and kernels
(Triton on CUDA), replaced in ``SlidingRecorder`` by a recording subclass that stores K/V through
SGLang's own SWAKVPool.set_kv_buffer at the full->SWA translated slots (as Triton's
``_set_kv_buffer`` does) and attends the BF16 window with the sinks read back from that pool.
"""
import json
from types import SimpleNamespace

import pytest
import torch

from calibration import architectures
from sglang_cases import prefill_in_chunks, write_distinct_heads_file

from sglang_ext.settings import OSCAR_KV_DTYPE, OscarConfigError

pytest.importorskip("sglang")
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.distributed.parallel_state_wrapper import ParallelState  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.pool_configurator import HybridSWAPoolConfigurator  # noqa: E402
from sglang.srt.runtime_context import get_parallel, publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402

import test_sglang_backend as tb  # noqa: E402
from oscar_kernels.reference import _attend  # noqa: E402
from sglang_ext import plugin, refusals  # noqa: E402
from sglang_ext.backend import OscarAttnBackend, OscarSWAAttnBackend  # noqa: E402
from sglang_ext.memory import INDEX_BYTES  # noqa: E402
from sglang_ext.pool import OscarKVPool, OscarSWAKVPool, oscar_pool_of, plan_for_configurator  # noqa: E402

plugin.activate()

GPT_OSS = architectures.get("gpt-oss-20b")
GEMMA3 = architectures.get("gemma-3-1b")
FULL, SLIDING = (1, 3), (0, 2)  # the gpt-oss row: sliding at 0 and 2, full at 1 and 3


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


def model_dir(tmp_path, row=GPT_OSS, **overrides) -> tuple[str, dict]:
    architectures.hf_config(row, architectures.TOKENIZER_VOCAB).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = dict(json.loads(path.read_text()), **overrides)
    path.write_text(json.dumps(cfg))
    return str(tmp_path), cfg


def _start(model, rotations, *extra):
    return prepare_server_args(["--model-path", model, "--device", "cpu", "--kv-cache-dtype", OSCAR_KV_DTYPE,
                                "--oscar-rotations", rotations, *extra])


# ---------------------------------------------------------------- start-up: served or refused

def test_gpt_oss_is_served(tmp_path):
    """SGLang asserts gpt-oss runs on a sink-capable backend (triton, fa3, ...): under oscar_int2
    the check sees the Triton backend that runs the sliding layers, and the server starts with
    the oscar backend over SGLang's hybrid sliding-window memory."""
    model, cfg = model_dir(tmp_path)
    sa = _start(model, write_distinct_heads_file(tmp_path / "rot.safetensors", cfg))
    assert sa.attention_backend == "oscar"
    assert sa.prefill_attention_backend in (None, "oscar") and sa.decode_attention_backend in (None, "oscar")
    mc = sa.get_model_config()
    assert mc.is_hybrid_swa and mc.has_attention_sinks
    assert tuple(mc.full_attention_layer_ids) == FULL and tuple(mc.swa_attention_layer_ids) == SLIDING


def test_gemma3_is_refused_in_one_line(tmp_path):
    """SGLang 0.5.17 turns its hybrid sliding-window memory off for Gemma-3 (every layer in one
    full-size pool): the sliding layers would be INT2 with no window."""
    model, cfg = model_dir(tmp_path, GEMMA3)
    with pytest.raises(OscarConfigError) as ei:
        _start(model, write_distinct_heads_file(tmp_path / "rot.safetensors", cfg))
    assert _one_line(ei) == (
        f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve Gemma3ForCausalLM: its sliding-window layers 0,1,2,3,4 "
        "need SGLang's BF16 SWA pool, but SGLang 0.5.17 runs Gemma3ForCausalLM without its hybrid sliding-window "
        "memory, so they would share the one full-size KV pool, which would be INT2 with no attention window")


def test_gemma3_geometry_fits_the_kernels_and_soft_capping_is_refused_in_one_line(tmp_path):
    """What stands between Gemma-3 and oscar_int2 is SGLang's pool, not the kernels: its head_dim
    256, query scaling query_pre_attn_scalar**-0.5 (one scale for every layer) and no logit
    soft-capping pass the kernel checks; Gemma-2's soft-capping does not."""
    from oscar_kernels.contract.model_shape import ModelShape

    model, _ = model_dir(tmp_path, GEMMA3)
    mc = ModelConfig.from_server_args(ServerArgs(model_path=model, device="cpu"))
    shape = ModelShape.from_hf_config(mc.hf_config)
    assert (shape.head_dim, shape.attention_layers) == (256, (5,)) and not mc.is_hybrid_swa
    refusals._check_kernel_geometry(shape, mc, "Gemma3ForCausalLM")
    mc.hf_text_config.attn_logit_softcapping = 50.0
    with pytest.raises(OscarConfigError) as ei:
        refusals._check_kernel_geometry(shape, mc, "Gemma2ForCausalLM")
    assert _one_line(ei) == (f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve Gemma2ForCausalLM: attention "
                             "logit soft-capping (50.0), which the OSCAR kernels do not apply")


def test_gpt_oss_without_sglangs_swa_memory_is_refused_in_one_line(tmp_path):
    model, cfg = model_dir(tmp_path)
    with pytest.raises(OscarConfigError) as ei:
        _start(model, write_distinct_heads_file(tmp_path / "rot.safetensors", cfg), "--disable-hybrid-swa-memory")
    assert _one_line(ei) == (
        f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve GptOssForCausalLM: its sliding-window layers 0,2 need "
        "SGLang's BF16 SWA pool, but --disable-hybrid-swa-memory puts them in the one full-size KV pool (drop it), "
        "which would be INT2 with no attention window")


def test_rotations_covering_the_sliding_layers_are_refused_in_one_line(tmp_path):
    model, cfg = model_dir(tmp_path)
    every_layer = dict(cfg, layer_types=["full_attention"] * 4)
    with pytest.raises(OscarConfigError) as ei:
        _start(model, write_distinct_heads_file(tmp_path / "rot.safetensors", every_layer))
    msg = _one_line(ei)
    assert msg.startswith("--oscar-rotations:") and "covers layers 0,1,2,3" in msg
    assert msg.endswith("but the model's full-attention layers are 1,3"), msg


def test_other_hybrid_sliding_window_models_are_refused_in_one_line(tmp_path):
    """The architecture gate, on SGLang's real model config of the row (architectures renamed:
    a hybrid sliding-window model whose serving path here is not checked)."""
    model, _ = model_dir(tmp_path)
    mc = ModelConfig.from_server_args(ServerArgs(model_path=model, device="cpu"))
    assert mc.is_hybrid_swa and refusals.hybrid_swa_problem(mc) is None
    mc.hf_config.architectures = ["Llama4ForConditionalGeneration"]
    assert refusals.hybrid_swa_problem(mc) == (
        f"--kv-cache-dtype {OSCAR_KV_DTYPE} does not support the hybrid sliding-window model "
        "Llama4ForConditionalGeneration: of those it serves GptOssForCausalLM only")
    mc.hf_config.architectures = ["GptOssForCausalLM"]
    mc.is_hybrid_swa_compress = True
    assert refusals.hybrid_swa_problem(mc) == (
        f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve GptOssForCausalLM: its sliding-window layers have "
        "their own head geometry (SGLang's compressed SWA pool)")


def test_hierarchical_cache_is_refused_for_the_sliding_hybrid_in_one_line(monkeypatch):
    from sglang_ext import sglang_bridge

    sa = SimpleNamespace(device="cuda", enable_hierarchical_cache=True, hicache_storage_backend=None)
    with pytest.raises(OscarConfigError) as ei:
        refusals._check_hybrid_features(sa, "GptOssForCausalLM", sliding=True)
    assert _one_line(ei).startswith(f"--enable-hierarchical-cache is not supported with --kv-cache-dtype "
                                    f"{OSCAR_KV_DTYPE}: the INT2 host tier carries plain MHA pools")
    # the Blackwell refusal is the Gated DeltaNet wrapper's; SWA layers run on Triton there too
    monkeypatch.setattr(sglang_bridge, "is_blackwell", lambda: True)
    refusals._check_hybrid_features(SimpleNamespace(**{**vars(sa), "enable_hierarchical_cache": False}),
                                    "GptOssForCausalLM", sliding=True)


# ---------------------------------------------------------------- pool composition and memory

PAGE = 16


def _configurator(model, rotations, max_running_requests=4, kv_cache_dtype=OSCAR_KV_DTYPE, ratio=0.8):
    """SGLang's KVCacheConfigurator as the plugin's hooks and HybridSWAPoolConfigurator read it,
    with the real ModelConfig of the model."""
    args = SimpleNamespace(kv_cache_dtype=kv_cache_dtype, oscar_rotations=rotations, oscar_sink_tokens=4,
                           oscar_recent_window=8, oscar_sink_slots=None, swa_full_tokens_ratio=ratio,
                           max_running_requests=max_running_requests, enable_memory_saver=False)
    mc = ModelConfig.from_server_args(ServerArgs(model_path=model, device="cpu"))
    return SimpleNamespace(server_args=args, model_config=mc, ps=ParallelState.trivial(),
                           layer_info=SimpleNamespace(start_layer=0, end_layer=4, num_effective_layers=4),
                           pool_page_size=PAGE, page_size=PAGE, device="cpu", mambaish_config=None,
                           use_mla_backend=False, is_hybrid_swa=True, is_hybrid_swa_compress=False,
                           sliding_window_size=127, kv_cache_dtype=torch.bfloat16,
                           kv_cache_dtype_str=kv_cache_dtype, is_draft_worker=False,
                           spec_algorithm=SimpleNamespace(is_eagle=lambda: False, is_standalone=lambda: False))


@pytest.fixture
def attn_tp1():
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0, attn_dcp_size=1, attn_dcp_rank=0):
        yield


def _build(kvc, full_tokens=256, swa_tokens=128, rows=5, context=256):
    req_pool = ReqToTokenPool(size=rows - 1, max_context_len=context, device="cpu", enable_memory_saver=False)

    def sglang_pool(*a, **k):
        raise AssertionError("the oscar hook builds the pool")

    sizes = SimpleNamespace(full_max_total_num_tokens=full_tokens, swa_max_total_num_tokens=swa_tokens,
                            max_total_num_tokens=full_tokens)
    pool = plugin.build_token_to_kv_pool_hook(sglang_pool, kvc, sizes=sizes, req_to_token_pool=req_pool,
                                              is_dsa_model=False, is_dsv4_model=False)
    return pool, req_pool


def test_the_pool_holds_full_layers_in_int2_and_sliding_layers_in_sglangs_swa_pool(tmp_path):
    from safetensors.torch import load_file

    model, cfg = model_dir(tmp_path)
    rot = write_distinct_heads_file(tmp_path / "rot.safetensors", cfg)
    kvc = _configurator(model, rot)
    pool, req_pool = _build(kvc)
    assert isinstance(pool, SWAKVPool) and isinstance(pool, OscarSWAKVPool)
    full, swa = pool.full_kv_pool, pool.swa_kv_pool
    assert isinstance(full, OscarKVPool) and oscar_pool_of(pool) is full
    assert full.layer_ids == FULL and full.size == 256 and full.req_to_token is req_pool.req_to_token
    # the sliding layers: SGLang's own BF16 pool, as _build_hybrid_swa_kv_pool builds it
    assert type(swa) is MHATokenToKVPool and swa.dtype == torch.bfloat16 and swa.layer_num == 2
    assert swa.size == 128 and tuple(swa.k_buffer[0].shape) == (128 + PAGE, 8, 64)
    # one layer map: sliding layers by SGLang's dense index, full layers by model layer id
    assert pool.layers_mapping == {0: (0, True), 2: (1, True), 1: (1, False), 3: (3, False)}
    assert [pool.is_swa_layer(l) for l in range(4)] == [True, False, True, False]
    assert pool.get_key_buffer(3) is full.layers[1].k_packed and pool.get_value_buffer(1) is full.layers[0].v_packed
    assert pool.get_key_buffer(2) is swa.k_buffer[1] and pool.get_value_buffer(0) is swa.v_buffer[0]
    with pytest.raises(ValueError) as ei:
        pool.is_swa_layer(4)
    assert _one_line(ei) == "oscar pool: model layer 4 is neither a full-attention layer (1, 3) nor a sliding-window one"
    tensors = load_file(rot)  # each INT2 layer has its model layer's rotations
    for i, layer in enumerate(FULL):
        torch.testing.assert_close(full.rotations[i].k_rot, tensors[f"k_rot.{layer}"])
    # memory: the INT2 plan for the full layers, SGLang's BF16 bytes for the SWA pool
    plan = plan_for_configurator(kvc)
    assert plan.num_layers == 2 and plan.num_kv_heads == 8 and plan.head_dim == 64
    swa_bytes = (128 + PAGE) * 2 * 8 * 64 * 2 * 2
    assert sum(full.get_kv_size_bytes()) == plan.pool_bytes(256)
    assert sum(pool.get_kv_size_bytes()) == plan.pool_bytes(256) + swa_bytes

    # SGLang's SWA allocator over it registers its full->SWA mapping with the pool
    alloc = SWATokenToKVPoolAllocator(256, 128, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
                                      kvcache=pool, need_sort=False)
    assert pool.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping
    full_slots = torch.arange(PAGE, 2 * PAGE)
    pool.full_to_swa_index_mapping[full_slots] = torch.arange(3 * PAGE, 4 * PAGE)
    # SGLang's own write path: a sliding layer's BF16 K/V land at the translated SWA slots
    k, v = torch.randn(2, PAGE, 8, 64).bfloat16()
    sliding = RadixAttention(64, 64, 0.125, 8, 2, sliding_window_size=127)
    pool.set_kv_buffer(sliding, KVWriteLoc(loc=full_slots, swa_loc=pool.translate_loc_from_full_to_swa(full_slots)),
                       k, v)
    assert torch.equal(swa.k_buffer[1][3 * PAGE:4 * PAGE], k) and torch.equal(swa.v_buffer[1][3 * PAGE:4 * PAGE], v)
    # a full layer is written inside attention only, and nothing copies part of the INT2 state
    with pytest.raises(RuntimeError) as ei:
        pool.set_kv_buffer(RadixAttention(64, 64, 0.125, 8, 1), KVWriteLoc(loc=full_slots, swa_loc=None), k, v)
    assert "written inside attention by the 'oscar' attention backend" in _one_line(ei)
    for call in (lambda: pool.get_cpu_copy(full_slots), lambda: pool.move_kv_cache(full_slots, full_slots),
                 lambda: pool.get_contiguous_buf_infos()):
        with pytest.raises(NotImplementedError) as ei:
            call()
        assert "is not supported with --kv-cache-dtype oscar_int2" in _one_line(ei)


def test_memory_accounting_full_layers_at_int2_bytes_swa_pool_as_sglang_sizes_it(tmp_path, attn_tp1):
    model, cfg = model_dir(tmp_path)
    rot = write_distinct_heads_file(tmp_path / "rot.safetensors", cfg)
    kvc = _configurator(model, rot)
    plan = plan_for_configurator(kvc)
    bf16 = HybridSWAPoolConfigurator(_configurator(model, rot, kv_cache_dtype="bfloat16"))  # SGLang's own
    c = HybridSWAPoolConfigurator(kvc)  # the plugin's hook ran after its __init__
    swa_token = 8 * (64 + 64) * 2  # per SWA layer and token: SGLang's BF16 bytes, untouched
    assert c._swa_per_token == bf16._swa_per_token == swa_token
    assert bf16._full_per_token == swa_token
    assert c._full_per_token * 2 == pytest.approx(plan.bytes_per_token + INDEX_BYTES / PAGE)
    assert c._cell_size == pytest.approx(plan.bytes_per_token + INDEX_BYTES / PAGE + 0.8 * swa_token * 2)
    budget = 1 << 30
    left = plugin.profile_available_bytes_hook(budget, kvc)
    assert left == budget - plan.fixed_bytes - PAGE * plan.bytes_per_token - INDEX_BYTES
    sizes = c.calculate_pool_sizes(left, PAGE)
    full, swa = sizes.full_max_total_num_tokens, sizes.swa_max_total_num_tokens
    assert full % PAGE == 0 and swa == int(full * 0.8) // PAGE * PAGE  # SGLang's ratio split
    used = plan.pool_bytes(full) + swa * swa_token * 2
    assert used <= budget < plan.pool_bytes(full + 2 * PAGE) + int((full + 2 * PAGE) * 0.8) * swa_token * 2
    # against SGLang's BF16 split of the same budget: more full-attention tokens by the ratio of the
    # cells; at SGLang's default --swa-full-tokens-ratio 0.8 the BF16 SWA pool takes most of the
    # bytes (1.8x here), at 0.1 the INT2 layers dominate (3.8x)
    ref = bf16.calculate_pool_sizes(budget, PAGE).full_max_total_num_tokens
    assert full / ref == pytest.approx(bf16._cell_size / c._cell_size, rel=1e-3)
    assert 1.7 < full / ref < 1.9
    low = HybridSWAPoolConfigurator(_configurator(model, rot, ratio=0.1))
    low_ref = HybridSWAPoolConfigurator(_configurator(model, rot, kv_cache_dtype="bfloat16", ratio=0.1))
    gain = (low.calculate_pool_sizes(left, PAGE).full_max_total_num_tokens
            / low_ref.calculate_pool_sizes(budget, PAGE).full_max_total_num_tokens)
    assert 3.7 < gain < 3.9
    assert plugin.resolve_max_num_reqs_hook(100, kvc) == 4  # the ring rows reserved
    # a budget that cannot hold the reserve: one line
    with pytest.raises(ValueError) as ei:
        plugin.profile_available_bytes_hook(plan.fixed_bytes, kvc)
    assert _one_line(ei).startswith("oscar_int2: the KV budget of")


# ---------------------------------------------------------------- backend dispatch

WINDOW = 11  # SGLang's sliding_window_size (gpt-oss: sliding_window - 1): positions i - WINDOW .. i
SWA_SIZE = 256


class SlidingRecorder(TritonAttnBackend):
    """SGLang's Triton backend, built by its own constructor; its metadata and kernels (Triton,
    CUDA) stand in: the metadata records the batch and translates the write slots full->SWA
    (Triton's ``swa_out_cache_loc``), forward stores K/V through SWAKVPool.set_kv_buffer at those
    slots and attends the BF16 window (positions >= i - WINDOW) with the layer's sinks, reading
    the K/V back from the SWA pool through req_to_token and the full->SWA mapping."""

    def init_forward_metadata(self, fb):
        self.planned.append(fb.forward_mode)
        self._fb_swa_loc = self.token_to_kv_pool.translate_loc_from_full_to_swa(fb.out_cache_loc.long())

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.planned.append(("out_graph", fb.forward_mode))

    def init_forward_metadata_in_graph(self, fb):
        self.planned.append(("in_graph", fb.forward_mode))
        self._fb_swa_loc = self.token_to_kv_pool.translate_loc_from_full_to_swa(fb.out_cache_loc.long())

    def init_cuda_graph_state(self, max_bs, max_num_tokens, *a, **k):
        self.planned.append("graph_state")

    def _run(self, mode, q, k, v, layer, fb, save_kv_cache, sinks):
        assert save_kv_cache and layer.sliding_window_size == WINDOW
        self.calls.append((mode, layer.layer_id, sinks is not None))
        pool = self.token_to_kv_pool
        loc = fb.out_cache_loc.long()
        h, hq, d = layer.tp_k_head_num, layer.tp_q_head_num, layer.head_dim
        pool.set_kv_buffer(layer, KVWriteLoc(loc=loc, swa_loc=self._fb_swa_loc), k.view(-1, h, d), v.view(-1, h, d))
        kb, vb = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        lens = fb.seq_lens.tolist()
        new = [1] * len(lens) if mode == "decode" else fb.extend_seq_lens.tolist()
        out, t = [], 0
        for b, (n, e) in enumerate(zip(lens, new)):
            slots = pool.translate_loc_from_full_to_swa(self.req_to_token[int(fb.req_pool_indices[b]), :n].long())
            qs = q[t:t + e].view(e, hq, d)
            i = torch.arange(n - e, n)[:, None]
            j = torch.arange(n)[None, :]
            mask = (j <= i) & (j >= i - WINDOW)
            out.append(_attend(qs, kb[slots], vb[slots], layer.scaling, mask.unsqueeze(0), sinks=sinks))
            t += e
        return torch.cat(out).reshape(t, -1).to(q.dtype)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, sinks=None, **kw):
        return self._run("extend", q, k, v, layer, fb, save_kv_cache, sinks)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, sinks=None, **kw):
        return self._run("decode", q, k, v, layer, fb, save_kv_cache, sinks)


@pytest.fixture
def published(tmp_path):
    """SGLang's process context as a scheduler publishes it (TritonAttnBackend reads it)."""
    (tmp_path / "m").mkdir()
    model, _ = model_dir(tmp_path / "m")
    publish(ServerArgs(model_path=model, device="cpu", attention_backend="triton"), role="test")
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0, attn_dcp_size=1, attn_dcp_rank=0):
        yield model
    reset_context()


def _runner(model_path, pool, req_to_token_pool, **kw):
    mc = ModelConfig.from_server_args(ServerArgs(model_path=model_path, device="cpu"))
    sa = SimpleNamespace(triton_attention_num_kv_splits=8, chunked_prefill_size=1024,
                         enable_deterministic_inference=False, triton_attention_split_tile_size=None)
    return SimpleNamespace(req_to_token_pool=req_to_token_pool, token_to_kv_pool=pool, model_config=mc,
                           sliding_window_size=WINDOW, token_to_kv_pool_allocator=None, page_size=tb.P,
                           device="cpu", gpu_id=0, is_draft_worker=False, server_args=sa, **kw)


class SwaSim(tb.Sim):
    """tb.Sim over the gpt-oss layer pattern at test size (4 layers: sliding 0 and 2, full 1 and
    3; tb.Sim's heads): the OscarKVPool of the full layers inside an OscarSWAKVPool
    whose SWA pool is SGLang's (slots handed out as SGLang's SWA allocator would: mapping filled
    per page), OscarSWAAttnBackend over the oscar backend and a SlidingRecorder; every layer
    carries learned sinks."""

    def __init__(self, model, **kw):
        self.model = model
        super().__init__(layer_ids=FULL, **kw)
        self.oscar = self.backend
        self.swa_free_pages = list(range(1, SWA_SIZE // tb.P + 1))
        runner = _runner(model, self.swa_pool, SimpleNamespace(size=tb.ROWS - 1, req_to_token=self.pool.req_to_token))
        self.sliding = SlidingRecorder(runner)
        self.sliding.planned, self.sliding.calls = [], []
        self.backend = OscarSWAAttnBackend(self.oscar, self.sliding, self.swa_pool)
        self.full_layers = self.layers
        self.layers = sorted(self.layers + [RadixAttention(tb.HQ, tb.D, tb.D ** -0.5, tb.H, l,
                                                           sliding_window_size=WINDOW) for l in SLIDING],
                             key=lambda layer: layer.layer_id)
        g = torch.Generator().manual_seed(7)
        self.sinks = {l: (torch.randn(tb.HQ, generator=g) * 2).bfloat16() for l in range(4)}

    def runner_pool(self):
        self.swa_pool = OscarSWAKVPool(self.pool, SWA_SIZE, list(SLIDING))
        self.allocator = SWATokenToKVPoolAllocator(tb.SIZE, SWA_SIZE, page_size=tb.P, dtype=torch.bfloat16,
                                                   device="cpu", kvcache=self.swa_pool, need_sort=False)
        return self.swa_pool

    def alloc(self, row, start, end):
        super().alloc(row, start, end)
        for p0 in range(start, end, tb.P):
            page = self.swa_free_pages.pop(0)
            full = self.pool.req_to_token[row, p0:p0 + tb.P].long()
            self.swa_pool.full_to_swa_index_mapping[full] = torch.arange(page * tb.P, page * tb.P + tb.P)

    def attend(self, q, k, v, layer, fb):
        return self.backend.forward(q, k, v, layer, fb, sinks=self.sinks[layer.layer_id])

    def expected_sliding(self, row, rid, layer, n_prefix, positions, content):
        """BF16 window attention with sinks, from the tokens' K/V themselves."""
        n = n_prefix + len(positions)
        ks, vs = zip(*[self.kv(self.source[(row, j)] if j < n_prefix else content, layer, [j]) for j in range(n)])
        q = self.q(rid, layer, positions).view(-1, tb.HQ, tb.D)
        i, j = torch.tensor(positions)[:, None], torch.arange(n)[None, :]
        mask = (j <= i) & (j >= i - WINDOW)
        o = _attend(q, torch.cat(ks), torch.cat(vs), tb.D ** -0.5, mask.unsqueeze(0), sinks=self.sinks[layer])
        return o.reshape(len(positions), -1)


def _check(sim, outs, row, rid, prefix, positions, content, valid_from, decode=False):
    for layer, o in zip(sim.layers, outs):
        l = layer.layer_id
        if l in SLIDING:
            want = sim.expected_sliding(row, rid, l, prefix, positions, content)
        elif decode:
            want = sim.expected_decode(row, rid, l, prefix + 1, content, valid_from,
                                       learned_sinks=sim.sinks[l])
        else:
            want = sim.expected(row, rid, l, prefix, positions, content, valid_from, learned_sinks=sim.sinks[l])
        tb.close(o, want)


def test_full_layers_through_oscar_with_sinks_and_sliding_layers_through_sglangs_backend(published):
    sim = SwaSim(published, learned_sinks=True)
    assert sim.backend.token_to_kv_pool is sim.swa_pool and sim.oscar.pool is sim.pool
    row, prompt, chunk = 3, 40, 16
    prefill_in_chunks(sim, _check, row, "A", prompt, chunk)  # chunked prefill, past the window and the ring
    for n in range(prompt + 1, prompt + 4):  # decode, the last step padded like a CUDA-graph batch
        outs = sim.decode([dict(rid="A", row=row, content="A", n=n)], pad_to=3 if n == prompt + 3 else None,
                          in_graph=n == prompt + 3)
        _check(sim, outs, row, "A", n - 1, [n - 1], "A", 0, decode=True)
    # a radix hit: B shares A's first 32 slots (INT2 and sinks for the full layers, the SWA
    # pool's BF16 cells through the shared mapping for the sliding ones)
    sim.share(4, row, 32)
    outs = sim.extend([dict(rid="B", row=4, content="B", prefix=32, new=8)])
    _check(sim, outs, 4, "B", 32, list(range(32, 40)), "B", 32)
    # SGLang's backend planned every batch and ran exactly the sliding layers, with their sinks
    E, Dm = ForwardMode.EXTEND, ForwardMode.DECODE
    assert sim.sliding.planned == [E, E, E, Dm, Dm, ("out_graph", Dm), ("in_graph", Dm), E]
    assert {layer for _, layer, _ in sim.sliding.calls} == set(SLIDING)
    assert all(has_sinks for *_, has_sinks in sim.sliding.calls) and len(sim.sliding.calls) == 2 * 7
    # the sinks changed the full layers' outputs (the oracle without them disagrees)
    outs = sim.decode([dict(rid="A", row=row, content="A", n=prompt + 4)])
    plain = sim.expected_decode(row, "A", 1, prompt + 4, "A", 0)
    assert not torch.allclose(outs[1].float(), plain, atol=1.5e-2, rtol=1.5e-2)
    # the sliding layers' K/V sit in SGLang's SWA pool, exact, and the INT2 pool holds none of them
    slots = sim.pool.req_to_token[row, :prompt].long()
    k, _ = sim.kv("A", 2, range(prompt))
    assert torch.equal(sim.swa_pool.swa_kv_pool.k_buffer[1][sim.swa_pool.translate_loc_from_full_to_swa(slots)], k)
    assert not torch.equal(sim.pool.layers[0].k_packed[slots], sim.pool.layers[1].k_packed[slots])


def test_oscar_refuses_sinks_the_model_config_does_not_declare_in_one_line(published):
    sim = SwaSim(published)  # learned_sinks=False
    with pytest.raises(NotImplementedError) as ei:
        sim.extend([dict(rid="A", row=3, content="A", prefix=0, new=8)])
    assert _one_line(ei) == ("oscar backend: layer 1 passes sinks of shape (4,) but the model config "
                             "declares no attention sinks")


def test_the_backend_sglang_builds_for_the_sliding_hybrid(published, tmp_path):
    """create_oscar_backend (the registry's ``oscar`` entry) on a runner holding the oscar SWA
    pool: the oscar backend for the full layers (learned sinks from SGLang's model config) and
    SGLang's registered Triton backend for the sliding ones, whose value width is the model's
    even when layer 0 is a full-attention (packed INT2) layer."""
    model = published
    rot = write_distinct_heads_file(tmp_path / "rot.safetensors", json.loads(open(f"{model}/config.json").read()))
    sa = _start(model, rot)
    for full_ids, swa_ids in ((FULL, SLIDING), ((0, 2), (1, 3))):
        g = torch.Generator().manual_seed(0)
        from oscar_kernels.testing import random_rotation

        req_pool = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
        full = OscarKVPool(256, PAGE, 8, 64, 2, "cpu", rotations=[random_rotation(8, 64, g) for _ in range(2)],
                           req_to_token=req_pool.req_to_token, sink_tokens=4, recent_window=8, group_size=32,
                           layer_ids=full_ids)
        pool = OscarSWAKVPool(full, 128, list(swa_ids))
        layers = torch.nn.ModuleList([RadixAttention(64, 64, 0.125, 8, l) for l in range(4)])
        runner = _runner(model, pool, req_pool, model=layers, ps=ParallelState.trivial())
        runner.server_args = SimpleNamespace(**{**vars(runner.server_args), **vars(sa)})
        backend = plugin.create_oscar_backend(runner)
        assert isinstance(backend, OscarSWAAttnBackend)
        assert isinstance(backend.full, OscarAttnBackend) and backend.full.learned_sinks
        assert type(backend.swa) is TritonAttnBackend and backend.swa.token_to_kv_pool is pool
        assert backend.swa.v_head_dim == 64 and backend.get_cuda_graph_seq_len_fill_value() == 1
        assert [backend.backend_of(layers[l]) is backend.swa for l in range(4)] == [l in swa_ids for l in range(4)]
