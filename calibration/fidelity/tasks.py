"""Evaluation text and passkey prompts, built exactly as tinylm's own eval builds them.

No model and no torch here: only a tokenizer (anything with ``encode``/``decode`` in the
style of ``transformers`` tokenizers or ``tokenizers.Tokenizer``), so the server benchmark
can send the very same token ids through the OpenAI endpoint.

Held-out text (:func:`load_heldout_stream`), as ``tinylm_train.py`` makes its eval stream:
  the ``*.py`` files (<= 1 MiB, no ``__pycache__``, no symlinks) of the held-out top-level
  packages (sympy, networkx, plus every top-level name their dist-info RECORD lists, e.g.
  ``isympy``) under the interpreter's site-packages, sorted by path, shuffled with
  ``random.Random(12345)``, taken in that order until 10 MB are read; files with NUL
  bytes, > 200 chars/line on average or any line > 5000 chars are dropped; each file is
  tokenized without special tokens and prefixed with ``<|endoftext|>``; exact duplicate
  files (md5 of the text) are kept once; everything is concatenated into one stream.

Perplexity windows (:func:`ppl_window_starts`): ``n`` windows of ``L + 1`` tokens at
  ``start_i = i * ((len(stream) - 1 - L) // (n - 1))``, evenly spread over the stream.

Passkey (:class:`Passkey`, :func:`passkey_prompts`): a prompt of ``L - 16`` tokens =
  ``<|endoftext|>`` + held-out code filler with the needle line
  ``\\nPASSKEY_<6 of A-Z0-9> = "<6 hex>"`` inserted before the first line-starting token at
  or after ``depth * len(filler)`` + the query ``\\nassert PASSKEY_<id> == "``. One
  ``numpy.random.default_rng(777)`` draws every prompt, length by length, depth by depth,
  trial by trial. Scoring (:func:`passkey_hit`): greedy decoding of up to 10 tokens, decoded
  with special tokens skipped; a hit when the first 6 characters equal the value.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import site
import sysconfig
from contextlib import suppress
from dataclasses import dataclass

import numpy as np

from calibration.text_sources import read_text_file

EOT = "<|endoftext|>"
HELDOUT_PACKAGES = ("sympy", "networkx")
HELDOUT_SHUFFLE_SEED = 12345
HELDOUT_CORPUS_MB = 10.0
MAX_FILE_BYTES = 1024 * 1024
PASSKEY_SEED = 777
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
PASSKEY_PROMPT_MARGIN = 16  # tinylm builds prompts of L - 16 tokens
PASSKEY_MAX_NEW_TOKENS = 10
PASSKEY_VALUE_CHARS = 6
PASSKEY_NEEDLE = '\nPASSKEY_{pid} = "{val}"'  # pid: 6 of A-Z0-9, val: 6 hex digits
PASSKEY_QUERY = '\nassert PASSKEY_{pid} == "'
_SKIP_TOP_SUFFIXES = (".dist-info", ".egg-info", ".libs", ".data")
HEX = np.array(list("0123456789abcdef"))
IDCH = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"))


# ---------------------------------------------------------------- tokenizer adapters
def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (HF tokenizer or tokenizers.Tokenizer)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(ids, "ids", ids))


def decode(tokenizer, ids, skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def token_id(tokenizer, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token) if hasattr(tokenizer, "convert_tokens_to_ids") \
        else tokenizer.token_to_id(token)
    if tid is None or tid < 0:
        raise ValueError(f"tokenizer has no token {token!r}")
    return int(tid)


def vocab_size(tokenizer) -> int:
    return len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.get_vocab_size()


def line_start_mask(tokenizer) -> np.ndarray:
    """Tokens whose text starts with a newline (where a needle line may be inserted)."""
    n = vocab_size(tokenizer)
    return np.array([decode(tokenizer, [i], skip_special_tokens=False).startswith("\n")
                     for i in range(n)], dtype=bool)


# ---------------------------------------------------------------- held-out text
def site_roots() -> list[str]:
    """The interpreter's site-packages folders (tinylm's corpus roots)."""
    cands = []
    with suppress(Exception):
        cands += site.getsitepackages()
    with suppress(Exception):
        cands.append(site.getusersitepackages())
    for k in ("purelib", "platlib"):
        cands.append(sysconfig.get_paths().get(k))
    # where the held-out packages import from, when that is outside these (a .pth or PYTHONPATH)
    for pkg in HELDOUT_PACKAGES:
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            cands.append(os.path.dirname(loc))
    return list(dict.fromkeys(os.path.realpath(c) for c in cands if c and os.path.isdir(c)))


def heldout_top_names(roots: list[str], packages) -> set[str]:
    """The packages plus every top-level name their installed dist-info RECORD lists."""
    names = set(packages)
    norm = {p.lower().replace("-", "_") for p in packages}
    for r in roots:
        try:
            entries = os.listdir(r)
        except OSError:
            continue
        for e in entries:
            if not e.endswith(".dist-info"):
                continue
            if e[: -len(".dist-info")].split("-")[0].lower().replace("-", "_") not in norm:
                continue
            with (suppress(OSError),
                  open(os.path.join(r, e, "RECORD"), encoding="utf-8", errors="replace") as f):
                for line in f:
                    p = line.split(",")[0]
                    if not p or p.startswith(".."):
                        continue
                    top = p.split("/")[0]
                    if top.endswith(_SKIP_TOP_SUFFIXES) or top == "__pycache__":
                        continue
                    names.add(top[:-3] if top.endswith(".py") else top)
    return names


def _walk_py(path: str) -> list[tuple[str, int]]:
    if os.path.isfile(path):
        sz = os.stat(path).st_size
        return [(path, sz)] if 0 < sz <= MAX_FILE_BYTES else []
    out, stack = [], [path]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        if e.name != "__pycache__":
                            stack.append(e.path)
                    elif e.name.endswith(".py") and e.is_file(follow_symlinks=False):
                        sz = e.stat(follow_symlinks=False).st_size
                        if 0 < sz <= MAX_FILE_BYTES:
                            out.append((e.path, sz))
        except OSError:
            continue
    return out


def heldout_files(packages=HELDOUT_PACKAGES, roots: list[str] | None = None) -> list[tuple[str, int]]:
    """(path, size) of the held-out files, sorted then shuffled as tinylm does."""
    roots = roots if roots is not None else site_roots()
    hold = heldout_top_names(roots, packages)
    files, seen = [], set()
    for r in roots:
        try:
            entries = sorted(os.listdir(r))
        except OSError:
            continue
        for e in entries:
            if e.endswith(_SKIP_TOP_SUFFIXES) or e in ("__pycache__", "site-packages", "dist-packages"):
                continue
            full = os.path.join(r, e)
            if os.path.isdir(full) and not os.path.islink(full):
                top = e
            elif e.endswith(".py") and os.path.isfile(full):
                top = e[:-3]
            else:
                continue
            if top not in hold:
                continue
            for p, sz in _walk_py(full):
                rp = os.path.realpath(p)
                if rp not in seen:
                    seen.add(rp)
                    files.append((p, sz))
    if not files:
        raise FileNotFoundError(f"no held-out files of {', '.join(packages)} under {roots}; "
                                f"install them (pip install {' '.join(packages)})")
    files.sort()
    random.Random(HELDOUT_SHUFFLE_SEED).shuffle(files)
    return files


@dataclass
class HeldoutStream:
    tokens: np.ndarray  # int64 [N]
    description: dict


def _package_versions(packages) -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for p in packages:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def load_heldout_stream(tokenizer, packages=HELDOUT_PACKAGES, corpus_mb: float = HELDOUT_CORPUS_MB,
                        roots: list[str] | None = None) -> HeldoutStream:
    """The held-out token stream (see module doc) and a description of it."""
    files = heldout_files(packages, roots)
    taken, nbytes = [], 0
    for p, sz in files:
        if nbytes >= corpus_mb * 1e6:
            break
        taken.append(p)
        nbytes += sz
    eot = token_id(tokenizer, EOT)
    texts, hashes = [], set()
    for p in taken:
        t = read_text_file(p, max_mean_line=200)  # tinylm's reader: minified files out
        if t is None:
            continue
        h = hashlib.md5(t.encode("utf-8", errors="replace")).digest()
        if h in hashes:
            continue
        hashes.add(h)
        texts.append(t)
    fast = getattr(tokenizer, "backend_tokenizer", tokenizer)  # the Rust tokenizer if there is one
    if hasattr(fast, "encode_batch"):
        encs = [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)]
    else:
        encs = [encode(tokenizer, t) for t in texts]
    parts = [np.concatenate([[eot], np.asarray(e, dtype=np.int64)]) for e in encs]
    tokens = np.concatenate(parts).astype(np.int64)
    desc = {
        "source": f"held-out Python source of {', '.join(packages)} (tinylm-A never trained on them)",
        "packages": _package_versions(packages),
        "files": len(texts), "chars": sum(len(t) for t in texts), "tokens": int(tokens.size),
        "corpus_mb": corpus_mb, "shuffle_seed": HELDOUT_SHUFFLE_SEED,
        "tokens_sha256": hashlib.sha256(tokens.astype("<i8").tobytes()).hexdigest()[:16],
    }
    return HeldoutStream(tokens, desc)


def ppl_window_starts(stream_len: int, length: int, windows: int) -> list[int]:
    """Start offsets of up to ``windows`` windows of ``length + 1`` tokens (tinylm's choice)."""
    n = min(windows, (stream_len - 1) // length)
    if n <= 0:
        raise ValueError(f"held-out stream of {stream_len} tokens has no window of {length + 1} tokens")
    stride = (stream_len - 1 - length) // (n - 1) if n > 1 else 0
    return [i * stride for i in range(n)]


# ---------------------------------------------------------------- passkey
class Passkey:
    """tinylm_train.py's passkey builder (eval part), token-exact."""

    def __init__(self, tokenizer, stream: np.ndarray):
        self.tok = tokenizer
        self.stream = np.asarray(stream)
        self.nl_pos = np.flatnonzero(line_start_mask(tokenizer)[self.stream]).astype(np.int64)
        self.eot = token_id(tokenizer, EOT)

    def enc(self, s: str) -> np.ndarray:
        return np.asarray(encode(self.tok, s), dtype=np.int64)

    @staticmethod
    def rand_kv(rng):
        return "".join(rng.choice(IDCH, 6)), "".join(rng.choice(HEX, 6))

    def _filler_with_needle(self, rng, flen, needle, depth):
        """flen filler tokens from a random start with ``needle`` inserted before the first
        line-starting token at or after ``depth * flen``."""
        s = int(rng.integers(0, max(1, len(self.stream) - flen)))
        filler = self.stream[s:s + flen].astype(np.int64)
        tgt = s + int(depth * flen)
        j = np.searchsorted(self.nl_pos, tgt)
        cut = int(self.nl_pos[j]) - s if j < len(self.nl_pos) and self.nl_pos[j] < s + flen else tgt - s
        cut = min(cut, flen)
        return np.concatenate([filler[:cut], needle, filler[cut:]])

    def eval_prompt(self, rng, length: int, depth: float):
        """Prompt of exactly ``length`` tokens ending in ``assert PASSKEY_<id> == "``;
        returns (ids int64 [length], value)."""
        pid, val = self.rand_kv(rng)
        needle = self.enc(PASSKEY_NEEDLE.format(pid=pid, val=val))
        query = self.enc(PASSKEY_QUERY.format(pid=pid))
        flen = length - 1 - len(needle) - len(query)
        if flen < 1:
            raise ValueError(f"a passkey prompt of {length} tokens cannot hold <|endoftext|>, the needle "
                             f"({len(needle)} tokens), the query ({len(query)}) and filler")
        body = self._filler_with_needle(rng, flen, needle, depth)
        return np.concatenate([[self.eot], body, query]), val


@dataclass
class PasskeyPrompt:
    length: int  # the nominal length L (the prompt has L - 16 tokens)
    depth: float
    trial: int
    ids: np.ndarray
    value: str


def passkey_prompts(pk: Passkey, lengths, depths=PASSKEY_DEPTHS, trials: int = 20,
                    seed: int = PASSKEY_SEED) -> list[PasskeyPrompt]:
    """All prompts in tinylm's order: one rng, length-major, then depth, then trial."""
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        for d in depths:
            for t in range(trials):
                ids, val = pk.eval_prompt(rng, int(length) - PASSKEY_PROMPT_MARGIN, float(d))
                out.append(PasskeyPrompt(int(length), float(d), t, ids, val))
    return out


def passkey_min_length() -> int:
    """The shortest nominal length L whose prompt (L - 16 tokens) always holds ``<|endoftext|>``,
    the needle, the query and one filler token, for a tokenizer that spends at most one token per
    byte of ASCII text plus one word-start marker per encoded piece (byte-level BPE spends at
    most one per byte); Passkey.eval_prompt refuses a shorter prompt of any other tokenizer."""
    pid, val = "X" * 6, "0" * PASSKEY_VALUE_CHARS
    pieces = (PASSKEY_NEEDLE.format(pid=pid, val=val), PASSKEY_QUERY.format(pid=pid))
    return PASSKEY_PROMPT_MARGIN + 1 + sum(len(p.encode()) + 1 for p in pieces) + 1


def passkey_hit(generated_text: str, value: str) -> bool:
    """tinylm's scoring: the first 6 generated characters are the value."""
    return generated_text[:PASSKEY_VALUE_CHARS] == value


def passkey_answer_settled(generated_text: str) -> bool:
    """True once more tokens cannot change the score: 6 characters are decoded and they are
    ASCII (byte-level BPE only rewrites a trailing incomplete UTF-8 character, and a
    non-ASCII character among the first 6 is a miss either way)."""
    head = generated_text[:PASSKEY_VALUE_CHARS]
    return len(head) == PASSKEY_VALUE_CHARS or any(ord(c) > 127 for c in head)
