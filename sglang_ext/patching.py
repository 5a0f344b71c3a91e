"""``oscar-sglang patch --check | --apply | --revert``: the patches/*.diff against sglang 0.5.17.

The diffs are unified diffs whose paths are relative to the sglang package directory
(``a/srt/server_args.py``). They are applied by a small exact-match applier (no fuzz: a
hunk whose old or new lines are not found verbatim is *drifted*), so the same code
checks, applies and reverts, and reverting restores byte-identical files.

State of a patch: ``applied`` (every hunk's new lines present), ``not applied`` (every
hunk's old lines present), otherwise ``drifted``. --check exits 1 on drift, --apply and
--revert refuse to write anything when any patch has drifted; another sglang version is
refused with exit code 2.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SGLANG_VERSION = "0.5.17"
APPLIED, NOT_APPLIED, DRIFTED = "applied", "not applied", "drifted"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    """A patch that cannot be parsed, checked or applied; the message is one line."""


@dataclass
class Hunk:
    old_start: int  # 1-based line number in the original file
    old: list[str] = field(default_factory=list)  # context + removed lines
    new: list[str] = field(default_factory=list)  # context + added lines


@dataclass
class FilePatch:
    path: str  # relative to the sglang package directory
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    name: str
    files: list[FilePatch]


def _strip_prefix(header: str) -> str:
    path = header.split("\t", 1)[0].strip()
    return path[2:] if path[:2] in ("a/", "b/") else path


def parse_diff(text: str, name: str = "<diff>") -> Patch:
    """Parse a unified diff (only what `diff -u` / `git diff` produce for text files)."""
    files: list[FilePatch] = []
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_strip_prefix(lines[i + 1][4:])))
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise PatchError(f"{name}: hunk before any file header")
            hunk = Hunk(int(m.group(1)))
            n_old = int(m.group(2) or 1)
            n_new = int(m.group(4) or 1)
            i += 1
            while (len(hunk.old) < n_old or len(hunk.new) < n_new) and i < len(lines):
                body = lines[i]
                tag, rest = body[:1], body[1:]
                if tag == " " or body == "":
                    hunk.old.append(rest)
                    hunk.new.append(rest)
                elif tag == "-":
                    hunk.old.append(rest)
                elif tag == "+":
                    hunk.new.append(rest)
                elif tag == "\\":
                    pass
                else:
                    raise PatchError(f"{name}: unexpected line in hunk: {body[:60]!r}")
                i += 1
            if len(hunk.old) != n_old or len(hunk.new) != n_new:
                raise PatchError(f"{name}: truncated hunk at line {hunk.old_start}")
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files or not any(f.hunks for f in files):
        raise PatchError(f"{name}: no hunks found")
    return Patch(name, files)


def _find(lines: list[str], block: list[str], expected: int) -> int:
    """Index where ``block`` occurs in ``lines``, nearest to ``expected``; -1 if absent."""
    n = len(block)
    candidates = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == block]
    return min(candidates, key=lambda i: abs(i - expected)) if candidates else -1


def _read_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    if "\r" in text:
        raise PatchError(f"{path}: CRLF line endings are not supported")
    return text.split("\n")


def _write_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + f".oscar-tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write("\n".join(lines))
    os.chmod(tmp, os.stat(path).st_mode & 0o7777)
    os.replace(tmp, path)


def hunk_states(fp: FilePatch, root: Path) -> list[str]:
    target = root / fp.path
    if not target.is_file():
        return [DRIFTED] * len(fp.hunks)
    lines = _read_lines(target)
    states = []
    for h in fp.hunks:
        at = h.old_start - 1
        if _find(lines, h.new, at) >= 0:
            states.append(APPLIED)
        elif _find(lines, h.old, at) >= 0:
            states.append(NOT_APPLIED)
        else:
            states.append(DRIFTED)
    return states


def patch_state(patch: Patch, root: Path) -> tuple[str, list[str]]:
    """(state, one detail line per drifted hunk)."""
    all_states, details = [], []
    for fp in patch.files:
        for h, st in zip(fp.hunks, hunk_states(fp, root)):
            all_states.append(st)
            if st == DRIFTED:
                what = "file missing" if not (root / fp.path).is_file() else "hunk does not match"
                details.append(f"{fp.path}: hunk at line {h.old_start}: {what}")
    if all(s == APPLIED for s in all_states):
        return APPLIED, details
    if all(s == NOT_APPLIED for s in all_states):
        return NOT_APPLIED, details
    if not details:
        details.append("partly applied (some hunks applied, others not)")
    return DRIFTED, details


def _transform(patch: Patch, root: Path, reverse: bool) -> None:
    for fp in patch.files:
        target = root / fp.path
        lines = _read_lines(target)
        shift = 0
        for h in fp.hunks:
            old, new = (h.new, h.old) if reverse else (h.old, h.new)
            at = _find(lines, old, h.old_start - 1 + shift)
            if at < 0:
                raise PatchError(f"{patch.name}: {fp.path}: hunk at line {h.old_start} does not match")
            lines[at:at + len(old)] = new
            shift += len(new) - len(old)
        _write_lines(target, lines)


def apply_patch(patch: Patch, root: Path) -> None:
    _transform(patch, root, reverse=False)


def revert_patch(patch: Patch, root: Path) -> None:
    _transform(patch, root, reverse=True)


# ---------------------------------------------------------------------------- locations


def patches_dir() -> Path:
    """The shipped diffs: sglang_ext/patches/ in an installed package (setup.py maps the
    repository's patches/ there), patches/ next to sglang_ext/ in a source checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "patches", here.parent / "patches"):
        if cand.is_dir() and any(cand.glob("*.diff")):
            return cand
    raise PatchError(f"no patches/*.diff found next to {here} (broken oscar-sglang install?)")


def load_patches(directory: Path | None = None) -> list[Patch]:
    directory = Path(directory) if directory is not None else patches_dir()
    paths = sorted(directory.glob("*.diff"))
    if not paths:
        raise PatchError(f"no *.diff in {directory}")
    return [parse_diff(p.read_text(encoding="utf-8"), p.name) for p in paths]


def installed_sglang_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("sglang is not installed in this Python environment")
    return Path(list(spec.submodule_search_locations)[0])


def sglang_version(root: Path) -> str:
    """The version recorded in <sglang>/_version.py (written by sglang's build)."""
    vfile = root / "_version.py"
    if not vfile.is_file():
        raise PatchError(f"{root} has no _version.py: not an installed sglang package")
    m = re.search(r"""^__version__\s*=.*?['"]([^'"]+)['"]""", vfile.read_text(encoding="utf-8"), re.M)
    if not m:
        raise PatchError(f"{vfile}: no __version__ found")
    return m.group(1)


def check_version(root: Path) -> None:
    version = sglang_version(root)
    if version != SGLANG_VERSION:
        raise PatchError(f"sglang {version} at {root}: these patches are for sglang {SGLANG_VERSION} only "
                         f"(pip install sglang=={SGLANG_VERSION})")


# ---------------------------------------------------------------------------- CLI


def run(action: str, root: Path, patches: list[Patch], out=print) -> int:
    states = {p.name: patch_state(p, root) for p in patches}
    for name, (state, details) in states.items():
        out(f"{name}: {state}" + "".join(f"\n  {d}" for d in details))
    drifted = [n for n, (s, _) in states.items() if s == DRIFTED]
    if action == "check":
        return 1 if drifted else 0
    if drifted:
        out(f"oscar-sglang patch: refusing to --{action}: {', '.join(drifted)} drifted "
            f"(is {root} a modified sglang {SGLANG_VERSION}?)")
        return 1
    todo_state = NOT_APPLIED if action == "apply" else APPLIED
    for p in patches:
        if states[p.name][0] == todo_state:
            (apply_patch if action == "apply" else revert_patch)(p, root)
            out(f"{p.name}: {'applied' if action == 'apply' else 'reverted'}")
        else:
            out(f"{p.name}: already {'applied' if action == 'apply' else 'not applied'}, nothing to do")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="oscar-sglang patch",
        description=f"Check, apply or revert oscar-sglang's patches to sglang {SGLANG_VERSION} "
                    "(first-class --oscar-* ServerArgs fields and the oscar_int2 kv-cache-dtype choice).")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_const", dest="action", const="check",
                      help="report applied / not applied / drifted (exit 1 on drift)")
    mode.add_argument("--apply", action="store_const", dest="action", const="apply")
    mode.add_argument("--revert", action="store_const", dest="action", const="revert")
    parser.add_argument("--sglang-dir", default=None,
                        help="sglang package directory (default: the installed sglang)")
    parser.add_argument("--patches-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        root = Path(args.sglang_dir) if args.sglang_dir else installed_sglang_dir()
        check_version(root)
        patches = load_patches(args.patches_dir)
        print(f"sglang {SGLANG_VERSION} at {root}")
        return run(args.action, root, patches)
    except PatchError as e:
        print(f"oscar-sglang patch: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"oscar-sglang patch: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
