"""OscarHostKVPool: SGLang's HiCache host tier (L2) holding the INT2 cells of an OscarKVPool.

How SGLang 0.5.17 drives a host pool (``mem_cache/hiradix_cache.py``,
``mem_cache/pool_host/base.py``, ``managers/cache_controller.py``, ``mem_cache/hicache_storage.py``):

- ``HiRadixCache`` picks the class with ``get_mha_host_pool_cls(kv_cache)``, looked up in
  ``hiradix_cache``'s module globals: :func:`get_mha_host_pool_cls_hook` returns this one.
- ``HostKVCache.__init__`` sizes the pool in tokens from ``get_size_per_token()`` (the true
  INT2 bytes here, so ``--hicache-ratio`` / ``--hicache-size`` mean what they mean for BF16),
  calls ``init_kv_buffer()`` and builds its page allocator (used unchanged).
- ``HiCacheController`` calls ``backup_from_device_all_layer`` on its write stream and
  ``load_to_device_per_layer`` layer by layer on its load stream; layer i's attention must wait
  through ``device_pool.layer_transfer_counter.wait_until(i)``, which the oscar backend calls
  itself (it reads ``pool.cache``, not ``get_key_buffer``). Its io backend 'kernel' copies one
  contiguous BF16 token row per K/V buffer, which the head-major cells are not.
- Storage (L3) 'file' goes through ``get_data_page`` / ``get_dummy_flat_data_page`` /
  ``set_from_flat_data_page``; its key ``<hash>_<model_name>_<tp_rank>_<tp_size>`` says nothing
  of the KV dtype or the rotations (:func:`storage_config_hook` adds both). The zero-copy
  backends address BF16 K/V pages.

What this pool holds, per local layer and token (uint8 bytes, the device cell's content):

    [ k codes H*D/4 | v codes H*D/4 | k (scale, min) H*D/G_K*2*e | v (scale, min) H*D/G_V*2*e ]

(head-major on the device, token-major here). Only the INT2 cells: the BF16 sinks and rings
stay on the device. Where a rotations file sets the keys' groups per layer, B differs per
layer: each layer's cell fills the first B_l bytes of a row of the widest layer's B (the rest
is zero), so the host tier costs L x max B_l per token. Layouts (one uint8 tensor ``kv_buffer``, pinned by SGLang's
``ALLOC_MEMORY_FUNCS`` when the device pool is on an accelerator):

    layer_first        [L, size, B]          B = bytes of one token in one layer
    page_first_direct  [page_num, L, P, B]   a page of all layers is one contiguous block

Transfers ('direct' io backend): per layer, the device cells are gathered into one [n, B]
staging tensor and copied to contiguous host runs, and back by index_copy_; everything moves
as bytes, so float8/float16 scales come back bit-exact.

Sinks (a radix hit reads BF16 sinks while the sequence's sink slot still holds them, else
INT2): a backup notes per host page the sink slot valid for its device page
(``sink_of_host_page``) and claims slot c only once per ``index.sink_generation`` (a device
page keeps its stale mapping after SGLang frees it, so a later page there would otherwise
claim the first page's sinks). A load maps a page back to its slot when the claim is its own
and the generation unchanged, and unmaps every other loaded page, so positions < S read INT2,
never another sequence's sinks. All of it is device ops on the transfer's stream (no host
sync); a slot handed out while a load maps it back leaves one of the two reading INT2 (a
sequence writes sinks only where the mapping is valid for its first page).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import torch

from .pool import OscarKVPool
from .sglang_bridge import ALLOC_MEMORY_FUNCS, HostKVCache

SUPPORTED_LAYOUTS = ("layer_first", "page_first_direct")
SUPPORTED_IO_BACKENDS = ("direct",)
SUPPORTED_STORAGE_BACKENDS = (None, "file")

_KERNEL_IO = ("--hicache-io-backend kernel (SGLang's default for --enable-hierarchical-cache) "
              "cannot carry oscar_int2 cells (its kernels copy one contiguous BF16 token row per "
              "K/V buffer; the cells are head-major codes and scales): add --hicache-io-backend direct")
_LAYOUT_WHY = {
    "page_first_kv_split": "it stores a page's K and V halves apart; a cell interleaves K and V "
                           "codes and scales",
    "page_head": "it splits pages by KV head for split-head storage, which this pool does not "
                 "implement for the cells",
}


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not supported with --kv-cache-dtype oscar_int2 and "
                               f"--enable-hierarchical-cache")


def hicache_refusal(server_args) -> Optional[str]:
    """One line for HiCache settings this pool cannot serve (None: it can). For the start-up
    refusals, before and after SGLang resolves the flags: it turns layout page_first + io
    direct into page_first_direct and io kernel + page_first_direct into io direct."""
    io = getattr(server_args, "hicache_io_backend", "kernel")
    layout = getattr(server_args, "hicache_mem_layout", "page_first")
    storage = getattr(server_args, "hicache_storage_backend", None)
    if io == "kernel" and layout == "page_first_direct":
        io = "direct"  # SGLang switches the io backend for this layout itself
    if io == "kernel":
        return _KERNEL_IO
    if io not in SUPPORTED_IO_BACKENDS:
        return (f"--hicache-io-backend {io} is not supported with oscar_int2 (its transfers copy "
                f"BF16 K/V rows; use direct)")
    if layout not in SUPPORTED_LAYOUTS + ("page_first",):
        why = _LAYOUT_WHY.get(layout, "the host tier holds the cells in two layouts only")
        return (f"--hicache-mem-layout {layout} is not supported with oscar_int2 ({why}; "
                f"use layer_first or page_first_direct)")
    if storage not in SUPPORTED_STORAGE_BACKENDS:
        return (f"--hicache-storage-backend {storage} is not supported with oscar_int2 (its "
                f"transfers address BF16 K/V pages; use file, which writes the cells' bytes)")
    return None


@dataclasses.dataclass(frozen=True)
class CellLayout:
    """Byte segments of one token's INT2 cell in one layer (H heads, codes Q = D/4 bytes)."""

    num_heads: int
    code_bytes: int  # Q, per head
    k_scale_bytes: int  # D/G_K * 2 * e, per head
    v_scale_bytes: int  # D/G_V * 2 * e, per head

    @property
    def segments(self) -> tuple[tuple[str, int, int], ...]:
        """(name, start, end) byte ranges of k codes, v codes, k scales, v scales."""
        h, out, at = self.num_heads, [], 0
        for name, per_head in (("k_packed", self.code_bytes), ("v_packed", self.code_bytes),
                               ("k_scales", self.k_scale_bytes), ("v_scales", self.v_scale_bytes)):
            out.append((name, at, at + h * per_head))
            at += h * per_head
        return tuple(out)

    @property
    def bytes_per_layer(self) -> int:
        return self.segments[-1][2]


def cell_layout(device_pool: OscarKVPool, layer: int = 0) -> CellLayout:
    """The cell of one local layer (layers differ only where the keys' groups do)."""
    lc = device_pool.layers[layer]
    e = lc.k_scales.element_size()
    return CellLayout(num_heads=lc.num_kv_heads, code_bytes=lc.k_packed.shape[-1],
                      k_scale_bytes=lc.k_scales.shape[2] * 2 * e,
                      v_scale_bytes=lc.v_scales.shape[2] * 2 * e)


def device_byte_views(device_pool: OscarKVPool, layer: int) -> dict[str, torch.Tensor]:
    """uint8 [slots, H, bytes per head] views of one local layer's codes and scales (strided)."""
    lc = device_pool.layers[layer]
    return {"k_packed": lc.k_packed, "v_packed": lc.v_packed,
            "k_scales": lc.k_scales.view(torch.uint8).flatten(2),
            "v_scales": lc.v_scales.view(torch.uint8).flatten(2)}


def _runs(host: torch.Tensor, pos: torch.Tensor, page_size: int, split_pages: bool):
    """Maximal runs of consecutive host slots (split at page ends if ``split_pages``):
    list of (host_start, staging_start, length). host, pos: int64 CPU [n]."""
    if host.numel() == 0:
        return []
    brk = host[1:] != host[:-1] + 1
    if split_pages:
        brk |= (host[1:] % page_size) == 0
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(brk).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([host.numel()])])
    return [(int(host[s]), int(pos[s]), int(e - s)) for s, e in zip(starts.tolist(), ends.tolist())]


class OscarHostKVPool(HostKVCache):
    """Host copy of an OscarKVPool's INT2 cells (module doc). ``kv_buffer``: uint8, see the
    layouts; ``layer_cells``: each local layer's :class:`CellLayout`; ``row_bytes``: the width
    of a host row (the widest layer's cell); ``size_per_token``: host bytes per token."""

    device_pool: OscarKVPool

    def __init__(self, device_pool: OscarKVPool, host_to_device_ratio: float, host_size: int,
                 page_size: int, layout: str, pin_memory: bool = True, device: str = "cpu",
                 allocator_type: str = "default", *, pool_label: str = "kv"):
        if not isinstance(device_pool, OscarKVPool):
            raise TypeError(f"OscarHostKVPool needs an OscarKVPool, got {type(device_pool).__name__}")
        if layout not in SUPPORTED_LAYOUTS:
            raise _refuse(f"--hicache-mem-layout {layout} (use layer_first or page_first_direct)")
        if getattr(device_pool, "layer_shard_enabled", False):
            raise _refuse("a layer-sharded device pool")
        self.layer_num = device_pool.layer_num
        self.layer_cells = [cell_layout(device_pool, l) for l in range(self.layer_num)]
        self.row_bytes = max(c.bytes_per_layer for c in self.layer_cells)
        # pinning (cudaHostRegister) only means something for an accelerator's pool
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout,
                         pin_memory and str(device_pool.device) != "cpu", device, allocator_type,
                         pool_label=pool_label)
        self._plan_key = None
        # sink records (module doc), on the device pool's device; the claims' last entry is
        # a sink for the scatters of pages that claim nothing
        dev, slots = device_pool.device, device_pool.index.page_of_sink_slot.shape[0]
        self.sink_of_host_page = torch.full((self.page_num,), -1, dtype=torch.int32, device=dev)
        self.sink_claim_page = torch.full((slots + 1,), -1, dtype=torch.int64, device=dev)
        self.sink_claim_generation = torch.full((slots + 1,), -1, dtype=torch.int64, device=dev)

    # -- sizing and buffers (called by HostKVCache.__init__) ----------------------------

    def get_size_per_token(self) -> int:
        return self.layer_num * self.row_bytes

    def get_ksize_per_token(self):
        raise _refuse("a storage backend that splits pages into K and V halves")

    def init_kv_buffer(self) -> torch.Tensor:
        b = self.row_bytes
        if self.layout == "layer_first":
            dims = (self.layer_num, self.size, b)
        else:  # page_first_direct
            dims = (self.page_num, self.layer_num, self.page_size, b)
        alloc = ALLOC_MEMORY_FUNCS[str(self.device_pool.device)]
        return alloc(dims, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory,
                     allocator=self.allocator)

    def clear(self):
        super().clear()
        if hasattr(self, "sink_of_host_page"):  # HostKVCache.__init__ clears before they exist
            self.sink_of_host_page.fill_(-1)

    def free(self, indices: torch.Tensor) -> int:
        """SGLang's free; the freed host pages also forget their sink slot."""
        n = super().free(indices)
        if n:
            pages = indices.to(self.sink_of_host_page.device, torch.long) // self.page_size
            self.sink_of_host_page.index_fill_(0, pages, -1)
        return n

    def host_rows(self, layer: int, start: int, length: int) -> torch.Tensor:
        """uint8 [length, B] contiguous view of host slots start.. of one layer (within a
        page for page_first_direct)."""
        if self.layout == "layer_first":
            return self.kv_buffer[layer, start:start + length]
        page, off = divmod(start, self.page_size)
        return self.kv_buffer[page, layer, off:off + length]

    # -- transfers ----------------------------------------------------------------------

    def _plan(self, device_pool, host_indices, device_indices):
        """(device indices on the pool's device, host runs, (host pages, device pages) on
        the device: the page of every page_size-th slot, SGLang moving whole pages); cached
        for the per-layer calls of one load (the controller passes the same tensors for
        every layer)."""
        key = (host_indices, device_indices, device_pool)
        if self._plan_key is not None and all(a is b for a, b in zip(self._plan_key, key)):
            return self._plan_val
        if host_indices.numel() != device_indices.numel():
            raise ValueError(f"HiCache transfer: {host_indices.numel()} host slots for "
                             f"{device_indices.numel()} device slots")
        host = host_indices.to("cpu", torch.long)
        dev = device_indices.to(device_pool.device, torch.long, non_blocking=True)
        runs = _runs(host, torch.arange(host.numel()), self.page_size,
                     self.layout == "page_first_direct")
        p = self.page_size
        pages = ((host[::p] // p).to(dev.device, non_blocking=True), dev[::p] // p)
        self._plan_key, self._plan_val = key, (dev, runs, pages)
        return self._plan_val

    def _check_io(self, io_backend: str):
        if io_backend == "kernel":
            raise NotImplementedError(_KERNEL_IO)
        if io_backend not in SUPPORTED_IO_BACKENDS:
            raise _refuse(f"--hicache-io-backend {io_backend} (use direct)")

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend) -> None:
        """Device cells at ``device_indices`` -> host slots ``host_indices``, every layer."""
        self._check_io(io_backend)
        dev, runs, (host_pages, dev_pages) = self._plan(device_pool, host_indices, device_indices)
        n = dev.numel()
        self.record_sinks(device_pool, host_pages, dev_pages)
        for layer in range(self.layer_num):
            views = device_byte_views(device_pool, layer)
            cells = self.layer_cells[layer]
            staging = torch.empty((n, self.row_bytes), dtype=torch.uint8, device=dev.device)
            staging[:, cells.bytes_per_layer:].zero_()  # a narrower layer's padding (empty otherwise)
            for name, s, e in cells.segments:
                staging[:, s:e].copy_(views[name].index_select(0, dev).reshape(n, e - s))
            for h, p, k in runs:
                self.host_rows(layer, h, k).copy_(staging[p:p + k], non_blocking=True)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id,
                                 io_backend) -> None:
        """Host slots ``host_indices`` -> device cells ``device_indices`` of local layer
        ``layer_id`` only; at layer 0 the loaded pages also get their sink mapping
        (:meth:`restore_sinks`)."""
        self._check_io(io_backend)
        dev, runs, (host_pages, dev_pages) = self._plan(device_pool, host_indices, device_indices)
        n = dev.numel()
        if layer_id == 0:
            self.unmap_sinks(device_pool, dev)
            self.restore_sinks(device_pool, host_pages, dev_pages)
        staging = torch.empty((n, self.row_bytes), dtype=torch.uint8, device=dev.device)
        for h, p, k in runs:
            staging[p:p + k].copy_(self.host_rows(layer_id, h, k), non_blocking=True)
        views = device_byte_views(device_pool, layer_id)
        for name, s, e in self.layer_cells[layer_id].segments:
            view = views[name]
            view.index_copy_(0, dev, staging[:, s:e].reshape(n, *view.shape[1:]))

    @staticmethod
    def unmap_sinks(device_pool: OscarKVPool, device_indices: torch.Tensor) -> None:
        """The pages of ``device_indices`` hold no sinks any more (their cells came from host)."""
        index = device_pool.index
        pages = device_indices // index.page_size
        index.sink_slot_of_page.index_fill_(0, pages, -1)

    def record_sinks(self, device_pool: OscarKVPool, host_pages: torch.Tensor,
                     dev_pages: torch.Tensor) -> None:
        """At backup: each host page notes the sink slot valid for its device page, if no
        host page claimed that slot in its current generation (module doc)."""
        index = device_pool.index
        c = index.sink_slot_of_page[dev_pages].long()
        cc = c.clamp(min=0)
        generation = index.sink_generation[cc]  # before the owner: see assign_sink_slots
        valid = (c >= 0) & (index.page_of_sink_slot[cc].long() == dev_pages)
        fresh = valid & (self.sink_claim_generation[cc] != generation)
        self.sink_of_host_page[host_pages] = torch.where(fresh, c, -1).to(torch.int32)
        to = torch.where(fresh, cc, self.sink_claim_page.shape[0] - 1)
        self.sink_claim_generation.scatter_(0, to, generation)
        self.sink_claim_page.scatter_(0, to, host_pages)

    def restore_sinks(self, device_pool: OscarKVPool, host_pages: torch.Tensor,
                      dev_pages: torch.Tensor) -> None:
        """At load: a loaded page whose host page holds the claim on a sink slot of
        unchanged generation reads that slot's sinks again (the slot names it as owner);
        the others stay unmapped."""
        index = device_pool.index
        c = self.sink_of_host_page[host_pages].long()
        cc = c.clamp(min=0)
        ok = ((c >= 0) & (self.sink_claim_page[cc] == host_pages)
              & (self.sink_claim_generation[cc] == index.sink_generation[cc]))
        index.sink_slot_of_page[dev_pages] = torch.where(ok, c, -1).to(torch.int32)
        owner = torch.cat([index.page_of_sink_slot, index.page_of_sink_slot.new_full((1,), -1)])
        owner.scatter_(0, torch.where(ok, cc, owner.shape[0] - 1), dev_pages.to(owner.dtype))
        index.page_of_sink_slot.copy_(owner[:-1])

    # -- flat pages (the 'file' storage backend) ------------------------------------------

    def _flat_page_shape(self):
        return (self.layer_num, self.page_size, self.row_bytes)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        """uint8 [L, P, B] (flattened if ``flat``) of the host page starting at slot ``index``:
        the same bytes for both layouts, so a file written under one reads under the other."""
        index = int(index)
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        else:
            page = self.kv_buffer[index // self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self._flat_page_shape(), dtype=torch.uint8, device=self.device,
                           pin_memory=self.pin_memory).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        index = int(index)
        page = data_page.view(torch.uint8).reshape(self._flat_page_shape())
        if self.layout == "layer_first":
            self.kv_buffer[:, index:index + self.page_size] = page
        else:
            self.kv_buffer[index // self.page_size] = page

    def get_page_buffer_meta(self, indices):
        raise _refuse("a zero-copy storage backend (it addresses BF16 K/V pages; use "
                      "--hicache-storage-backend file)")

    def get_split_heads_page_buffer_meta(self, indices, split_factor: int):
        raise _refuse("--hicache-mem-layout page_head (split-head storage)")

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return False  # no zero-copy storage path

    # -- identity of the bytes, for storage keys ------------------------------------------

    def storage_namespace(self) -> str:
        """A name for what these bytes mean: cell geometry, scale dtype and a digest of the
        rotations (cells written with other rotations must not be read back)."""
        lc, c = self.device_pool.layers[0], self.layer_cells[0]
        h = hashlib.sha256()
        for rot in self.device_pool.rotations:
            for f in rot.FIELDS:
                h.update(getattr(rot, f).detach().to("cpu").contiguous().numpy().tobytes())
        dtype = str(lc.k_scales.dtype).replace("torch.", "")
        groups = sorted({x.key_group_size for x in self.device_pool.layers})  # the digest tells which layer
        return (f"oscar_int2-L{self.layer_num}H{c.num_heads}D{lc.head_dim}g{'-'.join(map(str, groups))}"
                f"v{lc.value_group_size}-{dtype}-{h.hexdigest()[:16]}")


# -- hooks (installed by the bridge) ---------------------------------------------------------

def get_mha_host_pool_cls_hook(original, device_pool, *args, **kwargs):
    """AROUND ``sglang.srt.mem_cache.hiradix_cache.get_mha_host_pool_cls``: the host pool class
    for an OscarKVPool; SGLang's choice for any other pool."""
    if isinstance(device_pool, OscarKVPool):
        return OscarHostKVPool
    return original(device_pool, *args, **kwargs)


def storage_config_hook(result, controller, *args, **kwargs):
    """AFTER ``sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config``:
    the storage keys of an oscar host pool carry :meth:`OscarHostKVPool.storage_namespace`, so
    a BF16 run or another rotations file sharing the directory never reads these pages."""
    host = getattr(controller, "mem_pool_host", None)
    if not isinstance(host, OscarHostKVPool):
        return None
    name = f"{result.model_name or ''}-{host.storage_namespace()}"
    return dataclasses.replace(result, model_name=name)
