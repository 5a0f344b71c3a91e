"""Calibration / evaluation text: where it comes from and how it becomes token windows.

- :func:`stdlib_files` - the Python standard library's own ``*.py`` source (always present
  offline), sorted, without ``site-packages`` and test folders.
- :func:`read_texts` - texts from files, folders (recursively, text suffixes) and ``.jsonl``
  files (their ``"text"`` field), in a deterministic order.
- :func:`token_stream` - concatenate tokenised texts (each preceded by the tokenizer's BOS,
  or EOS when it has no BOS, as the model saw documents in training) and cut the stream
  into ``[seq_len]`` windows until ``max_tokens`` tokens have been produced.
"""
from __future__ import annotations

import json
import os
import random
import sysconfig
from collections.abc import Iterable, Iterator
from itertools import islice

import torch

TEXT_SUFFIXES = (".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".rs",
                 ".go", ".java", ".sh", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".html", ".tex")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__", ".git"})
MAX_LINE_CHARS = 5000  # longer lines = generated tables, not text worth calibrating on


def stdlib_root() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def _walk(root: str, suffixes: tuple[str, ...], excluded: frozenset[str]) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in excluded)
        out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(suffixes))
    return sorted(out)


def stdlib_files() -> list[str]:
    """The standard library's ``*.py`` files (sorted; no site-packages, no test folders)."""
    return _walk(stdlib_root(), (".py",), EXCLUDED_DIRS)


def stdlib_test_files() -> list[str]:
    """The standard library's test-suite ``*.py`` files: text disjoint from :func:`stdlib_files`."""
    root = stdlib_root()
    files = []
    for d in ("test", os.path.join("idlelib", "idle_test")):
        if os.path.isdir(os.path.join(root, d)):
            files += _walk(os.path.join(root, d), (".py",), frozenset({"__pycache__"}))
    return sorted(files)


def _text_or_reason(path: str, max_mean_line: int | None = None) -> tuple[str | None, str]:
    """(the file's text, "") or (None, why it is not calibration text)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    if not raw:
        return None, "empty"
    if b"\x00" in raw:
        return None, "binary (it holds NUL bytes)"
    text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
    if max_mean_line is not None and len(text) / (text.count("\n") + 1) > max_mean_line:
        return None, f"minified (lines over {max_mean_line} characters on average)"
    if max(map(len, text.split("\n"))) > MAX_LINE_CHARS:
        return None, f"generated-looking (a line over {MAX_LINE_CHARS} characters)"
    return text, ""


def read_text_file(path: str, max_mean_line: int | None = None) -> str | None:
    """A text file's contents, or None for binary / unreadable / generated-looking files (a line
    over MAX_LINE_CHARS, or lines longer than ``max_mean_line`` on average: minified)."""
    return _text_or_reason(path, max_mean_line)[0]


def _read_jsonl(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not valid JSON") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise ValueError(f"{path}:{n}: expected an object with a string field 'text'")
            if rec["text"]:
                yield rec["text"]


def expand_paths(paths: Iterable[str]) -> list[str]:
    """Files named by ``paths`` (folders expanded recursively to text files, sorted)."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += _walk(p, TEXT_SUFFIXES + (".jsonl",), frozenset({"__pycache__", ".git"}))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"calibration text {p!r}: no such file or folder")
    return files


def _path_problem(path: str) -> str | None:
    """Why ``path`` (a file or folder of --data) yields no text; reads until its first text."""
    files = expand_paths([path])
    if not files:
        return f"the folder holds no text files ({', '.join(TEXT_SUFFIXES[:4])}, ... or .jsonl)"
    first = None
    for f in files:
        if f.endswith(".jsonl"):
            found = next(_read_jsonl(f), None) is not None
            why = "no record with a non-empty 'text'"
        else:
            found, why = _text_or_reason(f)
        if found:
            return None
        first = first or (why if f == path else f"{f}: {why}")
    if files == [path]:
        return f"not calibration text: {first}"
    return f"none of its {len(files)} files is calibration text (first: {first})"


def check_texts(paths: Iterable[str]) -> None:
    """Refuse, in one line naming the path and the problem, a --data path without text:
    before a model loads, rather than after as '0 tokens'."""
    for p in paths:
        why = _path_problem(p)
        if why:
            raise ValueError(f"--data {p}: {why}")


def read_texts(paths: Iterable[str]) -> Iterator[str]:
    """Yield texts from files / folders / ``.jsonl`` files, lazily and in order."""
    for path in expand_paths(paths):
        if path.endswith(".jsonl"):
            yield from _read_jsonl(path)
        else:
            text = read_text_file(path)
            if text is not None:
                yield text


def shuffled(paths: list[str], seed: int) -> list[str]:
    """A deterministic (seeded) shuffle, so a small token budget sees many files."""
    out = list(paths)
    random.Random(seed).shuffle(out)
    return out


def document_separator(tokenizer) -> int | None:
    """Token that starts each document: BOS, else EOS (tinylm/Qwen use EOS as BOS), else none."""
    for name in ("bos_token_id", "eos_token_id"):
        t = getattr(tokenizer, name, None)
        if isinstance(t, int):
            return t
    return None


def token_stream(tokenizer, texts: Iterable[str], seq_len: int, max_tokens: int) -> Iterator[torch.Tensor]:
    """Yield int64 windows ``[min(seq_len, max_tokens)]`` of the concatenated token stream,
    ``max_tokens // window`` of them at most (fewer if the texts run out)."""
    if seq_len < 1 or max_tokens < 1:
        raise ValueError(f"seq_len ({seq_len}) and max_tokens ({max_tokens}) must be >= 1")
    window = min(seq_len, max_tokens)
    n_windows = max_tokens // window
    sep = document_separator(tokenizer)
    buf: list[int] = []
    done = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        buf += ([sep] if sep is not None else []) + list(ids)
        while len(buf) >= window and done < n_windows:
            yield torch.tensor(buf[:window], dtype=torch.long)
            del buf[:window]
            done += 1
        if done >= n_windows:
            return


def batched(windows: Iterable[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Stack consecutive windows into ``[B, T]`` batches (the last one may be smaller)."""
    it = iter(windows)
    while batch := list(islice(it, batch_size)):
        yield torch.stack(batch)


def describe(paths: list[str] | None) -> str:
    """One line naming the calibration text (recorded in the rotations file)."""
    if not paths:
        return f"python stdlib source ({stdlib_root()}, *.py, no tests)"
    return ", ".join(os.path.abspath(p) for p in paths)
