"""sglang_ext.warmup on CPU: the prompt lengths, and the requests the warm-up sends through a
stand-in tokenizer manager (the real server runs it on the GPU machine: the first long prompt
of a fresh server, benchmarks/first_prompt.py)."""
import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
from sglang.srt.entrypoints.warmup import _warmup_registry  # noqa: E402

from sglang_ext import plugin, warmup  # noqa: E402
from sglang_ext.settings import WARMUP_NAME  # noqa: E402


@pytest.mark.parametrize("chunk,page,context,expect", [
    (1024, 64, 16384, (2085, 2149)),   # two chunks + 37 (the second and third read the cache), one page more
    (512, 16, 16384, (1061, 1077)),
    (None, 64, 16384, (2085, 2149)),   # chunked prefill off: the radix hit reads the prefix
    (-1, 1, 32768, (2085, 2086)),
    (1024, 64, 1000, (994, 995)),      # a short context: both fit with the decode steps
])
def test_prompt_lengths(chunk, page, context, expect):
    first, second = warmup.prompt_lengths(chunk, page, context)
    assert (first, second) == expect
    assert second + warmup.DECODE_STEPS < context


class _TokenizerManager:
    """What the warm-up uses of SGLang's TokenizerManager; records the requests."""

    def __init__(self, chunk, vocab=500, context=16384, flush_ok=True):
        self.server_args = SimpleNamespace(chunked_prefill_size=chunk, page_size=64)
        self.model_config = SimpleNamespace(vocab_size=vocab)
        self.context_len = context
        self.requests, self.flushes, self.flush_ok = [], 0, flush_ok

    def generate_request(self, req, request):
        self.requests.append(req)

        async def answer():
            yield {"text": "", "meta_info": {}}
        return answer()

    async def flush_cache(self):
        self.flushes += 1
        return SimpleNamespace(success=self.flush_ok)


def test_warmup_sends_a_chunked_prompt_then_its_radix_extension_and_flushes(caplog):
    tm = _TokenizerManager(chunk=1024)
    with caplog.at_level("INFO", logger="sglang_ext.warmup"):
        asyncio.run(warmup.oscar_prefix_read("null", tm))
    first, second = (r.input_ids for r in tm.requests)
    assert (len(first), len(second)) == warmup.prompt_lengths(1024, 64, 16384)
    assert second[:len(first)] == first  # the second prompt's prefix is the first: a radix hit
    assert all(0 <= t < 500 for t in second)
    assert all(r.sampling_params == {"max_new_tokens": warmup.DECODE_STEPS, "temperature": 0.0,
                                     "ignore_eos": True} for r in tm.requests)
    assert tm.flushes == 1
    assert "warm-up prompts of 2085 and 2149 tokens" in caplog.text
    again = _TokenizerManager(chunk=1024, flush_ok=False)
    with caplog.at_level("INFO", logger="sglang_ext.warmup"):
        asyncio.run(warmup.oscar_prefix_read("null", again))
    assert [r.input_ids for r in again.requests] == [first, second]  # fixed ids
    assert "the radix cache was not flushed" in caplog.text


def test_plugin_registers_the_warmup_with_sglang():
    plugin.register()
    assert _warmup_registry[WARMUP_NAME] is warmup.oscar_prefix_read
