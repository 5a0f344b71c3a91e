"""The server warm-up that reads a cached prefix (``--warmups oscar_prefix_read``, added for
``oscar_int2`` by :func:`sglang_ext.refusals.apply_oscar_defaults` unless
``--skip-server-warmup``).

SGLang's own warm-up request is one short prompt: it never reads a cached prefix and never
prefills a full chunk, so the first long prompt of a fresh server would compile what only
those paths use (the prefix read, the specialisations of a chunk of ``--chunked-prefill-size``
tokens, the model's GEMMs at that size). SGLang runs the ``--warmups`` functions before the
server listens; this one sends, through the tokenizer manager as SGLang's own do,

1. a prompt of two full prefill chunks and a partial one (the second and third read the first
   from the cache), then four greedy decode steps;
2. the same prompt and one page more (a radix hit: the prefix read without chunking);

and then flushes the radix cache, so the server starts empty. Token ids are fixed
pseudo-random ids of the vocabulary: nothing is downloaded or tokenised.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from .settings import WARMUP_NAME
from .sglang_bridge import GenerateReqInput, register_warmup

logger = logging.getLogger(__name__)

UNCHUNKED_PROMPT = 2048  # tokens of the first prompt when chunked prefill is off
PARTIAL_CHUNK = 37  # a last chunk whose length is not a multiple of 16 (Triton specialises on it)
DECODE_STEPS = 4


def prompt_lengths(chunked_prefill_size: int | None, page_size: int, context_len: int) -> tuple[int, int]:
    """(first prompt, second prompt) in tokens: two chunks and a partial one, then one page
    more; both leave room for the decode steps within ``context_len``."""
    chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else UNCHUNKED_PROMPT // 2
    limit = max(context_len - DECODE_STEPS - 1, 2)
    second = min(2 * chunk + PARTIAL_CHUNK + max(page_size, 1), limit)
    return min(2 * chunk + PARTIAL_CHUNK, second - 1), second


async def oscar_prefix_read(disaggregation_mode: str, tokenizer_manager) -> None:
    sa = tokenizer_manager.server_args
    first, second = prompt_lengths(sa.chunked_prefill_size, sa.page_size or 1, tokenizer_manager.context_len)
    vocab = int(tokenizer_manager.model_config.vocab_size)
    ids = np.random.default_rng(0).integers(0, vocab, size=second).tolist()
    start = time.perf_counter()
    for n in (first, second):
        req = GenerateReqInput(input_ids=ids[:n], sampling_params={
            "max_new_tokens": DECODE_STEPS, "temperature": 0.0, "ignore_eos": True})
        await tokenizer_manager.generate_request(req, None).__anext__()
    flushed = await tokenizer_manager.flush_cache()
    logger.info("oscar: warm-up prompts of %d and %d tokens (chunked prefill, prefix read, decode) in %.1f s%s",
                first, second, time.perf_counter() - start,
                "" if getattr(flushed, "success", True) else "; the radix cache was not flushed")


def register() -> None:
    """Make ``--warmups oscar_prefix_read`` known to SGLang (idempotent)."""
    register_warmup(WARMUP_NAME, oscar_prefix_read)
