"""Read the marked command blocks out of README.md (stdlib only: runs before any install).

A marked block is one fenced code block between two HTML comments:

    <!-- BEGIN test-command -->
    ```bash
    python3 -m venv .venv && ...
    ```
    <!-- END test-command -->

`.ci/run` executes the `test-command` block verbatim, so the README and CI cannot drift;
tests/test_release_ci.py checks the extraction, docker/Dockerfile is compared with the
`install` block.

Usage: python3 .ci/readme_blocks.py README.md NAME   (prints the block's body)
"""
from __future__ import annotations

import re
import sys

_FENCE = re.compile(r"^(?P<fence>```+|~~~+)[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.S | re.M)


class ReadmeBlockError(ValueError):
    """The README does not hold exactly one well-formed block under that name."""


def marked_block(text: str, name: str) -> str:
    """The body of the single fenced code block between the BEGIN/END markers of `name`."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ReadmeBlockError(f"README must hold exactly one '{begin}' and one '{end}' marker "
                               f"(found {text.count(begin)} and {text.count(end)})")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise ReadmeBlockError(f"'{end}' comes before '{begin}'")
    fences = list(_FENCE.finditer(text[start:stop]))
    if len(fences) != 1:
        raise ReadmeBlockError(f"the '{name}' markers must enclose exactly one fenced code block "
                               f"(found {len(fences)})")
    body = fences[0].group("body").strip()
    if not body:
        raise ReadmeBlockError(f"the '{name}' code block is empty")
    return body + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: readme_blocks.py README.md BLOCK_NAME", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        text = f.read()
    try:
        sys.stdout.write(marked_block(text, argv[1]))
    except ReadmeBlockError as e:
        print(f"{argv[0]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
