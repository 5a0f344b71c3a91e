"""Edit a rotations file on disk and read its one-line refusal (the loader tests)."""
from __future__ import annotations

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from oscar_kernels.contract.rotations_file import RotationsFileError, load_rotations


def rewrite(path, out, tensors=None, meta=None):
    """A copy of ``path`` at ``out`` after ``tensors(dict)`` and ``meta(dict)`` edited it in place."""
    with safe_open(path, framework="pt") as f:
        md = dict(f.metadata())
    t = load_file(path)
    if tensors:
        tensors(t)
    if meta:
        meta(md)
    save_file(t, out, metadata=md)
    return out


def refusal(path, expect=None) -> str:
    """load_rotations' message for ``path``, checked to be one line naming the file."""
    with pytest.raises(RotationsFileError) as e:
        load_rotations(path, expect=expect)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"oscar rotations file {path}:")
    return msg
