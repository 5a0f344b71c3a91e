"""OscarHostKVPool (HiCache host tier of the INT2 cells) on CPU: layout, byte accounting,
device (a CPU OscarKVPool stands in for GPU memory) <-> host transfers, flat pages, refusals."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_ext.host_pool import (OscarHostKVPool, cell_layout, device_byte_views,  # noqa: E402
                                  get_mha_host_pool_cls_hook, hicache_refusal, storage_config_hook)
from sglang_ext.memory import bf16_bytes_per_token  # noqa: E402
from sglang_ext.pool import OscarKVPool  # noqa: E402

LAYOUTS = ("layer_first", "page_first_direct")
SEGMENTS = ("k_packed", "v_packed", "k_scales", "v_scales")


def device_pool(size=256, page=16, layers=3, heads=2, dim=64, group=32, seed=0, **kw):
    from oscar_kernels.testing import random_rotation

    g = torch.Generator().manual_seed(seed)
    rots = [random_rotation(heads, dim, g) for _ in range(layers)]
    r2t = torch.zeros(5, 4 * page, dtype=torch.int32)
    pool = OscarKVPool(size, page, heads, dim, layers, "cpu", rotations=rots, req_to_token=r2t,
                       sink_tokens=min(4, page), recent_window=8, group_size=group, **kw)
    randomize(pool, seed + 1)
    return pool


def randomize(pool, seed):
    """Random bytes in every INT2 cell (any float8/float16 bit pattern, NaNs included) and in
    the BF16 side caches."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.layer_num):
        for view in device_byte_views(pool, layer).values():
            view.copy_(torch.randint(0, 256, view.shape, generator=g, dtype=torch.uint8))
        lc = pool.layers[layer]
        for t in (lc.k_sink, lc.v_sink, lc.k_ring, lc.v_ring):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def cells(pool, layer, slots):
    """uint8 bytes of the cells at ``slots``: {segment: [n, H, bytes per head]}."""
    idx = torch.as_tensor(slots, dtype=torch.long)
    return {k: v.index_select(0, idx).clone() for k, v in device_byte_views(pool, layer).items()}


def snapshot(pool):
    """Every byte of the device pool: cells, BF16 side caches, sink index."""
    out = {}
    for layer, lc in enumerate(pool.layers):
        for k, v in device_byte_views(pool, layer).items():
            out[(layer, k)] = v.clone()
        for k in ("k_sink", "v_sink", "k_ring", "v_ring"):
            out[(layer, k)] = getattr(lc, k).clone()
    out["sink_slot_of_page"] = pool.index.sink_slot_of_page.clone()
    out["page_of_sink_slot"] = pool.index.page_of_sink_slot.clone()
    return out


def host_pool(dev, layout="layer_first", ratio=2.0, size_gb=0, cls=OscarHostKVPool):
    return cls(dev, ratio, size_gb, dev.page_size, layout)


def page_slots(pages, page):
    return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages])


# ---------------------------------------------------------------- layout and bytes

@pytest.mark.parametrize("scale_dtype", ["float8_e4m3fn", "float16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_per_token_are_the_device_int2_cells(layout, scale_dtype):
    dev = device_pool(scale_dtype=scale_dtype, value_group_size=64)
    host = host_pool(dev, layout)
    per_slot = sum(v[0].numel() for lc_i in range(dev.layer_num)
                   for v in device_byte_views(dev, lc_i).values())
    e = 1 if scale_dtype.startswith("float8") else 2
    # keys G=32, values G=64, D=64: codes 16 + 16, scales (2 + 1) groups x (scale, min) x e
    assert host.size_per_token == per_slot == dev.plan.bytes_per_token == 3 * 2 * (32 + 3 * 2 * e)
    assert host.layer_cells == [cell_layout(dev)] * 3 and host.row_bytes == 2 * (32 + 6 * e)
    # the host holds only the cells: one uint8 tensor of size x bytes per token, no BF16
    assert host.kv_buffer.dtype == torch.uint8
    assert host.kv_buffer.numel() == host.size * host.size_per_token
    shape = ((3, host.size, host.row_bytes) if layout == "layer_first" else
             (host.page_num, 3, 16, host.row_bytes))
    assert tuple(host.kv_buffer.shape) == shape and host.kv_buffer.is_contiguous()
    tensors = [v for v in vars(host).values() if isinstance(v, torch.Tensor)]
    assert not any(t.dtype in (torch.bfloat16, torch.float16, torch.float32) for t in tensors)
    assert bf16_bytes_per_token(3, 2, 64) / host.size_per_token > 5


def test_size_follows_hicache_ratio_and_size_like_bf16():
    dev = device_pool(size=256, page=16)
    by_ratio = host_pool(dev, ratio=3.0)
    # HostKVCache's rule: size = device tokens x ratio, rounded to whole pages (+1 page)
    assert by_ratio.size == (int(256 * 3.0) // 16 + 1) * 16 and by_ratio.page_num == by_ratio.size // 16
    gb = 1  # --hicache-size GB / true bytes per token
    by_size = host_pool(dev, size_gb=gb)
    tokens = int(gb * 1e9 // dev.plan.bytes_per_token)
    assert by_size.size == (tokens // 16 + 1) * 16
    assert by_size.kv_buffer.numel() == by_size.size * dev.plan.bytes_per_token


# ---------------------------------------------------------------- transfers

def round_trip(cls, page, layout, dev_pages_src, dev_pages_dst, seed=3, **pool_kw):
    dev = device_pool(size=max(8 * page, 256), page=page, seed=seed, **pool_kw)
    host = host_pool(dev, layout, ratio=2.0, cls=cls)
    src = page_slots(dev_pages_src, page)
    want = [cells(dev, layer, src) for layer in range(dev.layer_num)]
    hidx = host.alloc(len(src))
    host.backup_from_device_all_layer(dev, hidx, src, "direct")
    randomize(dev, seed + 100)  # the device forgets the cells
    dst = page_slots(dev_pages_dst, page)
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, hidx, dst, layer, "direct")
    return dev, host, [cells(dev, layer, dst) for layer in range(dev.layer_num)], want


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page", [1, 64])
def test_round_trip_is_bit_exact(page, layout):
    """Cells of scattered device pages -> host -> other device pages: every byte of codes and
    scales (float8, random bit patterns) comes back."""
    src_pages, dst_pages = [5, 1, 6, 2], [3, 7, 4, 1]
    if page == 1:  # single slots, unsorted, with host slots not in one run
        src_pages, dst_pages = [9, 3, 250, 77, 128, 4, 5], [200, 17, 18, 90, 31, 2, 6]
    dev, host, got, want = round_trip(OscarHostKVPool, page, layout, src_pages, dst_pages)
    assert dev.layers[0].k_scales.dtype == torch.float8_e4m3fn
    for layer in range(dev.layer_num):
        for seg in SEGMENTS:
            assert torch.equal(got[layer][seg], want[layer][seg]), (layer, seg)


class _ScalesLost(OscarHostKVPool):
    """A host pool whose backup carries the codes only (what SGLang's MHA host pool would do
    with k_buffer/v_buffer): the host's scale bytes stay as they were (zero)."""

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        scales_at = self.layer_cells[0].segments[2][1]
        self.kv_buffer[..., scales_at:] = 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_layer_key_groups_round_trip_in_rows_of_the_widest_cell(layout):
    """Keys in groups of 8, 32 and 16 on the three layers: each layer's cell fills the first bytes
    of a host row as wide as the widest (layer 0's), and every byte comes back."""
    dev, host, got, want = round_trip(OscarHostKVPool, 16, layout, [5, 1], [3, 7], key_group_sizes=(8, 32, 16))
    assert [lc.key_group_size for lc in dev.layers] == [8, 32, 16]
    widths = [c.bytes_per_layer for c in host.layer_cells]  # codes 2 x 2 x 16, scales (64/G_K + 2) x 2 x 2 heads
    assert widths == [2 * 32 + 4 * (8 + 2), 2 * 32 + 4 * (2 + 2), 2 * 32 + 4 * (4 + 2)]
    assert host.row_bytes == max(widths) and host.size_per_token == 3 * max(widths)
    assert dev.plan.bytes_per_token == sum(widths)
    for layer in range(dev.layer_num):
        for seg in SEGMENTS:
            assert torch.equal(got[layer][seg], want[layer][seg]), (layer, seg)


def test_round_trip_check_catches_lost_scales():
    """Negative control: the round-trip comparison fails when the scales are not carried."""
    dev, host, got, want = round_trip(_ScalesLost, 64, "layer_first", [5, 1], [3, 7])
    assert all(torch.equal(got[0][s], want[0][s]) for s in ("k_packed", "v_packed"))
    assert not torch.equal(got[0]["k_scales"], want[0]["k_scales"])
    assert not torch.equal(got[0]["v_scales"], want[0]["v_scales"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_load_touches_only_that_layer_and_those_slots(layout):
    page = 16
    dev = device_pool(size=128, page=page, seed=7)
    host = host_pool(dev, layout)
    src = page_slots([2, 5], page)
    hidx = host.alloc(len(src))
    host.backup_from_device_all_layer(dev, hidx, src, "direct")
    want = cells(dev, 1, src)
    randomize(dev, 8)
    # a sink slot mapped to a destination page (left by another sequence) and one elsewhere
    dev.index.sink_slot_of_page[3] = 0
    dev.index.page_of_sink_slot[0] = 3
    dev.index.sink_slot_of_page[6] = 1
    dev.index.page_of_sink_slot[1] = 6
    before = snapshot(dev)
    dst = page_slots([3, 7], page)
    host.load_to_device_per_layer(dev, hidx, dst, 1, "direct")
    after = snapshot(dev)
    got = cells(dev, 1, dst)
    assert all(torch.equal(got[s], want[s]) for s in SEGMENTS)
    others = torch.ones(dev.layers[1].k_packed.shape[0], dtype=torch.bool)
    others[dst] = False
    for key, old in before.items():
        if isinstance(key, tuple) and key[0] == 1 and key[1] in SEGMENTS:
            assert torch.equal(after[key][others], old[others]), key  # only the loaded slots
            assert not torch.equal(after[key][dst], old[dst]), key
        else:
            assert torch.equal(after[key], old), key  # other layers, BF16 caches, sink index
    # layer 0 of the same load also drops the loaded pages from the sink index, only them
    host.load_to_device_per_layer(dev, hidx, dst, 0, "direct")
    sinks = dev.index.sink_slot_of_page
    assert int(sinks[3]) == -1 and int(sinks[7]) == -1 and int(sinks[6]) == 1
    assert torch.equal(dev.index.page_of_sink_slot, before["page_of_sink_slot"])


def test_indices_on_any_device_and_dtype_and_sorted_host_order():
    """The controller hands int64 host indices (sorted for layer_first, device indices
    permuted alike) and CPU device indices for 'direct'; int32 works too."""
    dev = device_pool(size=64, page=1, seed=11)
    host = host_pool(dev)
    src = torch.tensor([40, 3, 17, 9], dtype=torch.int32)
    hidx = host.alloc(4)
    host.backup_from_device_all_layer(dev, hidx, src, "direct")
    order = torch.argsort(hidx, descending=True)
    want = cells(dev, 2, src[order].long())
    randomize(dev, 12)
    dst = torch.tensor([5, 6, 7, 8])
    host.load_to_device_per_layer(dev, hidx[order], dst, 2, "direct")
    got = cells(dev, 2, dst)
    assert all(torch.equal(got[s], want[s]) for s in SEGMENTS)
    with pytest.raises(ValueError, match="host slots for"):
        host.load_to_device_per_layer(dev, hidx[:3], dst, 0, "direct")


def test_alloc_and_free_are_sglangs_page_allocator():
    dev = device_pool(size=64, page=16)
    host = host_pool(dev, ratio=1.0)
    total = host.available_size()
    assert total == host.size
    a = host.alloc(32)
    assert a.numel() == 32 and host.available_size() == total - 32
    host.free(a)
    assert host.available_size() == total


# ---------------------------------------------------------------- sinks of a page loaded back

SINK_PAGE = 16


def forget_cells(pool, slots, seed):
    """Random bytes in the INT2 cells at ``slots`` only (the BF16 sinks stay)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.as_tensor(slots, dtype=torch.long)
    for layer in range(pool.layer_num):
        for view in device_byte_views(pool, layer).values():
            view[idx] = torch.randint(0, 256, view[idx].shape, generator=g, dtype=torch.uint8)


def start_sequence(pool, first_page):
    """A sequence computed from position 0 on ``first_page``: the backend hands it a sink
    slot (hybrid_cache.assign_sink_slots, round-robin); returns the slot."""
    from oscar_kernels.hybrid_cache import assign_sink_slots, sink_slot_for

    first = torch.tensor([first_page * pool.page_size])
    assign_sink_slots(pool.index, first, pool.plan.num_sink_slots)
    return int(sink_slot_for(pool.index, first)[0])


def read_keys(pool, pages, layer):
    """Keys and values of a sequence on ``pages`` as the kernels read them (the read rule,
    reference.hybrid_kv), the ring out of the way: [n, H, D] float32 each."""
    from oscar_kernels.reference import hybrid_kv

    slots = page_slots(pages, pool.page_size)
    pool.req_to_token[1, :len(slots)] = slots.int()
    pool.index.ring_valid_from[1] = len(slots)
    return hybrid_kv(pool.layers[layer], pool.index, pool.req_to_token, 1, len(slots))


def int2_keys(pool, pages, layer):
    from oscar_kernels.int2 import dequantise, unpack

    lc, slots = pool.layers[layer], page_slots(pages, pool.page_size)
    return (dequantise(unpack(lc.k_packed[slots]), lc.k_scales[slots]),
            dequantise(unpack(lc.v_packed[slots]), lc.v_scales[slots]))


def bits_equal(a, b):
    """float32 tensors equal bit for bit (the random cells decode to NaNs too)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def backup(host, dev, pages):
    hidx = host.alloc(len(pages) * dev.page_size)
    host.backup_from_device_all_layer(dev, hidx, page_slots(pages, dev.page_size), "direct")
    return hidx


def load(host, dev, hidx, pages):
    dst = page_slots(pages, dev.page_size)
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, hidx, dst, layer, "direct")


def sink_of(dev, page):
    from oscar_kernels.hybrid_cache import sink_slot_for

    return int(sink_slot_for(dev.index, torch.tensor([page * dev.page_size]))[0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loaded_first_page_reads_its_bf16_sinks_while_the_slot_holds_them(layout):
    """A sequence's pages go to host and come back on other device pages; nobody was given
    its sink slot meanwhile (a new sequence took the next one): positions < S read the very
    BF16 sinks the sequence computed, the rest its INT2 cells, as if it had never left."""
    dev = device_pool(size=256, page=SINK_PAGE, seed=31)
    host = host_pool(dev, layout)
    c = start_sequence(dev, 2)
    s = dev.layers[0].sink_tokens
    want = [read_keys(dev, [2, 5], layer) for layer in range(dev.layer_num)]
    sinks = [(lc.k_sink[c].clone(), lc.v_sink[c].clone()) for lc in dev.layers]
    hidx = backup(host, dev, [2, 5])
    forget_cells(dev, page_slots([2, 5], SINK_PAGE), 32)  # the device pages go to others
    assert start_sequence(dev, 9) != c  # a new sequence, another slot
    load(host, dev, hidx, [6, 3])
    assert sink_of(dev, 6) == c and int(dev.index.sink_slot_of_page[3]) == -1
    assert sink_of(dev, 9) >= 0  # the other sequence keeps its own slot
    for layer in range(dev.layer_num):
        k, v = read_keys(dev, [6, 3], layer)
        assert bits_equal(k, want[layer][0]) and bits_equal(v, want[layer][1]), layer
        # bit for bit the BF16 sinks the sequence wrote (not their INT2 cells)
        k_sink, v_sink = sinks[layer]
        assert torch.equal(k[:s].bfloat16(), k_sink) and torch.equal(v[:s].bfloat16(), v_sink)
        assert not bits_equal(k[:s], int2_keys(dev, [6], layer)[0][:s])


@pytest.mark.parametrize("owner_backed_up", [False, True])
def test_loaded_first_page_reads_int2_when_its_sink_slot_was_handed_out_since(owner_backed_up):
    """Every sink slot handed out again between backup and load (round-robin): the loaded
    first page reads INT2 below S, and the slot's new owner keeps reading its sinks (also
    when the new owner went to host too and comes back: then it gets the slot)."""
    dev = device_pool(size=512, page=SINK_PAGE, seed=33)
    host = host_pool(dev)
    c = start_sequence(dev, 2)
    hidx = backup(host, dev, [2, 5])
    forget_cells(dev, page_slots([2, 5], SINK_PAGE), 34)
    owners = [start_sequence(dev, 8 + i) for i in range(dev.plan.num_sink_slots)]
    assert c in owners
    owner = 8 + owners.index(c)
    if owner_backed_up:
        h_owner = backup(host, dev, [owner])
    load(host, dev, hidx, [6, 3])
    assert sink_of(dev, 6) == -1 and sink_of(dev, owner) == c
    for layer in range(dev.layer_num):
        k, v = read_keys(dev, [6, 3], layer)
        ik, iv = int2_keys(dev, [6, 3], layer)
        assert bits_equal(k, ik) and bits_equal(v, iv), layer
    if owner_backed_up:
        load(host, dev, h_owner, [7])
        assert sink_of(dev, 7) == c and sink_of(dev, 6) == -1


@pytest.mark.parametrize("first_loaded", ["sequence", "reused page"])
def test_a_freed_first_page_reused_mid_sequence_does_not_take_the_sinks(first_loaded):
    """SGLang frees a device page without telling the sink index: a sequence's first page,
    backed up, freed and taken as the middle page of another sequence still looks mapped to
    the old slot. Backed up and loaded again, that middle page gets no sinks, and the first
    sequence, loaded before or after it, keeps them."""
    dev = device_pool(size=256, page=SINK_PAGE, seed=35)
    host = host_pool(dev)
    c = start_sequence(dev, 2)
    sinks = dev.layers[0].k_sink[c].clone()
    h_first = backup(host, dev, [2, 5])
    forget_cells(dev, page_slots([2, 5], SINK_PAGE), 36)
    h_mid = backup(host, dev, [4, 2])  # another sequence [4, 2]; page 2 keeps its old mapping
    loads = [(h_first, [6, 3]), (h_mid, [7, 1])]
    for hidx, pages in (loads if first_loaded == "sequence" else loads[::-1]):
        load(host, dev, hidx, pages)
    assert sink_of(dev, 6) == c and int(dev.index.sink_slot_of_page[1]) == -1
    s = dev.layers[0].sink_tokens
    assert torch.equal(read_keys(dev, [6, 3], 0)[0][:s].bfloat16(), sinks)


def test_a_freed_host_page_forgets_its_sink_slot():
    """Host pages freed (and refilled, e.g. from storage) load back without sinks."""
    dev = device_pool(size=256, page=SINK_PAGE, seed=37)
    host = host_pool(dev)
    start_sequence(dev, 2)
    hidx = backup(host, dev, [2, 5])
    host.free(hidx)
    assert int((host.sink_of_host_page >= 0).sum()) == 0
    load(host, dev, hidx, [6, 3])
    assert sink_of(dev, 6) == -1


# ---------------------------------------------------------------- flat pages (file storage)

def test_flat_pages_are_layout_independent_and_round_trip(tmp_path, monkeypatch):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    page = 16
    dev = device_pool(size=64, page=page, seed=21)
    lf, pf = host_pool(dev, "layer_first"), host_pool(dev, "page_first_direct")
    src = page_slots([1, 3], page)
    want = [cells(dev, layer, src) for layer in range(dev.layer_num)]
    h_lf, h_pf = lf.alloc(32), pf.alloc(32)
    lf.backup_from_device_all_layer(dev, h_lf, src, "direct")
    pf.backup_from_device_all_layer(dev, h_pf, src, "direct")
    for i in (0, 16):
        a, b = lf.get_data_page(h_lf[i]), pf.get_data_page(h_pf[i])
        assert a.dtype == torch.uint8 and a.numel() == dev.plan.bytes_per_token * page
        assert torch.equal(a, b)
    assert torch.equal(lf.get_dummy_flat_data_page(), torch.zeros_like(a))
    # through SGLang's file backend: written from the layer_first pool, read into a fresh one
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=False, model_name="m")
    store = HiCacheFile(cfg, file_path=str(tmp_path / "hicache"))
    assert store.batch_set(["p0", "p1"], [lf.get_data_page(h_lf[0]), lf.get_data_page(h_lf[16])])
    fresh = host_pool(dev, "page_first_direct")
    h_new = fresh.alloc(32)
    got_pages = store.batch_get(["p0", "p1"], [fresh.get_dummy_flat_data_page() for _ in range(2)])
    for i, data in zip((0, 16), got_pages):
        fresh.set_from_flat_data_page(h_new[i], data)
    randomize(dev, 22)
    dst = page_slots([0, 2], page)
    for layer in range(dev.layer_num):
        fresh.load_to_device_per_layer(dev, h_new, dst, layer, "direct")
        got = cells(dev, layer, dst)
        assert all(torch.equal(got[s], want[layer][s]) for s in SEGMENTS), layer


# ---------------------------------------------------------------- refusals and hooks

@pytest.mark.parametrize("layout", ["page_first", "page_first_kv_split", "page_head"])
def test_unsupported_layouts_refused_in_one_line(layout):
    with pytest.raises(NotImplementedError) as e:
        host_pool(device_pool(), layout)
    assert "\n" not in str(e.value) and layout in str(e.value)


def test_kernel_io_and_zero_copy_storage_refused_in_one_line():
    dev = device_pool()
    host = host_pool(dev)
    hidx, didx = host.alloc(16), torch.arange(16, 32)
    for call in (lambda: host.backup_from_device_all_layer(dev, hidx, didx, "kernel"),
                 lambda: host.load_to_device_per_layer(dev, hidx, didx, 0, "kernel"),
                 lambda: host.load_to_device_per_layer(dev, hidx, didx, 0, "kernel_ascend"),
                 lambda: host.get_page_buffer_meta(hidx),
                 lambda: host.get_ksize_per_token(),
                 lambda: host.get_split_heads_page_buffer_meta(hidx, 2)):
        with pytest.raises(NotImplementedError) as e:
            call()
        assert "\n" not in str(e.value) and "oscar_int2" in str(e.value)
    with pytest.raises(TypeError, match="needs an OscarKVPool"):
        OscarHostKVPool(SimpleNamespace(), 2.0, 0, 16, "layer_first")


@pytest.mark.parametrize("args,ok", [
    (dict(hicache_io_backend="direct", hicache_mem_layout="layer_first"), True),
    (dict(hicache_io_backend="direct", hicache_mem_layout="page_first"), True),  # SGLang -> _direct
    (dict(hicache_io_backend="direct", hicache_mem_layout="page_first_direct",
          hicache_storage_backend="file"), True),
    (dict(hicache_io_backend="kernel", hicache_mem_layout="page_first"), False),  # SGLang defaults
    (dict(hicache_io_backend="direct", hicache_mem_layout="page_head"), False),
    (dict(hicache_io_backend="direct", hicache_mem_layout="layer_first",
          hicache_storage_backend="mooncake"), False),
])
def test_start_up_refusal_line(args, ok):
    reason = hicache_refusal(SimpleNamespace(**{"hicache_storage_backend": None, **args}))
    assert (reason is None) == ok
    if not ok:
        assert "\n" not in reason and "oscar_int2" in reason


def test_hooks_pick_the_oscar_host_pool_and_name_its_storage():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    dev = device_pool()
    other = SimpleNamespace()
    assert get_mha_host_pool_cls_hook(lambda p: "sglang's", dev) is OscarHostKVPool
    assert get_mha_host_pool_cls_hook(lambda p: "sglang's", other) == "sglang's"
    # built the way HiRadixCache.__init__ calls the class it gets
    built = get_mha_host_pool_cls_hook(lambda p: None, dev)(dev, 2.0, 0, dev.page_size,
                                                            "layer_first", allocator_type="file")
    assert built.size_per_token == dev.plan.bytes_per_token and built.available_size() == built.size
    cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, False, "org/model")
    host = host_pool(dev)
    named = storage_config_hook(cfg, SimpleNamespace(mem_pool_host=host), "org/model", {})
    assert named.model_name.startswith("org/model-oscar_int2-L3H2D64g32v32-float8_e4m3fn-")
    assert storage_config_hook(cfg, SimpleNamespace(mem_pool_host=object()), "m", {}) is None
    # other rotations: another name (their cells mean something else)
    assert host_pool(device_pool(seed=5)).storage_namespace() != host.storage_namespace()
    assert host_pool(device_pool(seed=0)).storage_namespace() == host.storage_namespace()
