"""Data-free rotations files for the baselines: ``naive`` (R = I) and ``hadamard`` (R = H,
the normalised Hadamard over the whole head_dim), no clipping. Used by the tests and to
evaluate before a calibrated file exists; ``oscar-calibrate`` is the tool for real files.

    python -m calibration.fidelity.baseline_rotations --model DIR --recipe hadamard --out FILE \
        [--group-size 32] [--value-group-size G] [--scale-dtype float16]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from calibration.transforms import hadamard_matrix
from oscar_kernels.contract.layout import SCALE_DTYPES, KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import Rotations, make_meta, no_clip, save_rotations
from oscar_kernels.hybrid_cache import LayerRotation

BASELINES = ("naive", "hadamard")


def baseline_rotations(shape: ModelShape, model_name: str, recipe: str, group_size: int,
                       value_group_size: int | None = None, scale_dtype: str = "float16") -> Rotations:
    """``group_size``: the keys' INT2 group; ``value_group_size``: the values' (default: the keys')."""
    if recipe not in BASELINES:
        raise ValueError(f"baseline recipe must be one of {BASELINES}, got {recipe!r}")
    h, d = shape.num_kv_heads, shape.head_dim
    r = torch.eye(d) if recipe == "naive" else hadamard_matrix(d, torch.float32)
    r = r.expand(h, d, d).contiguous()
    layers = [LayerRotation(r.clone(), r.clone(), *no_clip(h, d), *no_clip(h, d))
              for _ in shape.attention_layers]  # the full-attention layers (make_meta's layer_ids)
    layout = KVLayout(group_size, group_size if value_group_size is None else value_group_size, scale_dtype)
    meta = make_meta(shape, model_name, layout, recipe,
                     recipe_detail={"rotation": "identity" if recipe == "naive" else "hadamard(head_dim)",
                                    "clip": "none", "source": "calibration.fidelity.baseline_rotations"},
                     calib_data="none (data-free)", calib_tokens=0)
    return Rotations(meta, layers)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder (config.json is read)")
    ap.add_argument("--recipe", choices=BASELINES, required=True)
    ap.add_argument("--group-size", type=int, default=32, help="keys' INT2 group size")
    ap.add_argument("--value-group-size", type=int, default=None, help="values' INT2 group size (default: --group-size)")
    ap.add_argument("--scale-dtype", default="float16", choices=SCALE_DTYPES)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with open(os.path.join(a.model, "config.json")) as f:
        shape = ModelShape.from_hf_config(json.load(f))
    save_rotations(a.out, baseline_rotations(shape, os.path.basename(os.path.normpath(a.model)),
                                             a.recipe, a.group_size, a.value_group_size, a.scale_dtype))
    print(a.out)


if __name__ == "__main__":
    main()
