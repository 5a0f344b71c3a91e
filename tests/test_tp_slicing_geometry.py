"""Tensor-parallel slicing of every calibration/architectures.py geometry on CPU (issue 30):
for tp 1, 2, 4, 8 (and 3, 6, which most rows cannot split), the KV heads each attention-TP
rank holds (oscar_kernels.contract.model_shape.kv_heads_for_rank) are the ones SGLang
0.5.17's own QKVParallelLinear loads onto that rank; the pool's RankLayout (from SGLang's
ModelConfig) and load_rank_rotations give each rank exactly those heads' matrices
(blocks of H / tp heads, or one head replicated on tp / H consecutive ranks); a split
SGLang cannot make is refused at start-up in one line. Model folders hold a config.json
only; nothing is downloaded."""
from types import SimpleNamespace

import pytest
import torch

from calibration import architectures
from sglang_cases import write_distinct_heads_file

from oscar_kernels.contract.model_shape import ModelShape, kv_heads_for_rank
from oscar_kernels.contract.rotations_file import load_rotations
from sglang_ext.settings import OSCAR_KV_DTYPE, OscarConfigError

pytest.importorskip("sglang")
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.linear import QKVParallelLinear  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from sglang_ext import plugin, refusals  # noqa: E402
from sglang_ext.pool import load_rank_rotations, rank_layout  # noqa: E402

plugin.activate()

TP_SIZES = (1, 2, 3, 4, 6, 8)
_HEAD_SIZE = 4  # of the probe QKVParallelLinear: the head split does not depend on it


@pytest.fixture(scope="module")
def row_folder(tmp_path_factory):
    """name -> (model folder with config.json, rotations file with distinct matrices per
    (layer, KV head), the config as a dict), made once per row."""
    made = {}

    def get(arch):
        if arch.name not in made:
            folder = tmp_path_factory.mktemp(arch.name)
            cfg = architectures.hf_config(arch, architectures.TOKENIZER_VOCAB)
            cfg.save_pretrained(folder)
            rot = write_distinct_heads_file(folder / "rot.safetensors", cfg.to_dict(), group_size=16, seed=1)
            made[arch.name] = (str(folder), rot, cfg.to_dict())
        return made[arch.name]
    return get


def sglang_split(num_q_heads: int, num_kv_heads: int, tp: int):
    """Per rank (query heads, [KV heads]) as SGLang's QKVParallelLinear loads them: the
    checkpoint's k_proj rows of head i hold i + 1, and the rank's k shard is read back.
    None when SGLang cannot split the heads over tp (its divide() asserts)."""
    full_k = (torch.arange(num_kv_heads) + 1).repeat_interleave(_HEAD_SIZE)[:, None].float().expand(-1, 8)
    out = []
    for rank in range(tp):
        try:
            lin = QKVParallelLinear(8, _HEAD_SIZE, num_q_heads, num_kv_heads, bias=False, tp_rank=rank, tp_size=tp)
        except AssertionError:
            return None
        lin.weight_loader(lin.weight, full_k.contiguous(), "k")
        start = lin.num_heads * _HEAD_SIZE
        rows = lin.weight[start:start + lin.num_kv_heads * _HEAD_SIZE:_HEAD_SIZE, 0]
        out.append((lin.num_heads, [int(x) - 1 for x in rows]))
    return out


def _configurator(model_config, tp: int, rank: int):
    """What pool.rank_layout reads of SGLang's KVCacheConfigurator."""
    return SimpleNamespace(model_config=model_config, pool_page_size=64,
                           layer_info=SimpleNamespace(start_layer=0, num_effective_layers=architectures.LAYERS),
                           ps=SimpleNamespace(attn_tp_size=tp, attn_tp_rank=rank), mambaish_config=None, is_hybrid_swa=False)


def _kernels_serve(head_dim: int) -> bool:
    return head_dim >= 64 and head_dim & (head_dim - 1) == 0


def test_probe_reads_sglangs_split():
    """The probe itself: 32 query / 2 KV heads over 4 ranks, each KV head on 2 ranks."""
    assert sglang_split(32, 2, 4) == [(8, [0]), (8, [0]), (8, [1]), (8, [1])]
    assert sglang_split(32, 8, 2) == [(16, [0, 1, 2, 3]), (16, [4, 5, 6, 7])]
    assert sglang_split(28, 4, 8) is None and sglang_split(32, 8, 3) is None


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("arch", architectures.ARCHITECTURES, ids=lambda a: a.name)
def test_rank_slices_match_sglang_or_are_refused(arch, tp, row_folder):
    folder, rot_path, cfg = row_folder(arch)
    shape = ModelShape.from_hf_config(cfg)
    q, kv = shape.num_q_heads, shape.num_kv_heads
    sglang = sglang_split(q, kv, tp)
    if sglang is None:  # SGLang cannot split: one line at start-up, never a partial pool
        with pytest.raises(ValueError) as ei:
            refusals.check_tp_split(shape, tp)
        assert "\n" not in str(ei.value) and f"tp_size {tp}" in str(ei.value)
        if _kernels_serve(shape.head_dim):  # (Phi-3 is refused for its head_dim first)
            with pytest.raises(OscarConfigError) as ei:
                prepare_server_args(["--model-path", folder, "--device", "cpu", "--kv-cache-dtype", OSCAR_KV_DTYPE,
                                     "--oscar-rotations", rot_path, "--tp-size", str(tp)])
            msg = str(ei.value)
            assert "\n" not in msg and msg.startswith(f"--tp-size {tp}: ")
        return

    ours = [kv_heads_for_rank(kv, tp, r) for r in range(tp)]
    assert ours == [heads for _, heads in sglang]
    assert all(nq == q // tp for nq, _ in sglang)
    if tp <= kv:  # blocks of kv / tp heads, every head on one rank
        assert sum(ours, []) == list(range(kv)) and {len(h) for h in ours} == {kv // tp}
    else:  # one head per rank, each on tp / kv consecutive ranks
        assert ours == [[r // (tp // kv)] for r in range(tp)]
    refusals.check_tp_split(shape, tp)  # accepted

    model_config = ModelConfig(folder)
    full = load_rotations(rot_path)
    for rank in range(tp):
        layout = rank_layout(_configurator(model_config, tp, rank))
        assert layout.num_kv_heads == len(ours[rank]) and layout.head_dim == shape.head_dim
        assert (q // tp) % layout.num_kv_heads == 0  # the kernels' query heads per KV head on this rank
        layers, meta = load_rank_rotations(rot_path, cfg, layout)
        assert meta.num_kv_heads == len(ours[rank]) and len(layers) == architectures.LAYERS
        for got, want in zip(layers, full.layers):
            assert torch.equal(got.k_rot, want.k_rot[ours[rank]]) and torch.equal(got.v_rot, want.v_rot[ours[rank]])
            assert got.k_clip_min.shape == (len(ours[rank]), shape.head_dim)
    if _kernels_serve(shape.head_dim) and tp in (2, 8):  # the whole start-up path accepts it
        sa = prepare_server_args(["--model-path", folder, "--device", "cpu", "--kv-cache-dtype", OSCAR_KV_DTYPE,
                                  "--oscar-rotations", rot_path, "--tp-size", str(tp)])
        assert sa.tp_size == tp and sa.attention_backend == "oscar"


def test_replicated_heads_carry_their_own_matrices(row_folder):
    """GLM-4's 2 KV heads over 8 ranks: ranks 0-3 hold head 0's matrices, 4-7 head 1's
    (distinct per head, so a rank holding its neighbour's would show)."""
    arch = architectures.get("glm-4-9b-0414")
    folder, rot_path, cfg = row_folder(arch)
    model_config = ModelConfig(folder)
    full = load_rotations(rot_path)
    assert not torch.equal(full.layers[0].k_rot[0], full.layers[0].k_rot[1])
    for rank in range(8):
        layers, _ = load_rank_rotations(rot_path, cfg, rank_layout(_configurator(model_config, 8, rank)))
        assert torch.equal(layers[1].v_rot[0], full.layers[1].v_rot[rank // 4])
