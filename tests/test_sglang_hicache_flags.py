"""--kv-cache-dtype oscar_int2 with --enable-hierarchical-cache at start-up (CPU, no server):
what the INT2 host tier carries starts (through SGLang's parser, __post_init__ with the
plugin's hooks and check_server_args, ``--device cpu``), the rest is refused in one line that
names the flag and says why; every choice SGLang 0.5.17 offers is one or the other."""
import json

import pytest

from sglang_cases import write_hadamard_file

from sglang_ext.settings import OSCAR_KV_DTYPE, OscarConfigError

pytest.importorskip("sglang")
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402

from sglang_ext import plugin  # noqa: E402

plugin.activate()

HICACHE = ("--enable-hierarchical-cache",)
DIRECT = HICACHE + ("--hicache-io-backend", "direct")


@pytest.fixture
def tiny_rot(tmp_path, real_model_dir):
    cfg = json.loads((real_model_dir / "config.json").read_text())
    return write_hadamard_file(tmp_path / "tiny.safetensors", cfg, group_size=32)


def prepare(real_model_dir, rot, *extra):
    sa = prepare_server_args(["--model-path", str(real_model_dir), "--device", "cpu",
                              "--kv-cache-dtype", OSCAR_KV_DTYPE, "--oscar-rotations", rot, *extra])
    sa.check_server_args()
    return sa


def refusal(real_model_dir, rot, *extra) -> str:
    with pytest.raises(OscarConfigError) as ei:
        prepare(real_model_dir, rot, *extra)
    msg = str(ei.value)
    assert msg and "\n" not in msg, msg
    assert OSCAR_KV_DTYPE in msg
    return msg


@pytest.mark.parametrize("extra,layout", [
    (DIRECT, "page_first_direct"),  # SGLang's default layout page_first, switched for direct io
    (DIRECT + ("--hicache-mem-layout", "layer_first"), "layer_first"),
    (HICACHE + ("--hicache-mem-layout", "page_first_direct"), "page_first_direct"),  # io -> direct
    (DIRECT + ("--hicache-write-policy", "write_back", "--hicache-size", "2"), "page_first_direct"),
    (DIRECT + ("--hicache-write-policy", "write_through_selective", "--hicache-ratio", "4"),
     "page_first_direct"),
    (DIRECT + ("--hicache-mem-layout", "layer_first", "--hicache-storage-backend", "file"), "layer_first"),
])
def test_what_the_int2_host_tier_carries_starts(extra, layout, real_model_dir, tiny_rot):
    sa = prepare(real_model_dir, tiny_rot, *extra)
    assert sa.enable_hierarchical_cache and sa.kv_cache_dtype == OSCAR_KV_DTYPE
    assert (sa.hicache_io_backend, sa.hicache_mem_layout) == ("direct", layout)
    assert sa.attention_backend == "oscar"


@pytest.mark.parametrize("extra,match", [
    (HICACHE, "--hicache-io-backend kernel (SGLang's default for --enable-hierarchical-cache) cannot "
              "carry oscar_int2 cells (its kernels copy one contiguous BF16 token row per K/V buffer; "
              "the cells are head-major codes and scales): add --hicache-io-backend direct"),
    (HICACHE + ("--hicache-mem-layout", "layer_first"), "add --hicache-io-backend direct"),
    (HICACHE + ("--hicache-io-backend", "kernel_ascend"), "--hicache-io-backend kernel_ascend is not "
                                                          "supported with oscar_int2 (its transfers copy"),
    (DIRECT + ("--hicache-mem-layout", "page_first_kv_split"),
     "--hicache-mem-layout page_first_kv_split is not supported with oscar_int2 (it stores a page's "
     "K and V halves apart"),
    (DIRECT + ("--hicache-mem-layout", "page_head"), "--hicache-mem-layout page_head is not supported"),
    (DIRECT + ("--hicache-storage-backend", "mooncake"),
     "--hicache-storage-backend mooncake is not supported with oscar_int2 (its transfers address "
     "BF16 K/V pages; use file, which writes the cells' bytes)"),
    (DIRECT + ("--hicache-storage-backend", "hf3fs"), "--hicache-storage-backend hf3fs is not supported"),
])
def test_what_it_cannot_carry_is_refused_in_one_line(extra, match, real_model_dir, tiny_rot):
    assert match in refusal(real_model_dir, tiny_rot, *extra)


def _choices(flag):
    import argparse

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p._option_string_actions[flag].choices


def test_every_sglang_choice_is_served_or_refused_naming_it():
    """All io backends, layouts and storage backends of 0.5.17's parser, each with the others
    at a served value: served exactly for direct io, the two cell layouts (and page_first,
    which SGLang turns into page_first_direct for direct io) and the file backend."""
    from types import SimpleNamespace

    from sglang_ext.host_pool import hicache_refusal

    base = dict(hicache_io_backend="direct", hicache_mem_layout="layer_first", hicache_storage_backend=None)
    served = {"hicache_io_backend": {"direct"},
              "hicache_mem_layout": {"layer_first", "page_first_direct", "page_first"},
              "hicache_storage_backend": {"file"}}
    flags = {"hicache_io_backend": "--hicache-io-backend", "hicache_mem_layout": "--hicache-mem-layout",
             "hicache_storage_backend": "--hicache-storage-backend"}
    for field, flag in flags.items():
        choices = _choices(flag)
        assert served[field] <= set(choices)
        for value in choices:
            why = hicache_refusal(SimpleNamespace(**{**base, field: value}))
            if value in served[field]:
                assert why is None, (field, value, why)
            else:
                assert why and "\n" not in why and f"{flag} {value} " in why, (field, value, why)
