"""Run ``python -m sglang.benchmark.serving`` where Hugging Face ``datasets`` is absent.

SGLang 0.5.17's benchmark client imports ``datasets`` at module level (for its MMMU
dataset) although the random / random-ids datasets never use it, and the GPU machine has
no ``datasets``. When it cannot be imported, a stand-in module is registered whose
``load_dataset`` raises, then the client runs unchanged with the same arguments.

    python3 -m benchmarks.bench_serving_client --backend sglang --dataset-name random-ids ...
"""
from __future__ import annotations

import runpy
import sys
import types


def _load_dataset_unavailable(*args, **kwargs):
    raise ImportError("Hugging Face 'datasets' is not installed (pip install datasets); "
                      "only the random / random-ids datasets work without it")


def install_datasets_stand_in() -> bool:
    """Register the stand-in when ``datasets`` is missing; True if it was registered."""
    try:
        import datasets  # noqa: F401
        return False
    except ImportError:
        pass
    mod = types.ModuleType("datasets")
    mod.load_dataset = _load_dataset_unavailable
    sys.modules["datasets"] = mod
    return True


def main() -> None:
    install_datasets_stand_in()
    sys.argv[0] = "sglang.benchmark.serving"
    runpy.run_module("sglang.benchmark.serving", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
