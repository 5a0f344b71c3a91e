"""Argument types shared by ``oscar-eval`` and ``benchmarks.server_fidelity``: each refuses a
bad value with one line (argparse prints it as ``PROG: error: argument --flag: why`` and exits 2)."""
from __future__ import annotations

import argparse
import sys

from . import tasks


class Refusal(SystemExit):
    """A bad input found after parsing: ``PROG: error: message`` on stderr once raised, exit
    status 2 (as argparse's refusals); ``str()`` is the message."""

    def __init__(self, prog: str, message: str):
        super().__init__(2)
        self.message = message
        print(f"{prog}: error: {message}", file=sys.stderr)

    def __str__(self) -> str:
        return self.message


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {s!r}")
    return out


def at_least(low: int):
    """An integer >= ``low``."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {s!r}")
        return v
    return parse


def ppl_lengths(s: str) -> list[int]:
    """Perplexity window lengths, each >= 2 tokens, no repeats: '2048,4096,8192'."""
    out = _ints(s)
    bad = [v for v in out if v < 2]
    if bad:
        raise argparse.ArgumentTypeError(f"perplexity windows must be >= 2 tokens, got {bad[0]}")
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"a length is repeated in {s!r}")
    return out


def passkey_lengths(s: str) -> list[int]:
    """Passkey lengths, each long enough for a prompt (tasks.passkey_min_length)."""
    out = _ints(s)
    low = tasks.passkey_min_length()
    bad = [v for v in out if v < low]
    if bad:
        raise argparse.ArgumentTypeError(
            f"a passkey prompt of length {bad[0]} cannot hold its needle and query: lengths must be >= {low} "
            f"(the prompt has L - {tasks.PASSKEY_PROMPT_MARGIN} tokens)")
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"a length is repeated in {s!r}")
    return out


def depths(s: str) -> list[float]:
    """Needle depths, each strictly between 0 and 1: '0.1,0.5,0.9'."""
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not out or any(not 0.0 < d < 1.0 for d in out):
        raise argparse.ArgumentTypeError(f"depths must lie strictly between 0 and 1, got {s!r}")
    return out


def layer_list(s: str) -> list[int]:
    """Model layers, sorted, no repeats: '0,3,5-7' (ranges inclusive)."""
    out = []
    for part in (x.strip() for x in s.split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"expected layers such as 0,3,5-7, got {s!r}")
        out += range(int(lo), int(hi if dash else lo) + 1)
    if not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"no layer or a layer repeated in {s!r}")
    return sorted(out)


def ppl_key(length: int) -> str:
    """The results' key of a perplexity length: ppl_8k for 8192, ppl_300 for 300."""
    return f"ppl_{length // 1024}k" if length % 1024 == 0 else f"ppl_{length}"
