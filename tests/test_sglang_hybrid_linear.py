"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) under --kv-cache-dtype oscar_int2, on CPU.

The full-attention layers' KV lives in an OscarKVPool inside SGLang's own HybridLinearKVPool
(whose Mamba state pool is the real MambaPool of a real HybridReqToTokenPool), and SGLang's
real HybridLinearAttnBackend sends the full-attention layers to OscarAttnBackend. Model
folders hold only a config.json (calibration.architectures' qwen3-next row), read by SGLang
0.5.17's own ModelConfig. The one stand-in: the Gated DeltaNet backend (GDNAttnBackend needs
CUDA and the FLA kernels), replaced by a recording AttentionBackend.
"""
import json
from types import SimpleNamespace

import pytest
import torch

from calibration import architectures
from sglang_cases import prefill_in_chunks, write_distinct_heads_file

from sglang_ext.settings import OSCAR_KV_DTYPE, OscarConfigError

pytest.importorskip("sglang")
from sglang.srt.configs.hybrid_arch import mambaish_config  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.configs.qwen3_next import Qwen3NextConfig  # noqa: E402
from sglang.srt.distributed.parallel_state_wrapper import ParallelState  # noqa: E402
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402

import test_sglang_backend as tb  # noqa: E402
from sglang_ext import plugin, refusals  # noqa: E402
from sglang_ext.backend import OscarAttnBackend  # noqa: E402
from sglang_ext.pool import (OscarHybridLinearKVPool, OscarKVPool, load_rank_rotations,  # noqa: E402
                             oscar_pool_of, plan_for_configurator, rank_layout)

plugin.activate()

QWEN3_NEXT = architectures.get("qwen3-next-80b-a3b")
FULL = (3, 7)  # the row's full-attention layers (one in four of 8)


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


def qwen3_next_dir(tmp_path, interval=4, layer_types=True) -> tuple[str, dict]:
    """config.json of the qwen3-next row. The public checkpoint's config.json states
    full_attention_interval, which is what SGLang 0.5.17 reads; transformers 5 writes
    layer_types only, so the interval is added back (``interval=None``: left out)."""
    architectures.hf_config(QWEN3_NEXT, architectures.TOKENIZER_VOCAB).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    if interval is not None:
        cfg["full_attention_interval"] = interval
    if not layer_types:
        cfg.pop("layer_types")
    path.write_text(json.dumps(cfg))
    return str(tmp_path), cfg


def _start(model, rotations, *extra):
    # --disable-radix-cache: SGLang's mamba radix cache with pages > 1 takes the extra_buffer
    # strategy, which SGLang itself refuses off CUDA ("extra_buffer needs CUDA/MUSA/NPU/ROCm")
    return prepare_server_args(["--model-path", model, "--device", "cpu", "--kv-cache-dtype", OSCAR_KV_DTYPE,
                                "--oscar-rotations", rotations, "--disable-radix-cache", *extra])


# ---------------------------------------------------------------- start-up: served or refused

def test_qwen3_next_is_served(tmp_path):
    model, cfg = qwen3_next_dir(tmp_path)
    sa = _start(model, write_distinct_heads_file(tmp_path / "rot.safetensors", cfg))
    assert sa.attention_backend == "oscar"
    assert tuple(mambaish_config(sa.get_model_config()).full_attention_layer_ids) == FULL


# a Qwen3.5 config.json (Qwen3_5ForConditionalGeneration: text + vision configs, M-RoPE) at small size
QWEN3_5_TEXT = dict(model_type="qwen3_5_text", num_hidden_layers=8, full_attention_interval=4,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, hidden_size=256,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=1024,
                    max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                     "mrope_section": [11, 11, 10], "mrope_interleaved": True})
QWEN3_5 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": QWEN3_5_TEXT,
           "vision_config": {"depth": 2, "hidden_size": 64, "num_heads": 2, "out_hidden_size": 256,
                             "intermediate_size": 128}}


def test_qwen3_5_is_served(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5))
    sa = _start(str(tmp_path), write_distinct_heads_file(tmp_path / "rot.safetensors", QWEN3_5))
    assert sa.attention_backend == "oscar"
    assert tuple(mambaish_config(sa.get_model_config()).full_attention_layer_ids) == FULL


def test_the_rows_model_folder_is_one_sglang_serves(tmp_path):
    """architectures.build_model_dir writes full_attention_interval back (transformers 5 folds
    it into layer_types; SGLang 0.5.17 reads only it): the folder the GPU test serves starts."""
    model = architectures.build_model_dir(QWEN3_NEXT, str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["full_attention_interval"] == 4
    sa = _start(model, write_distinct_heads_file(tmp_path / "rot.safetensors", cfg))
    assert tuple(mambaish_config(sa.get_model_config()).full_attention_layer_ids) == FULL


def test_rotations_for_another_layer_pattern_are_refused_in_one_line(tmp_path):
    model, cfg = qwen3_next_dir(tmp_path)
    other = dict(cfg, layer_types=["linear_attention", "full_attention"] * 4)  # full at 1, 3, 5, 7
    rot = write_distinct_heads_file(tmp_path / "rot.safetensors", other)
    with pytest.raises(OscarConfigError) as ei:
        _start(model, rot)
    msg = _one_line(ei)
    assert msg.startswith("--oscar-rotations:") and "covers layers 1,3,5,7" in msg
    assert msg.endswith("but the model's full-attention layers are 3,7"), msg


def test_a_layer_pattern_sglang_reads_otherwise_is_refused_in_one_line(tmp_path):
    """layer_types names 3 and 7 (what transformers, hence oscar-calibrate, reads), while
    full_attention_interval 2 makes SGLang 0.5.17 run full attention at 1, 3, 5 and 7: the
    file is checked against the layers SGLang serves, and refused."""
    model, cfg = qwen3_next_dir(tmp_path, interval=2)
    with pytest.raises(OscarConfigError) as ei:
        _start(model, write_distinct_heads_file(tmp_path / "rot.safetensors", cfg))
    msg = _one_line(ei)
    assert msg.startswith("--oscar-rotations:"), msg
    assert msg.endswith("covers layers 3,7 but the model's full-attention layers are 1,3,5,7"), msg


def test_sglang_and_the_model_shape_must_name_the_same_full_attention_layers():
    """The guard behind the pool: SGLang's hybrid config and ModelShape disagreeing (here a
    shape stated for other layers) is one line naming both."""
    from oscar_kernels.contract.model_shape import ModelShape

    config = Qwen3NextConfig(num_hidden_layers=8, full_attention_interval=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, hidden_size=256)
    mc = SimpleNamespace(hf_config=config)
    shape = ModelShape.from_hf_config(config)
    assert shape.attention_layers == FULL
    refusals._check_hybrid_layers(mc, shape, "Qwen3NextForCausalLM")  # agree: nothing
    other = ModelShape.from_hf_config(dict(config.to_dict(), layer_types=["linear_attention", "full_attention"] * 4))
    with pytest.raises(OscarConfigError) as ei:
        refusals._check_hybrid_layers(mc, other, "Qwen3NextForCausalLM")
    assert _one_line(ei) == (f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve Qwen3NextForCausalLM: SGLang "
                             "0.5.17 runs full attention at layers 3,7 but the config's layer pattern "
                             "names 1,3,5,7 (its layer_types and full_attention_interval disagree)")


def test_a_config_sglang_cannot_read_the_layers_of_is_refused_in_one_line(tmp_path):
    model, cfg = qwen3_next_dir(tmp_path, interval=None)
    rot = write_distinct_heads_file(tmp_path / "rot.safetensors", cfg)
    with pytest.raises(OscarConfigError) as ei:
        _start(model, rot)
    msg = _one_line(ei)
    assert msg.startswith(f"--kv-cache-dtype {OSCAR_KV_DTYPE}: SGLang 0.5.17 cannot read the full-attention "
                          "layers of Qwen3NextForCausalLM from its config"), msg
    assert "full_attention_interval" in msg


def test_hybrids_other_than_gated_deltanet_ones_are_refused_in_one_line(tmp_path):
    """The architecture gate, on SGLang's real model config of the row (architectures
    renamed: a hybrid whose serving path here is not checked)."""
    model, _ = qwen3_next_dir(tmp_path)
    mc = ModelConfig.from_server_args(ServerArgs(model_path=model, device="cpu", disable_radix_cache=True))
    assert refusals.hybrid_linear_problem(mc) is None
    mc.hf_config.architectures = ["JetNemotronForCausalLM"]
    msg = refusals.hybrid_linear_problem(mc)
    assert msg.startswith(f"--kv-cache-dtype {OSCAR_KV_DTYPE} does not support the hybrid Mamba/linear-"
                          "attention model JetNemotronForCausalLM: of the hybrids it serves Gated DeltaNet "
                          "ones only (Qwen3NextForCausalLM"), msg
    assert "\n" not in msg
    # a Mamba2 hybrid (SGLang's NemotronH config): refused the same way
    from sglang.srt.configs import NemotronHConfig

    nemotron = SimpleNamespace(hf_config=NemotronHConfig(architectures=["NemotronHForCausalLM"]),
                               is_draft_model=False, linear_attn_registry_result=None)
    msg = refusals.hybrid_linear_problem(nemotron)
    assert msg.startswith(f"--kv-cache-dtype {OSCAR_KV_DTYPE} does not support the hybrid Mamba/linear-"
                          "attention model NemotronHForCausalLM: of the hybrids"), msg


def test_hierarchical_cache_is_refused_for_the_hybrid_in_one_line():
    sa = SimpleNamespace(enable_hierarchical_cache=True, hicache_storage_backend=None)
    with pytest.raises(OscarConfigError) as ei:
        refusals._check_hybrid_features(sa, "Qwen3NextForCausalLM")
    assert _one_line(ei).startswith(f"--enable-hierarchical-cache is not supported with --kv-cache-dtype "
                                    f"{OSCAR_KV_DTYPE}: the INT2 host tier carries plain MHA pools")
    refusals._check_hybrid_features(SimpleNamespace(enable_hierarchical_cache=False,
                                                    hicache_storage_backend=None), "Qwen3NextForCausalLM")


def test_blackwell_is_refused_for_the_hybrid_in_one_line(monkeypatch):
    """SGLang 0.5.17 asserts a short list of attention backends for GDN hybrids on Blackwell
    (attn_backend_wrapper): refused at start-up instead. Mocked: the GPU generation
    (sglang_bridge.is_blackwell), since this machine has none."""
    from sglang_ext import sglang_bridge

    monkeypatch.setattr(sglang_bridge, "is_blackwell", lambda: True)
    cuda = SimpleNamespace(device="cuda", enable_hierarchical_cache=False, hicache_storage_backend=None)
    with pytest.raises(OscarConfigError) as ei:
        refusals._check_hybrid_features(cuda, "Qwen3NextForCausalLM")
    assert _one_line(ei) == (f"--kv-cache-dtype {OSCAR_KV_DTYPE} cannot serve Qwen3NextForCausalLM on this "
                             "Blackwell GPU: SGLang 0.5.17 runs Gated DeltaNet hybrids there with the triton, "
                             "trtllm_mha, fa4 or flashinfer attention backends only, not oscar")
    refusals._check_hybrid_features(SimpleNamespace(**{**vars(cuda), "device": "cpu"}), "Qwen3NextForCausalLM")
    monkeypatch.setattr(sglang_bridge, "is_blackwell", lambda: False)
    refusals._check_hybrid_features(cuda, "Qwen3NextForCausalLM")


# ---------------------------------------------------------------- pool composition and memory

def _configurator(model, rotations, start=0, end=8, page=16, max_running_requests=4):
    """SGLang's KVCacheConfigurator as the plugin's hooks read it, with the real ModelConfig
    and SGLang's own hybrid config (``mambaish_config``) of the model."""
    args = SimpleNamespace(kv_cache_dtype=OSCAR_KV_DTYPE, oscar_rotations=rotations, oscar_sink_tokens=4,
                           oscar_recent_window=8, oscar_sink_slots=None,
                           max_running_requests=max_running_requests, enable_memory_saver=False)
    mc = ModelConfig.from_server_args(ServerArgs(model_path=model, device="cpu", disable_radix_cache=True))
    return SimpleNamespace(server_args=args, model_config=mc, ps=ParallelState.trivial(),
                           layer_info=SimpleNamespace(start_layer=start, end_layer=end,
                                                      num_effective_layers=end - start),
                           pool_page_size=page, device="cpu", mambaish_config=mambaish_config(mc),
                           use_mla_backend=False, is_hybrid_swa=False)


def _hybrid_req_pool(cache_params, rows, context):
    """SGLang's request pool of a hybrid model (req_to_token rows + the MambaPool)."""
    return HybridReqToTokenPool(size=rows - 1, mamba_size=rows, mamba_spec_state_size=rows - 1,
                                max_context_len=context, device="cpu", enable_memory_saver=False,
                                cache_params=cache_params, mamba_layer_ids=list(cache_params.layers),
                                enable_mamba_extra_buffer=False)


@pytest.fixture
def attn_tp1():
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):  # read by mamba2_cache_params
        yield


def test_the_pool_holds_the_full_attention_layers_inside_sglangs_hybrid_pool(tmp_path, attn_tp1):
    from safetensors.torch import load_file

    model, cfg = qwen3_next_dir(tmp_path)
    rot = write_distinct_heads_file(tmp_path / "rot.safetensors", cfg)
    kvc = _configurator(model, rot)
    req_pool = _hybrid_req_pool(kvc.mambaish_config.mamba2_cache_params, rows=5, context=256)

    def sglang_pool(*a, **k):
        raise AssertionError("the oscar hook builds the pool")

    pool = plugin.build_token_to_kv_pool_hook(sglang_pool, kvc, sizes=SimpleNamespace(max_total_num_tokens=256),
                                              req_to_token_pool=req_pool, is_dsa_model=False,
                                              is_dsv4_model=False)
    assert isinstance(pool, HybridLinearKVPool) and isinstance(pool, OscarHybridLinearKVPool)
    full = pool.full_kv_pool
    assert isinstance(full, OscarKVPool) and oscar_pool_of(pool) is full
    assert full.layer_ids == FULL and full.layer_num == 2 and len(full.layers) == 2
    assert pool.mamba_pool is req_pool.mamba_pool  # the Gated DeltaNet state stays SGLang's
    assert full.req_to_token is req_pool.req_to_token  # rings per request row of SGLang's table
    # SGLang's model layer ids reach the cache layer of the same model layer, and only those
    assert pool.get_key_buffer(7) is full.layers[1].k_packed and pool.get_value_buffer(3) is full.layers[0].v_packed
    with pytest.raises(ValueError) as ei:
        pool.get_key_buffer(2)  # a linear-attention layer
    assert _one_line(ei) == "oscar pool: model layer 2 has no INT2 cache here (this pool holds layers 3, 7)"
    assert pool.get_v_head_dim() == 256
    # each cache layer has its model layer's rotations (the file's tensors k_rot.3 and k_rot.7)
    tensors = load_file(rot)
    for i, layer in enumerate(FULL):
        torch.testing.assert_close(full.rotations[i].k_rot, tensors[f"k_rot.{layer}"])
    # memory: the full-attention layers only, exactly what the pool allocates
    plan = plan_for_configurator(kvc)
    assert plan.num_layers == 2 and plan.num_kv_heads == 2 and plan.head_dim == 256
    assert sum(pool.get_kv_size_bytes()) == sum(full.get_kv_size_bytes()) == plan.pool_bytes(256)
    assert pool.mem_usage == pytest.approx(plan.pool_bytes(256) / (1 << 30))


def test_memory_accounting_charges_the_full_attention_layers_only(tmp_path):
    from sglang_ext.pool import memory_plan

    model, cfg = qwen3_next_dir(tmp_path)
    kvc = _configurator(model, write_distinct_heads_file(tmp_path / "rot.safetensors", cfg))
    plan = plan_for_configurator(kvc)
    # the same heads with every layer attention: four times the bytes per token
    dense_cfg = dict(cfg, layer_types=["full_attention"] * 8)
    dense_layout = rank_layout(SimpleNamespace(**{**vars(kvc), "mambaish_config": None}))
    _, meta = load_rank_rotations(write_distinct_heads_file(tmp_path / "dense.safetensors", dense_cfg),
                                  dense_cfg, dense_layout)
    dense = memory_plan(dense_layout, meta, 4, 8, plan.num_rows, None)
    assert dense.num_layers == 8 and plan.num_layers == 2
    assert plan.bytes_per_token * 4 == dense.bytes_per_token
    # SGLang's DefaultPoolConfigurator asks for the cell size of the full-attention layers
    assert plugin.compute_cell_size_hook(None, None, kvc, 2) == plan.bytes_per_token
    # the budget SGLang hands over is already net of its Mamba state (_handle_max_mamba_cache):
    # the hook takes only the oscar reserve off it
    budget = 3 << 30
    assert plugin.profile_available_bytes_hook(budget, kvc) == plan.max_total_tokens(budget) * plan.bytes_per_token
    assert plugin.resolve_max_num_reqs_hook(100, kvc) == 4  # the ring rows reserved (--max-running-requests)


def test_a_pipeline_stage_holds_its_own_full_attention_layers(tmp_path):
    model, cfg = qwen3_next_dir(tmp_path)
    rot = write_distinct_heads_file(tmp_path / "rot.safetensors", cfg)
    kvc = _configurator(model, rot, start=4, end=8)
    layout = rank_layout(kvc)
    assert layout.layer_ids == (7,) and layout.num_layers == 1
    layers, _ = load_rank_rotations(rot, cfg, layout)
    from safetensors.torch import load_file

    torch.testing.assert_close(layers[0].v_rot, load_file(rot)["v_rot.7"])


# ---------------------------------------------------------------- backend dispatch

class LinearStub(AttentionBackend):
    """Stands in for GDNAttnBackend (CUDA + FLA only): records what SGLang's hybrid backend
    hands the linear-attention side."""

    needs_cpu_seq_lens = False

    def __init__(self):
        self.planned, self.calls = [], []

    def init_forward_metadata(self, forward_batch):
        self.planned.append(forward_batch.forward_mode)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.planned.append(("out_graph", forward_batch.forward_mode))

    def init_forward_metadata_in_graph(self, forward_batch):
        self.planned.append(("in_graph", forward_batch.forward_mode))

    def forward_extend(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True, **kw):
        self.calls.append(("extend", layer.layer_id))
        return torch.zeros(1)

    def forward_decode(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True, **kw):
        self.calls.append(("decode", layer.layer_id))
        return torch.zeros(1)


class HybridSim(tb.Sim):
    """tb.Sim over model layers 3 and 7 of an 8-layer Gated DeltaNet hybrid: the OscarKVPool
    inside SGLang's hybrid pool (the MambaPool of a real HybridReqToTokenPool), the oscar
    backend inside SGLang's HybridLinearAttnBackend; every attention call goes through the
    hybrid backend's own dispatch (``forward``)."""

    def __init__(self, **kw):
        config = Qwen3NextConfig(num_hidden_layers=8, full_attention_interval=4, hidden_size=256,
                                 num_attention_heads=tb.HQ, num_key_value_heads=tb.H, head_dim=tb.D,
                                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                                 linear_value_head_dim=32, linear_conv_kernel_dim=4)
        assert tuple(config.full_attention_layer_ids) == FULL
        with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
            self.hybrid_req_pool = _hybrid_req_pool(config.mamba2_cache_params, tb.ROWS, tb.CTX)
        super().__init__(layer_ids=FULL, **kw)
        self.oscar = self.backend
        self.linear = LinearStub()
        self.backend = HybridLinearAttnBackend(self.oscar, self.linear, list(FULL))

    def make_req_to_token(self):
        return self.hybrid_req_pool.req_to_token

    def runner_pool(self):
        self.hybrid_pool = OscarHybridLinearKVPool(self.pool, self.hybrid_req_pool.mamba_pool)
        return self.hybrid_pool

    def attend(self, q, k, v, layer, fb):
        return self.backend.forward(q, k, v, layer, fb)


def _check(sim, outs, row, rid, prefix, positions, content, valid_from):
    for layer, o in zip(sim.layers, outs):
        tb.close(o, sim.expected(row, rid, layer.layer_id, prefix, positions, content, valid_from))


def test_full_attention_layers_go_through_the_oscar_backend_and_match_the_oracle():
    sim = HybridSim()
    assert sim.oscar.pool is sim.pool and sim.oscar.token_to_kv_pool is sim.hybrid_pool
    assert sim.backend.token_to_kv_pool is sim.hybrid_pool  # what SGLang's forward context hands the model
    assert [l.layer_id for l in sim.layers] == list(FULL)
    row, prompt, chunk = 3, 40, 16
    prefill_in_chunks(sim, _check, row, "A", prompt, chunk)  # chunked prefill
    for n in range(prompt + 1, prompt + 4):  # decode, the last step padded like a CUDA-graph batch
        outs = sim.decode([dict(rid="A", row=row, content="A", n=n)], pad_to=3 if n == prompt + 3 else None,
                          in_graph=n == prompt + 3)
        for layer, o in zip(sim.layers, outs):
            tb.close(o, sim.expected_decode(row, "A", layer.layer_id, n, "A", 0))
    # a radix hit: B shares A's first 32 slots (sinks from the shared page, the rest INT2)
    sim.share(4, row, 32)
    outs = sim.extend([dict(rid="B", row=4, content="B", prefix=32, new=8)])
    _check(sim, outs, 4, "B", 32, list(range(32, 40)), "B", 32)
    # the linear side planned every batch and was never handed a full-attention layer
    E, Dm = ForwardMode.EXTEND, ForwardMode.DECODE
    assert sim.linear.planned == [E, E, E, Dm, Dm, ("out_graph", Dm), ("in_graph", Dm), E]
    assert sim.linear.calls == []
    # the INT2 cells written are the model layers' own: layer 7's codes differ from layer 3's
    slots = sim.pool.req_to_token[row, :prompt].long()
    assert not torch.equal(sim.pool.layers[0].k_packed[slots], sim.pool.layers[1].k_packed[slots])


def test_linear_attention_layers_go_to_the_linear_backend_only():
    sim = HybridSim()
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE)
    for layer_id in (0, 1, 2, 4, 5, 6):
        sim.backend.forward(None, None, None, SimpleNamespace(layer_id=layer_id), fb, mixed_qkv=torch.zeros(1, 1))
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    sim.backend.forward(None, None, None, SimpleNamespace(layer_id=5), fb, mixed_qkv=torch.zeros(1, 1))
    assert sim.linear.calls == [("decode", i) for i in (0, 1, 2, 4, 5, 6)] + [("extend", 5)]
    # and the oscar backend refuses a layer its pool does not hold, in one line
    with pytest.raises(ValueError) as ei:
        sim.oscar.pool.cache_layer(5)
    assert "model layer 5 has no INT2 cache here" in _one_line(ei)


def test_backend_from_a_runner_holding_the_hybrid_pool(monkeypatch, tmp_path):
    """SGLang's registry builds the full-attention backend from the model runner, whose pool is
    the hybrid one: the backend serves its OscarKVPool, and the fused RoPE+store kernel stays
    off for the model (it would write BF16 into the packed buffers)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    sim = HybridSim()
    rotations = tmp_path / "r.safetensors"
    rotations.write_bytes(b"")
    runner = SimpleNamespace(
        server_args=SimpleNamespace(kv_cache_dtype=OSCAR_KV_DTYPE, oscar_rotations=str(rotations),
                                    oscar_extend_prefix="bf16", enable_deterministic_inference=False),
        model_config=SimpleNamespace(get_max_num_attention_heads=lambda: tb.HQ, context_len=tb.CTX),
        ps=SimpleNamespace(attn_tp_size=1), token_to_kv_pool=sim.hybrid_pool, req_to_token_pool=sim.hybrid_req_pool,
        model=torch.nn.ModuleList(sim.layers))
    backend = OscarAttnBackend.from_model_runner(runner)
    assert backend.pool is sim.pool and backend.token_to_kv_pool is sim.hybrid_pool
    hybrid = HybridLinearAttnBackend(backend, LinearStub(), list(FULL))
    with forward_context(ForwardContext(attn_backend=hybrid)):
        assert plugin.enable_fused_set_kv_buffer_hook(lambda *a, **k: True) is False
