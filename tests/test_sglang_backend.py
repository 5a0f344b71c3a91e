"""OscarAttnBackend's per-batch logic on CPU, driven like SGLang drives it (fake
ForwardBatch, real OscarKVPool and RadixAttention layers, reference kernels).

Every output is checked against an oracle built from the token K/V themselves and the
read rule (sinks and the request's own ring window in BF16, everything else INT2),
independent of the pool's bookkeeping: chunked prefill continuations, reused rows,
radix hits on shared slots, padded CUDA-graph decode batches.
"""
import hashlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

import kernel_helpers as kh  # noqa: E402
from oscar_kernels.testing import random_rotation  # noqa: E402
from oscar_kernels.int2 import dequantise, quantise_rotated, unpack  # noqa: E402
from oscar_kernels.reference import _attend, expand_gqa, rotate  # noqa: E402
from sglang_ext.backend import OscarAttnBackend, rid_hash  # noqa: E402
from sglang_ext.pool import OscarKVPool  # noqa: E402

H, HQ, D, G, S, W, P = 2, 4, 64, 32, 4, 8, 16
LAYERS, ROWS, SIZE, CTX = 2, 6, 512, 128


def _gen(*key) -> torch.Generator:
    seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=6).digest(), "little")
    return torch.Generator().manual_seed(seed)


class ReqPool:
    """SGLang's request pool as the backend reads it: the req_to_token table and the host
    free list of its rows (every row but row 0 and the live ones)."""

    def __init__(self, req_to_token, live):
        self.req_to_token, self._live = req_to_token, live

    @property
    def free_slots(self):
        return [r for r in range(1, self.req_to_token.shape[0]) if r not in self._live()]


class Sim:
    """A minimal stand-in for SGLang's scheduler: req_to_token rows, pages, batches."""

    def __init__(self, sink_slots=None, live_rows=None, layer_ids=None, **backend):
        """``sink_slots``: the pool's sink slots (default: per row); ``live_rows()``: the rows
        of live requests, read by the backend through a request pool's free list (None: a
        request pool without one); ``layer_ids``: the model layers the pool holds (default
        0..LAYERS-1); ``backend``: OscarAttnBackend's keyword arguments."""
        g = torch.Generator().manual_seed(0)
        rots = [random_rotation(H, D, g) for _ in range(LAYERS)]
        self.pool = OscarKVPool(SIZE, P, H, D, LAYERS, "cpu", rotations=rots,
                                req_to_token=self.make_req_to_token(),
                                sink_tokens=S, recent_window=W, group_size=G, num_sink_slots=sink_slots,
                                layer_ids=layer_ids)
        r2t = self.pool.req_to_token
        self.req_pool = SimpleNamespace(req_to_token=r2t) if live_rows is None else ReqPool(r2t, live_rows)
        self.backend = OscarAttnBackend(self.runner_pool(), self.req_pool, num_q_heads=HQ, sm_scale=D ** -0.5,
                                        **backend)
        self.layers = [RadixAttention(HQ, D, D ** -0.5, H, l) for l in self.pool.layer_ids]
        self.free_pages = list(range(1, SIZE // P + 1))  # page 0 is the padding page
        self.source = {}  # (row, position) -> content id that computed the token's K/V

    def make_req_to_token(self):
        return torch.zeros(ROWS, CTX, dtype=torch.int32)

    def runner_pool(self):
        """The KV pool the model runner holds (the backend is built from it)."""
        return self.pool

    def attend(self, q, k, v, layer, fb):
        """One layer's attention call as SGLang makes it."""
        run = self.backend.forward_decode if fb.forward_mode.is_decode() else self.backend.forward_extend
        return run(q, k, v, layer, fb)

    # token content: K/V of position j of a sequence with content id c (per layer)
    @staticmethod
    def kv(content, layer, positions):
        out = [torch.randn(2, H, D, generator=_gen(content, layer, j)).bfloat16() for j in positions]
        k = torch.stack([x[0] for x in out]) if out else torch.zeros(0, H, D, dtype=torch.bfloat16)
        v = torch.stack([x[1] for x in out]) if out else torch.zeros(0, H, D, dtype=torch.bfloat16)
        return k, v

    @staticmethod
    def q(rid, layer, positions):
        return torch.cat([torch.randn(1, HQ * D, generator=_gen("q", rid, layer, j))
                          for j in positions]).bfloat16()

    def alloc(self, row, start, end):
        """Fresh pages for positions start..end-1 of a row (start page-aligned)."""
        assert start % P == 0
        for p0 in range(start, end, P):
            page = self.free_pages.pop(0)
            self.pool.req_to_token[row, p0:p0 + P] = torch.arange(page * P, page * P + P)

    def share(self, row, src_row, n):
        """Radix hit: the first n positions of ``row`` point at ``src_row``'s slots."""
        self.pool.req_to_token[row, :n] = self.pool.req_to_token[src_row, :n]
        for j in range(n):
            self.source[(row, j)] = self.source[(src_row, j)]

    def extend(self, reqs, mode=ForwardMode.EXTEND):
        """reqs: dicts rid, row, content, prefix, new. Returns per-layer outputs [T, HQ*D]."""
        rows, prefix, ext, slots, pos = [], [], [], [], []
        for r in reqs:
            span = range(r["prefix"], r["prefix"] + r["new"])
            if r["new"] and self.pool.req_to_token[r["row"], span[-1]] == 0:
                self.alloc(r["row"], -(-r["prefix"] // P) * P, span[-1] + 1)
            for j in span:
                self.source[(r["row"], j)] = r["content"]
            rows.append(r["row"]); prefix.append(r["prefix"]); ext.append(r["new"])
            slots.append(self.pool.req_to_token[r["row"], span.start:span.stop].long())
            pos.append(torch.arange(span.start, span.stop))
        fb = SimpleNamespace(
            forward_mode=mode, batch_size=len(reqs), req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor([p + e for p, e in zip(prefix, ext)]),
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
            extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
            extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
            out_cache_loc=torch.cat(slots), positions=torch.cat(pos),
            rids=[r["rid"] for r in reqs])
        self.backend.init_forward_metadata(fb)
        outs = []
        for layer in self.layers:
            l = layer.layer_id
            k, v = zip(*[self.kv(r["content"], l, range(r["prefix"], r["prefix"] + r["new"])) for r in reqs])
            q = torch.cat([self.q(r["rid"], l, range(r["prefix"], r["prefix"] + r["new"])) for r in reqs])
            outs.append(self.attend(q, torch.cat(k), torch.cat(v), layer, fb))
        return outs

    def decode(self, reqs, pad_to=None, in_graph=False):
        """reqs: dicts rid, row, content, n (length after this step). ``pad_to`` pads the
        batch like SGLang's CUDA-graph runner (row 0, seq_len 1, slot 0, position 0)."""
        for r in reqs:
            if self.pool.req_to_token[r["row"], r["n"] - 1] == 0:
                self.alloc(r["row"], r["n"] - 1, r["n"])
            self.source[(r["row"], r["n"] - 1)] = r["content"]
        pad = (pad_to or len(reqs)) - len(reqs)
        rows = [r["row"] for r in reqs] + [0] * pad
        lens = [r["n"] for r in reqs] + [1] * pad
        slots = [int(self.pool.req_to_token[r["row"], r["n"] - 1]) for r in reqs] + [0] * pad
        fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(rows),
                             req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens),
                             out_cache_loc=torch.tensor(slots),
                             positions=torch.tensor(lens) - 1, rids=None)
        if in_graph:  # the runner's order: out-of-graph prep, then the recorded in-graph op
            self.backend.init_forward_metadata_out_graph(fb)
            self.backend.init_forward_metadata_in_graph(fb)
        else:
            self.backend.init_forward_metadata(fb)
        outs = []
        for layer in self.layers:
            l = layer.layer_id
            kv = [self.kv(r["content"], l, [r["n"] - 1]) for r in reqs]
            kv += [self.kv("pad", l, [0])] * pad
            q = torch.cat([self.q(r["rid"], l, [r["n"] - 1]) for r in reqs]
                          + [self.q("pad", l, [0])] * pad)
            outs.append(self.attend(q, torch.cat([x[0] for x in kv]), torch.cat([x[1] for x in kv]),
                                    layer, fb)[:len(reqs)])
        return outs

    # ---------------------------------------------------------------- the oracle

    def expected(self, row, rid, layer, n_prefix, new_positions, new_content, valid_from,
                 sinks=True, window_end=None, learned_sinks=None):
        """o [len(new), HQ*D] for new tokens of ``row`` at ``new_positions`` after a prefix
        of n_prefix cached positions, from the tokens' K/V and the read rule: the ring
        window ends at the prefix length for extend, at the length incl. the new token
        for decode (``window_end``); ``learned_sinks`` [HQ]: the layer's sink logits (gpt-oss),
        one more softmax column with no value."""
        window_end = n_prefix if window_end is None else window_end
        rot = self.pool.rotations[self.pool.cache_layer(layer)]
        keys, vals, var = [], [], []  # var: the keys' scale^2 per group, 0 where exact (the key debias)
        n_all = n_prefix + len(new_positions)
        for j in range(n_all):
            content = self.source[(row, j)] if j < n_prefix else new_content
            k, v = self.kv(content, layer, [j])
            if j >= n_prefix or (sinks and j < S):
                exact = True
            else:  # prefix position: ring if in the own window, else INT2
                exact = j >= max(window_end - W, valid_from)
            kr, kp, ks = quantise_rotated(k, rot.k_rot, rot.k_clip_min, rot.k_clip_max, G, shift=rot.k_shift)
            vr, vp, vs = quantise_rotated(v, rot.v_rot, rot.v_clip_min, rot.v_clip_max, G)
            if exact:
                keys.append(kr.bfloat16().float()); vals.append(vr.bfloat16().float())
                var.append(torch.zeros(ks.shape[:-1]))
            else:
                keys.append(dequantise(unpack(kp), ks)); vals.append(dequantise(unpack(vp), vs))
                var.append(ks[..., 0].float().pow(2))
        keys, vals = torch.cat(keys), torch.cat(vals)
        q = self.q(rid, layer, new_positions).view(-1, HQ, D)
        qr = rotate(q, expand_gqa(rot.k_rot, HQ))
        e = len(new_positions)
        mask = torch.arange(n_all)[None, :] <= torch.arange(e)[:, None] + n_prefix
        o = _attend(qr, keys, vals, D ** -0.5, mask.unsqueeze(0), sinks=learned_sinks,
                    k_var=torch.cat(var) if getattr(getattr(self.backend, "attention", None), "key_debias", False)
                    else None)
        return rotate(o, expand_gqa(rot.v_rot, HQ).transpose(-1, -2)).reshape(e, HQ * D)

    def expected_decode(self, row, rid, layer, n, content, valid_from, sinks=True, learned_sinks=None):
        return self.expected(row, rid, layer, n - 1, [n - 1], content, valid_from, sinks, window_end=n,
                             learned_sinks=learned_sinks)


def close(got, want):
    torch.testing.assert_close(got.float(), want, atol=1.5e-2, rtol=1.5e-2)


def vf(sim, row):
    return int(sim.pool.index.ring_valid_from[row])


def run_a(sim, row=3, prompt=40, chunk=16, decodes=3):
    """Request A: chunked prefill of ``prompt`` tokens, then ``decodes`` decode steps."""
    for start in range(0, prompt, chunk):
        new = min(chunk, prompt - start)
        outs = sim.extend([dict(rid="A", row=row, content="A", prefix=start, new=new)])
        for l, o in enumerate(outs):
            close(o, sim.expected(row, "A", l, start, list(range(start, start + new)), "A", 0))
        assert vf(sim, row) == 0  # continuation chunks keep the ring
    for n in range(prompt + 1, prompt + decodes + 1):
        outs = sim.decode([dict(rid="A", row=row, content="A", n=n)])
        for l, o in enumerate(outs):
            close(o, sim.expected_decode(row, "A", l, n, "A", 0))
    assert int(sim.pool.index.ring_end[row]) == prompt + decodes
    assert int(sim.pool.index.ring_owner[row]) == rid_hash("A")


def test_chunked_prefill_continuation_keeps_the_ring():
    sim = Sim()
    run_a(sim)
    # The oracle can tell the ring from INT2: reading the previous chunk's window as
    # INT2 (a wrongly reset ring) gives visibly different outputs.
    right = sim.expected(3, "A", 0, 32, list(range(32, 40)), "A", valid_from=0)
    wrong = sim.expected(3, "A", 0, 32, list(range(32, 40)), "A", valid_from=32)
    assert (right - wrong).abs().max() > 0.05


def test_key_debias_through_the_backend_matches_the_oracle():
    """--oscar-key-debias on: chunked prefill and decode through the backend match the oracle
    with the INT2 keys' debias (run_a checks every step), and differ from the plain read."""
    on, off = Sim(key_debias=True), Sim()
    assert on.backend.attention.key_debias and not off.backend.attention.key_debias
    run_a(on, decodes=2)
    run_a(off, decodes=2)
    step = [dict(rid="A", row=3, content="A", n=43)]
    outs_on, outs_off = on.decode(step), off.decode(step)
    for l, o in enumerate(outs_on):
        close(o, on.expected_decode(3, "A", l, 43, "A", 0))
    assert max((a.float() - b.float()).abs().max().item() for a, b in zip(outs_on, outs_off)) > 1e-3


def test_new_request_in_a_reused_row_resets_the_ring():
    sim = Sim()
    run_a(sim, prompt=40, decodes=8)  # A ends at 48 = three full pages
    # C computes other tokens on its own row, then finishes.
    outs = sim.extend([dict(rid="C", row=2, content="C", prefix=0, new=48)])
    # B takes A's old row with a radix hit on C's 48 cached tokens: its prefix length
    # equals A's ring end, only the owner differs. A's ring cells hold A's tokens, so
    # B must start its ring at 48 and read C's slots as INT2.
    sim.share(3, 2, 48)
    outs = sim.extend([dict(rid="B", row=3, content="B", prefix=48, new=5)])
    assert vf(sim, 3) == 48 and int(sim.pool.index.ring_end[3]) == 53
    for l, o in enumerate(outs):
        close(o, sim.expected(3, "B", l, 48, list(range(48, 53)), "B", valid_from=48))
    outs = sim.decode([dict(rid="B", row=3, content="B", n=54)])
    for l, o in enumerate(outs):
        close(o, sim.expected_decode(3, "B", l, 54, "B", valid_from=48))
    # A brand-new request (prefix 0) in a used row starts its ring at 0.
    sim.pool.req_to_token[4].zero_()
    outs = sim.extend([dict(rid="E", row=4, content="E", prefix=0, new=12)])
    assert vf(sim, 4) == 0
    for l, o in enumerate(outs):
        close(o, sim.expected(4, "E", l, 0, list(range(12)), "E", valid_from=0))


def test_radix_hit_reads_shared_slots_as_int2_and_sinks_from_the_shared_page():
    sim = Sim()
    run_a(sim)
    first_page = int(sim.pool.req_to_token[3, 0]) // P
    sink_slot = int(sim.pool.index.sink_slot_of_page[first_page])
    assert sink_slot >= 0
    cursor = sim.pool.index.sink_cursor
    sim.share(4, 3, 32)  # D matches A's first two pages
    outs = sim.extend([dict(rid="D", row=4, content="D", prefix=32, new=10)])
    assert vf(sim, 4) == 32
    assert sim.pool.index.sink_cursor == cursor  # a hit takes no new sink slot
    assert int(sim.pool.index.sink_slot_of_page[first_page]) == sink_slot
    for l, o in enumerate(outs):
        close(o, sim.expected(4, "D", l, 32, list(range(32, 42)), "D", valid_from=32))
    for n in (43, 44):
        outs = sim.decode([dict(rid="D", row=4, content="D", n=n)])
        for l, o in enumerate(outs):
            close(o, sim.expected_decode(4, "D", l, n, "D", valid_from=32))


def test_mixed_batch_of_new_hit_and_continuing_requests():
    sim = Sim()
    run_a(sim, prompt=32, decodes=0)
    sim.share(4, 3, 16)
    outs = sim.extend([dict(rid="A", row=3, content="A", prefix=32, new=1),  # a decode in a mixed batch
                       dict(rid="F", row=1, content="F", prefix=0, new=20),
                       dict(rid="D", row=4, content="D", prefix=16, new=3)], mode=ForwardMode.MIXED)
    assert (vf(sim, 3), vf(sim, 1), vf(sim, 4)) == (0, 0, 16)
    for l, o in enumerate(outs):
        close(o[:1], sim.expected(3, "A", l, 32, [32], "A", 0))
        close(o[1:21], sim.expected(1, "F", l, 0, list(range(20)), "F", 0))
        close(o[21:], sim.expected(4, "D", l, 16, [16, 17, 18], "D", 16))
    pages = [int(sim.pool.req_to_token[r, 0]) // P for r in (3, 1)]
    assert all(int(sim.pool.index.sink_slot_of_page[p]) >= 0 for p in pages)
    assert int(sim.pool.index.sink_slot_of_page[0]) == -1


@pytest.mark.parametrize("protect", [True, False])
def test_a_live_request_keeps_its_sinks_while_others_come_and_go(protect):
    """Two sink slots, round-robin: A starts, then B, C and E start and finish in turn.
    Knowing the live rows (SGLang's req_to_token free list, rows_in_use), C and E take B's
    slot, never A's: A decodes with BF16 sinks. Without it C takes A's slot and A reads its
    sinks as INT2."""
    live = {3}
    sim = Sim(sink_slots=2, live_rows=(lambda: sorted(live)) if protect else None)
    run_a(sim, prompt=20, decodes=0)
    for rid, row in (("B", 4), ("C", 5), ("E", 1)):
        live.add(row)
        sim.extend([dict(rid=rid, row=row, content=rid, prefix=0, new=10)])
        live.discard(row)  # finished: SGLang frees the row
    outs = sim.decode([dict(rid="A", row=3, content="A", n=21)])
    for l, o in enumerate(outs):
        close(o, sim.expected_decode(3, "A", l, 21, "A", 0, sinks=protect))
    with_sinks = sim.expected_decode(3, "A", 0, 21, "A", 0, sinks=True)
    assert (with_sinks - sim.expected_decode(3, "A", 0, 21, "A", 0, sinks=False)).abs().max() > 0.05


def test_rows_in_use_reads_the_free_list():
    from sglang_ext.backend import rows_in_use

    pool = SimpleNamespace(free_slots=[2, 5], req_to_token=torch.zeros(6, 4))
    assert rows_in_use(pool) == [1, 3, 4]
    assert rows_in_use(SimpleNamespace(req_to_token=torch.zeros(6, 4))) is None


def test_padded_graph_decode_batch():
    """A decode batch padded like the CUDA-graph runner: real requests are exact, the
    padding writes only into the padding row/slot, and ring_end follows in-graph."""
    sim = Sim()
    run_a(sim, decodes=0)
    sim.extend([dict(rid="F", row=1, content="F", prefix=0, new=6)])
    outs = sim.decode([dict(rid="A", row=3, content="A", n=41), dict(rid="F", row=1, content="F", n=7)],
                      pad_to=4, in_graph=True)
    for l, o in enumerate(outs):
        close(o[:1], sim.expected_decode(3, "A", l, 41, "A", 0))
        close(o[1:], sim.expected_decode(1, "F", l, 7, "F", 0))
    assert (int(sim.pool.index.ring_end[3]), int(sim.pool.index.ring_end[1])) == (41, 7)
    assert int(sim.pool.index.sink_slot_of_page[0]) == -1  # no sink for the padding page


def test_warmup_batch_without_request_ids():
    """Prefill-graph warmup batches carry no rids (and slot 0 everywhere)."""
    sim = Sim()
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=2, req_pool_indices=torch.arange(2),
                         seq_lens=torch.tensor([5, 3]), extend_prefix_lens=torch.zeros(2, dtype=torch.int64),
                         extend_seq_lens=torch.tensor([5, 3]), extend_prefix_lens_cpu=None,
                         extend_seq_lens_cpu=None, out_cache_loc=torch.zeros(8, dtype=torch.int64),
                         positions=torch.cat([torch.arange(5), torch.arange(3)]), rids=None)
    sim.backend.init_forward_metadata(fb)
    layer = sim.layers[0]
    k, v = sim.kv("w", 0, range(8))
    o = sim.backend.forward_extend(torch.zeros(8, HQ * D, dtype=torch.bfloat16), k, v, layer, fb)
    assert o.shape == (8, HQ * D) and int(sim.pool.index.sink_slot_of_page[0]) == -1


def test_unsupported_modes_and_layers_fail_with_one_line():
    sim = Sim()
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY"):
        sim.backend.init_forward_metadata(SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY))
    capped = RadixAttention(HQ, D, D ** -0.5, H, 0, logit_cap=30.0)
    swa = RadixAttention(HQ, D, D ** -0.5, H, 1, sliding_window_size=128)
    x = torch.zeros(1, HQ * D, dtype=torch.bfloat16)
    kv = torch.zeros(1, H, D, dtype=torch.bfloat16)
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE)
    for layer, what in ((capped, "logit capping"), (swa, "sliding-window")):
        with pytest.raises(NotImplementedError, match=what):
            sim.backend.forward_decode(x, kv, kv, layer, fb)
    with pytest.raises(NotImplementedError, match="save_kv_cache"):
        sim.backend.forward_decode(x, kv, kv, sim.layers[0], fb, save_kv_cache=False)
    with pytest.raises(ValueError, match="oscar_int2"):
        OscarAttnBackend(object(), sim.req_pool, num_q_heads=HQ, sm_scale=1.0)


@pytest.mark.parametrize("read", ["int2", "bf16", "flashinfer", "auto"])
def test_extend_plans_the_prefix_read_with_the_host_lengths(read, monkeypatch):
    """--oscar-extend-prefix reaches the extend plan with the batch's host prefix lengths
    (the bf16 read sizes its scratch from them without a device sync); on a CPU pool
    "flashinfer" has no FlashInfer object and takes our BF16 read, and "auto" reads INT2.
    The Triton kernels run interpreted, and every output still matches the oracle."""
    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1")
    sim = Sim(extend_prefix=read)
    want_bf16 = read in ("bf16", "flashinfer")
    assert sim.backend.attention.flashinfer is None
    sim.extend([dict(rid="a", row=1, content="A", prefix=0, new=20)])
    outs = sim.extend([dict(rid="a", row=1, content="A", prefix=20, new=12),
                       dict(rid="b", row=2, content="B", prefix=0, new=5)])
    launch = sim.backend.attention._extend.launch
    assert launch.bf16_prefix == want_bf16 and launch.prefix_lens_host == ((20, 0) if want_bf16 else ())
    for l, o in enumerate(outs):
        kh.assert_attention_close(o[:12], sim.expected(1, "a", l, 20, list(range(20, 32)), "A", 0))


@pytest.mark.parametrize("choice, imports, want, deterministic, debias", [
    ("auto", True, "flashinfer", False, False), ("auto", False, "int2", False, False),
    ("flashinfer", True, "flashinfer", False, False), ("flashinfer", False, RuntimeError, False, False),
    ("int2", True, "int2", False, False), ("bf16", True, "bf16", False, False), ("auto", True, "int2", True, False),
    ("auto", True, "bf16", False, True), ("auto", False, "bf16", False, True), ("auto", True, "int2", True, True)])
def test_prefix_read_on_cuda_takes_flashinfer_by_default_and_falls_back_only_when_auto(choice, imports, want,
                                                                                       deterministic, debias, caplog):
    """On a CUDA pool "auto" reads through FlashInfer without the key debias and through our
    BF16 read with it (FlashInfer cannot apply it); where flashinfer does not import, "auto"
    without the debias reads INT2 with one warning, while an explicit "flashinfer" refuses to
    start. Under --enable-deterministic-inference "auto" reads INT2."""
    from unittest import mock

    from sglang_ext import backend
    from sglang_ext.backend import choose_prefix_read

    error = None if imports else ImportError("No module named 'flashinfer'")
    with mock.patch.object(backend, "flashinfer_import_error", lambda: error):
        if want is RuntimeError:
            with pytest.raises(RuntimeError, match="--oscar-extend-prefix flashinfer needs flashinfer"):
                choose_prefix_read(choice, torch.device("cuda", 0), deterministic, debias)
            return
        read = choose_prefix_read(choice, torch.device("cuda", 0), deterministic, debias)
    assert read == want
    assert ("reads cached prefixes as INT2" in caplog.text) == (choice == "auto" and not imports and not debias
                                                                and not deterministic)


def test_one_attention_scale_for_every_layer():
    """The backend plans with the model's one attention scale; a model whose layers differ
    is refused in one line, as is a layer that differs from the planned scale."""
    from sglang_ext.backend import model_attention_scale

    layers = [RadixAttention(HQ, D, 0.125, H, l) for l in range(2)]
    assert model_attention_scale(torch.nn.ModuleList(layers)) == 0.125
    layers.append(RadixAttention(HQ, D, 0.1, H, 2))
    with pytest.raises(NotImplementedError, match="several attention scales"):
        model_attention_scale(torch.nn.ModuleList(layers))
    sim = Sim()
    x = torch.zeros(1, HQ * D, dtype=torch.bfloat16)
    kv = torch.zeros(1, H, D, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="attention scale 0.1 "):
        sim.backend.forward_decode(x, kv, kv, RadixAttention(HQ, D, 0.1, H, 1), SimpleNamespace())


def test_deterministic_backend_decodes_batch_invariantly_and_reads_int2(monkeypatch):
    """--enable-deterministic-inference: the decode workspace carries a batch-invariant config
    (one split count, stage-1 shape and merge at every batch) and "auto" reads INT2."""
    from oscar_kernels.triton_decode import DecodeConfig

    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1")  # the workspace is built for the Triton path only
    sim = Sim(extend_prefix="auto", deterministic=True, context_len=CTX)
    cfg = sim.backend.attention.workspace.config
    assert sim.backend.prefix_read == "int2"
    assert len({cfg.splits_for(b, H, "cpu") for b in (1, 2, ROWS)}) == 1
    assert len({(cfg.stage1_tiles(b), cfg.merge_grid_for(b)) for b in (1, ROWS)}) == 1
    assert cfg.min_chunk * cfg.max_splits >= CTX
    default = Sim().backend.attention.workspace.config
    assert default == DecodeConfig()


def test_backend_reads_the_oscar_settings_from_the_server_arguments(tmp_path, monkeypatch):
    """SGLang's registry builds the backend from a model runner: the prefix read comes from
    its server arguments (--oscar-extend-prefix), the query heads from the model and the
    attention-TP split, the pools are the runner's, and SGLang's forward context finds the
    pool through the backend (the AttentionBackend contract, no TritonAttnBackend state)."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.model_executor.forward_context import (ForwardContext, forward_context,
                                                           get_req_to_token_pool, get_token_to_kv_pool)

    from sglang_ext.settings import OSCAR_KV_DTYPE

    sim = Sim()
    rotations = tmp_path / "r.safetensors"
    rotations.write_bytes(b"")  # the settings check only that the file is there
    runner = SimpleNamespace(
        server_args=SimpleNamespace(kv_cache_dtype=OSCAR_KV_DTYPE, oscar_rotations=str(rotations),
                                    oscar_extend_prefix="bf16", enable_deterministic_inference=False),
        model_config=SimpleNamespace(get_max_num_attention_heads=lambda: 2 * HQ, context_len=CTX),
        ps=SimpleNamespace(attn_tp_size=2), token_to_kv_pool=sim.pool, req_to_token_pool=sim.req_pool,
        model=torch.nn.ModuleList(sim.layers))
    from unittest import mock

    from oscar_kernels import triton_decode

    monkeypatch.setenv("OSCAR_FORCE_TRITON", "1")  # the decode workspace is built for Triton only
    with mock.patch.object(triton_decode, "DecodeWorkspace", lambda *a: a):
        backend = OscarAttnBackend.from_model_runner(runner)
    assert backend.attention.workspace[:4] == (ROWS, HQ, H, D)  # rows, query and KV heads of this rank
    assert backend.prefix_read == "bf16" and not hasattr(sim.pool, "extend_prefix")
    assert backend.attention.sm_scale == D ** -0.5  # the model's RadixAttention layers' scale
    assert isinstance(backend, AttentionBackend) and not isinstance(backend, TritonAttnBackend)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1 and backend.needs_cpu_seq_lens is False
    with forward_context(ForwardContext(attn_backend=backend)):
        assert get_token_to_kv_pool() is sim.pool and get_req_to_token_pool() is sim.req_pool
    runner.server_args.oscar_extend_prefix = "fp8"
    with pytest.raises(ValueError, match="--oscar-extend-prefix='fp8': choose from"):
        OscarAttnBackend.from_model_runner(runner)
