"""Fixed prompt cut points for oscar_int2 under --enable-deterministic-inference.

Inside a prefill chunk, attention reads the chunk's own keys fresh in BF16; across chunks it
reads the cache (INT2 outside the sink and recent windows). A prompt's outputs therefore
depend on where it is cut into chunks, and under load SGLang cuts where the batch's token
budget runs out. SGLang aligns cuts to the scheduler's ``truncation_align_size`` (set for
oscar by ``plugin.deterministic_truncation_hook``: --chunked-prefill-size, page-aligned) in
``PrefillAdder.add_one_req``'s chunking branch only. Two other paths cut anywhere:

- ``add_one_req_ignore_eos`` (requests with ``ignore_eos`` while the radix cache is off,
  which deterministic inference forces for oscar) cuts at the batch's remaining budget;
- ``add_chunked_req`` (a prompt's next chunk) cuts at min(chunk budget, free pool tokens).

The two hooks below round those budgets down to a multiple of the alignment. A new prompt
that does not fit waits for the next batch (as in SGLang's own branch); a prompt already
being prefilled must be scheduled (SGLang would leak it otherwise), so if the free pool is
under one alignment step it keeps SGLang's cut (logged).
"""
from __future__ import annotations

import logging
from typing import Optional

from .sglang_bridge import AddReqResult

logger = logging.getLogger(__name__)

# this scheduler process's cut alignment (None: SGLang's behaviour unchanged)
_alignment: Optional[int] = None


def set_alignment(align: Optional[int]) -> None:
    global _alignment
    _alignment = align


def aligned_budget(budget: int, remaining: int, align: Optional[int]) -> int:
    """Tokens a prompt with ``remaining`` tokens left may take from ``budget``: the budget
    when it fits whole (or no alignment), else the budget rounded down to ``align``
    (0: the prompt must wait)."""
    if align is None or remaining <= budget:
        return budget
    return budget // align * align


def _remaining(req) -> int:
    return len(req.full_untruncated_fill_ids) - len(req.prefix_indices)


def _aligned_call(original, adder, req, args, kwargs, available: int, under_one_step):
    """``original`` with the chunk budget ``available`` rounded down to the alignment when
    the prompt does not fit it whole; ``under_one_step()`` answers when that leaves nothing.
    The withheld tokens are handed back afterwards (prompts that fit whole may use them)."""
    budget = aligned_budget(available, _remaining(req), _alignment)
    if budget == available:
        return original(adder, req, *args, **kwargs)
    if budget <= 0:
        return under_one_step()
    withheld = adder.rem_chunk_tokens - budget
    adder.rem_chunk_tokens = budget
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        adder.rem_chunk_tokens += withheld


def _inactive(adder) -> bool:
    return _alignment is None or adder.rem_chunk_tokens is None or adder.dllm_config is not None


def ignore_eos_hook(original, adder, req, *args, **kwargs):
    """PrefillAdder.add_one_req_ignore_eos, around: a new prompt that does not fit the
    batch's chunk budget is cut at a multiple of the alignment, or waits."""
    if _inactive(adder):
        return original(adder, req, *args, **kwargs)
    return _aligned_call(original, adder, req, args, kwargs, adder.rem_chunk_tokens,
                         lambda: AddReqResult.OTHER)


def chunked_req_hook(original, adder, req, *args, **kwargs):
    """PrefillAdder.add_chunked_req, around: a prompt's next chunk ends at a multiple of
    the alignment also when the free pool tokens (or mixed decode tokens) shorten it."""
    if _inactive(adder):
        return original(adder, req, *args, **kwargs)
    available = min(adder.rem_chunk_tokens, int(adder.rem_total_tokens))

    def unaligned():
        logger.warning("oscar: %d free tokens, under one %d-token step: request %s continues "
                       "with an unaligned chunk (deterministic outputs not guaranteed for it)",
                       available, _alignment, req.rid)
        return original(adder, req, *args, **kwargs)
    return _aligned_call(original, adder, req, args, kwargs, available, unaligned)
