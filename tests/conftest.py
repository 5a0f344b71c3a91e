"""Shared test fixtures: paths to ../shared assets, GPU skipping, interpreter mode."""
import os
from pathlib import Path

import pytest

# Triton reads TRITON_INTERPRET once, when it is first imported (transformers may import it
# early), so CPU-only runs switch the interpreter on before any test module loads.
if "TRITON_INTERPRET" not in os.environ:
    import torch  # importing torch does not import triton

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OSCAR_SHARED", ROOT.parent / "shared"))
_TINYLM_CANDIDATES = [SHARED / "models" / "tinylm-A", ROOT / ".device" / "models" / "tinylm-A"]
TINYLM = Path(os.environ.get("OSCAR_TINYLM") or next(
    (p for p in _TINYLM_CANDIDATES if (p / "config.json").is_file()), _TINYLM_CANDIDATES[0]))


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU test; run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tinylm_dir() -> Path:
    if not (TINYLM / "config.json").is_file():
        pytest.skip(f"tinylm-A not found at {TINYLM} (needs ../shared/models/tinylm-A)")
    return TINYLM
