"""Convert the upstream OSCAR project's rotation files into our rotations file.

Upstream stores one pair of files per layer, ``k_rotation_<layer>.pt`` and
``v_rotation_<layer>.pt`` (torch tensors, float32), each either ``[head_dim, head_dim]``
(one rotation shared by all KV heads of the layer) or ``[num_kv_heads, head_dim, head_dim]``.
They are read with ``torch.load(weights_only=True)`` (no pickle code execution).

Convention: the matrices are taken to act on row vectors, ``x' = x @ R`` (ours). If the
upstream files hold the transpose (``x' = R x`` on columns), pass ``transpose=True``.
No clip unless ``clip`` sets thresholds later; recipe ``oscar`` with
``recipe_detail.imported`` naming the source.
"""
from __future__ import annotations

import os
import re

import torch

from oscar_kernels.contract.layout import DEFAULT_SCALE_DTYPE, KVLayout
from oscar_kernels.contract.model_shape import ModelShape
from oscar_kernels.contract.rotations_file import Rotations, make_meta, no_clip
from oscar_kernels.hybrid_cache import LayerRotation

_NAME = re.compile(r"^([kv])_rotation_(\d+)\.pt$")


def _load_matrix(path: str, shape: ModelShape) -> torch.Tensor:
    try:
        t = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        raise ValueError(f"{path}: not a readable torch tensor file ({type(e).__name__})") from None
    if isinstance(t, dict) and len(t) == 1:  # a state dict with one tensor
        t = next(iter(t.values()))
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{path}: holds a {type(t).__name__}, expected a tensor")
    h, d = shape.num_kv_heads, shape.head_dim
    if tuple(t.shape) == (d, d):
        t = t.expand(h, d, d)
    elif tuple(t.shape) != (h, d, d):
        raise ValueError(f"{path}: shape {tuple(t.shape)}, expected ({d}, {d}) or ({h}, {d}, {d})")
    return t.to(torch.float32).clone()


def import_oscar_zoo(src: str, shape: ModelShape, model_name: str, transpose: bool = False,
                     group_size: int | None = None, scale_dtype: str = DEFAULT_SCALE_DTYPE,
                     value_group_size: int | None = None) -> Rotations:
    """Rotations (no clip) from upstream per-layer ``{k,v}_rotation_<layer>.pt`` in ``src``
    (group sizes and scale dtype default as oscar-calibrate's: KVLayout.resolve)."""
    layout = KVLayout.resolve(shape.head_dim, group_size, value_group_size, scale_dtype)
    if shape.is_hybrid:  # upstream files number the layers of all-full-attention models
        raise ValueError(f"import-oscar-zoo: the model has layers other than full attention (its full-attention "
                         f"layers are {', '.join(map(str, shape.attention_layers))} of {shape.num_layers}); "
                         f"upstream OSCAR rotation files are for models whose every layer is full attention")
    if not os.path.isdir(src):
        raise ValueError(f"{src}: no such folder")
    found: dict[tuple[str, int], str] = {}
    for f in os.listdir(src):
        m = _NAME.match(f)
        if m:
            found[(m.group(1), int(m.group(2)))] = os.path.join(src, f)
    want = [(x, l) for l in range(shape.num_layers) for x in "kv"]
    missing = [f"{x}_rotation_{l}.pt" for x, l in want if (x, l) not in found]
    if missing:
        raise ValueError(f"{src}: missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                         f"(model has {shape.num_layers} layers)")
    extra = sorted(f"{x}_rotation_{l}.pt" for x, l in found if l >= shape.num_layers)
    if extra:
        raise ValueError(f"{src}: {', '.join(extra[:4])} beyond the model's {shape.num_layers} layers")
    layers = []
    for l in range(shape.num_layers):
        r_k, r_v = (_load_matrix(found[(x, l)], shape) for x in "kv")
        if transpose:
            r_k, r_v = r_k.transpose(-1, -2).contiguous(), r_v.transpose(-1, -2).contiguous()
        lo, hi = no_clip(shape.num_kv_heads, shape.head_dim)
        layers.append(LayerRotation(r_k, r_v, lo, hi, lo.clone(), hi.clone()))
    detail = {"imported": os.path.abspath(src), "source": "upstream OSCAR {k,v}_rotation_<layer>.pt",
              "order": "x' = x @ R (row vectors)" + ("; upstream matrices transposed" if transpose else ""),
              "clip": "none", "group_size": layout.key_group_size,
              "value_group_size": layout.value_group_size, "scale_dtype": layout.scale_dtype}
    meta = make_meta(shape, model_name, layout, "oscar", recipe_detail=detail,
                     calib_data=f"imported from {os.path.abspath(src)}")
    return Rotations(meta, layers)
