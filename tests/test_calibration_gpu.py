"""oscar-calibrate on CUDA agrees with CPU (run on the GPU machine: pytest -m gpu)."""
import pytest
import torch

from calibration.calibrate import CalibrationConfig, calibrate, collect_stats, load_model
from calibration.cli import main
from oscar_kernels.contract.rotations_file import load_rotations
from calibration.calibrate import model_shape
from calibration_helpers import save_tiny_model_dir
from calibration.transforms import bit_reversal_permutation, hadamard_matrix, permutation_matrix

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny_gpu") / "qwen3", "qwen3", kv_heads=2, head_dim=64)


def test_cuda_statistics_match_cpu(tiny_dir):
    stats = {}
    for device in ("cpu", "cuda"):
        cfg = CalibrationConfig(tokens=512, seq_len=128, clip="head", clip_sample_tokens=128, device=device,
                                dtype="float32").resolved()
        model, tok = load_model(tiny_dir, device, "float32")
        stats[device] = collect_stats(model, tok, cfg, progress=False)
    torch.testing.assert_close(stats["cuda"].c_q(), stats["cpu"].c_q(), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(stats["cuda"].c_s(), stats["cpu"].c_s(), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(stats["cuda"].k_res[0].sample(), stats["cpu"].k_res[0].sample(), rtol=1e-3, atol=1e-4)


def test_cuda_bf16_calibration_end_to_end(tiny_dir, tmp_path):
    out = str(tmp_path / "cuda.safetensors")
    assert main(["--model", tiny_dir, "--out", out, "--device", "cuda", "--tokens", "2048", "--seq-len", "256",
                 "--batch-size", "4", "--quiet"]) == 0
    rot = load_rotations(out, expect=model_shape(tiny_dir))
    assert rot.meta.recipe_detail["device"] == "cuda" and rot.meta.recipe_detail["model_dtype"] == "bfloat16"
    cpu = calibrate(tiny_dir, CalibrationConfig(tokens=2048, seq_len=256, device="cpu", dtype="float32"),
                    progress=False, log=lambda m: None)
    # same text, same model: the bf16 statistics give nearly the same top key direction
    # (R = U H P, so U = R P^T H)
    undo = permutation_matrix(bit_reversal_permutation(64)).T @ hadamard_matrix(64)
    top_gpu = (rot.layers[0].k_rot[0].double() @ undo)[:, 0]
    top_cpu = (cpu.layers[0].k_rot[0].double() @ undo)[:, 0]
    assert abs(float(top_gpu @ top_cpu)) > 0.9
