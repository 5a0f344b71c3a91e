"""The rotations file: the only contract between calibration and serving.

safetensors (never pickle). Tensors, per covered model layer l (float32):
    k_rot.{l}, v_rot.{l}                [num_kv_heads, head_dim, head_dim]  (x' = x @ R)
    k_clip_min.{l}, k_clip_max.{l},
    v_clip_min.{l}, v_clip_max.{l}      [num_kv_heads, head_dim]  per-channel clip of the
                                        rotated values (-inf / +inf = no clip)
    k_shift.{l}                         [num_kv_heads, head_dim]  subtracted from the rotated
                                        keys before storing (version 2; version-1 files, which
                                        lack it, load with zeros)
Metadata (strings): format, version, architecture, model_name, num_layers, num_q_heads,
num_kv_heads, head_dim, group_size (the keys' INT2 group), value_group_size (the values';
absent in older files, which load with value_group_size = group_size), bits, scale_dtype
(shared by K and V), recipe, recipe_detail (JSON), calib_data, calib_tokens, created,
layers (JSON list), key_group_sizes (JSON list, version 4 only).

Key groups per layer. ``key_group_sizes`` gives each covered layer its keys' group size (in
``layers`` order), so a file can spend the keys' bytes unevenly: finer groups on the layers
whose attention INT2 keys disturb most, coarser ones elsewhere (oscar-calibrate picks them
at a mean budget). Each layer's rotation and clips were calibrated for its own groups. A
file whose layers all take ``group_size`` omits the field; one that varies is version 4,
which older readers refuse (they would serve every layer at ``group_size``).

Covered layers. Only a model's full-attention layers get the INT2 cache (hybrid
linear-attention models such as Qwen3-Next, sliding-window models such as gpt-oss and
Gemma-3: see :mod:`.model_shape`). ``layers`` names the model layers the file covers,
ascending, unique, each in [0, num_layers); ``num_layers`` stays the model's total layer
count. Files without the field (every file before it) cover every layer. The tensor suffix
l is the *model* layer index, not the position in ``layers``: ``k_rot.11`` is layer 11's
rotation whatever else the file holds, so a tensor names its layer without the metadata, a
file for an all-full-attention model is named exactly as before (suffix = position = model
layer), and a reader that ignores ``layers`` cannot mistake layer 11's rotation for layer
2's: it finds the tensor set wrong instead. In memory, ``Rotations.layers[i]`` is the
rotation of model layer ``meta.layer_ids[i]``; look layers up by model index with
:meth:`Rotations.for_model_layers` / :meth:`Rotations.by_model_layer`, never by position.
Version: a file that covers every layer is written as version 2 (older readers ignore the
extra ``layers`` key and read it correctly); a file that covers only some layers is version
3, which older readers refuse by its version instead of by its tensor names.

:func:`load_rotations` validates everything and raises :class:`RotationsFileError` with a
one-line reason; nothing is half-loaded.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

import torch

from ..hybrid_cache import LayerRotation
from .layout import SCALE_DTYPES, KVLayout, group_size_problem
from .model_shape import ModelShape, format_layers, kv_heads_for_rank

FORMAT = "oscar-rotations"
VERSION = "3"  # a file that covers some layers only (see the module doc)
ALL_LAYERS_VERSION = "2"  # what a file covering every layer is written as
PER_LAYER_GROUPS_VERSION = "4"  # a file whose layers' key groups differ (key_group_sizes)
SUPPORTED_VERSIONS = ("1", "2", VERSION, PER_LAYER_GROUPS_VERSION)
_V1_TENSOR_KINDS = tuple(k for k in LayerRotation.FIELDS if k != "k_shift")
RECIPES = ("oscar", "hadamard", "naive")
ORTHOGONALITY_TOL = 1e-3
_TENSOR_KINDS = LayerRotation.FIELDS
_INT_FIELDS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "group_size", "bits",
               "calib_tokens")
# integer fields older files lack (value_group_size: they load with the keys' group size)
_OPTIONAL_INT_FIELDS = ("value_group_size",)


class RotationsFileError(ValueError):
    """A rotations file that cannot be served; the message is one line."""


@dataclass
class RotationsMeta:
    architecture: str
    model_name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group_size: int  # the keys' INT2 group size
    scale_dtype: str  # of the INT2 (scale, min) of keys and values, a name in layout.SCALE_DTYPES
    recipe: str
    recipe_detail: dict = field(default_factory=dict)
    calib_data: str = ""
    calib_tokens: int = 0
    bits: int = 2
    created: str = ""
    version: str = VERSION
    value_group_size: int | None = None  # the values' INT2 group size; None: group_size
    # the model layers the file covers (ascending); None: every layer (range(num_layers))
    layer_ids: tuple[int, ...] | None = None
    # the keys' group size of each covered layer (layer_ids order); None: group_size everywhere
    key_group_sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.value_group_size is None:
            self.value_group_size = self.group_size
        if self.layer_ids is None:
            self.layer_ids = tuple(range(self.num_layers))
        self.layer_ids = tuple(self.layer_ids)
        if self.key_group_sizes is None:
            self.key_group_sizes = (self.group_size,) * len(self.layer_ids)
        self.key_group_sizes = tuple(self.key_group_sizes)

    @property
    def per_layer_key_groups(self) -> bool:
        """Whether the covered layers' key group sizes differ (a version-4 file)."""
        return len(set(self.key_group_sizes)) > 1

    @property
    def covers_every_layer(self) -> bool:
        return self.layer_ids == tuple(range(self.num_layers))

    @property
    def layout(self) -> KVLayout:
        """The layout of a file whose layers share one; per-layer key groups: :meth:`layer_layouts`."""
        if self.per_layer_key_groups:
            raise ValueError("the rotations file sets key groups per layer: use layer_layouts()")
        return KVLayout(self.group_size, self.value_group_size, self.scale_dtype)

    def key_groups_of(self, model_layers) -> tuple[int, ...]:
        """The keys' group size of each of ``model_layers`` (model layer indices, any order)."""
        by_layer = dict(zip(self.layer_ids, self.key_group_sizes))
        lack = [l for l in model_layers if l not in by_layer]
        if lack:
            raise ValueError(f"the rotations file covers model layers {format_layers(self.layer_ids)}, "
                             f"not {format_layers(lack)}")
        return tuple(by_layer[l] for l in model_layers)

    def layer_layouts(self, model_layers=None) -> list[KVLayout]:
        """The INT2 layout of each of ``model_layers`` (default: the covered layers, in order)."""
        groups = self.key_group_sizes if model_layers is None else self.key_groups_of(model_layers)
        return [KVLayout(g, self.value_group_size, self.scale_dtype) for g in groups]

    def mean_bytes_per_token_per_head(self) -> float:
        """INT2 bytes per token and KV head (K and V), averaged over the covered layers."""
        return sum(x.bytes_per_token_per_head(self.head_dim) for x in self.layer_layouts()) / len(self.layer_ids)

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.architecture, self.num_layers, self.num_q_heads,
                          self.num_kv_heads, self.head_dim, self.layer_ids)


@dataclass
class Rotations:
    meta: RotationsMeta
    layers: list[LayerRotation]  # layers[i] rotates model layer meta.layer_ids[i]

    def by_model_layer(self) -> dict[int, LayerRotation]:
        """{model layer index: its rotation} for the covered layers."""
        return dict(zip(self.meta.layer_ids, self.layers))

    def for_model_layers(self, model_layers) -> list[LayerRotation]:
        """The rotations of ``model_layers`` (model layer indices), in that order; a layer the
        file does not cover is a ValueError (one line)."""
        by_layer = self.by_model_layer()
        model_layers = list(model_layers)
        lack = [l for l in model_layers if l not in by_layer]
        if lack:
            raise ValueError(f"the rotations file covers model layers {format_layers(self.meta.layer_ids)}, "
                             f"not {format_layers(lack)}")
        return [by_layer[l] for l in model_layers]

    def for_kv_heads(self, heads: list[int]) -> "Rotations":
        idx = torch.tensor(heads, dtype=torch.long)
        layers = [LayerRotation(*(getattr(lr, f).index_select(0, idx) for f in _TENSOR_KINDS))
                  for lr in self.layers]
        return Rotations(replace(self.meta, num_kv_heads=len(heads)), layers)

    def for_tp_rank(self, tp_rank: int, tp_size: int) -> "Rotations":
        """The slice that one attention-TP rank serves (see kv_heads_for_rank)."""
        return self.for_kv_heads(kv_heads_for_rank(self.meta.num_kv_heads, tp_size, tp_rank))


def make_meta(shape: ModelShape, model_name: str, layout: KVLayout, recipe: str, **kw) -> RotationsMeta:
    return RotationsMeta(architecture=shape.architecture, model_name=model_name,
                         num_layers=shape.num_layers, num_q_heads=shape.num_q_heads,
                         num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         group_size=layout.key_group_size, value_group_size=layout.value_group_size,
                         scale_dtype=layout.scale_dtype, recipe=recipe,
                         layer_ids=shape.attention_layers, **kw)


def check_output_path(path: str) -> None:
    """Refuse an output path that :func:`save_rotations` could not write, before any work:
    a folder, a missing folder or one this process cannot create files in (ValueError)."""
    if os.path.isdir(path):
        raise ValueError(f"--out {path} is a folder: name the file to write, "
                         f"e.g. {os.path.join(path, 'rotations.safetensors')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--out {path}: folder {folder} does not exist")
    try:  # a real file, not os.access: read-only mounts and ACLs answer here as at save time
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write in folder {folder} ({e.strerror})") from None


def save_rotations(path: str, rotations: Rotations) -> None:
    """Write atomically (a temp file in the same folder, fsync, rename) with the mode the
    umask gives, so that a container user can read a host-made file."""
    from safetensors.torch import save

    _validate(rotations, path)  # never write a file we would refuse to load
    meta = rotations.meta
    tensors = {}
    for l, lr in zip(meta.layer_ids, rotations.layers):  # the suffix is the model layer
        for kind in _TENSOR_KINDS:
            tensors[f"{kind}.{l}"] = getattr(lr, kind).detach().to(torch.float32).cpu().clone(memory_format=torch.contiguous_format)
    version = ALL_LAYERS_VERSION if meta.covers_every_layer else VERSION
    md = {
        "format": FORMAT, "version": PER_LAYER_GROUPS_VERSION if meta.per_layer_key_groups else version,
        "architecture": meta.architecture, "layers": json.dumps(list(meta.layer_ids)),
        "model_name": meta.model_name, "recipe": meta.recipe,
        "recipe_detail": json.dumps(meta.recipe_detail, sort_keys=True),
        "calib_data": meta.calib_data, "scale_dtype": meta.scale_dtype,
        "created": meta.created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    md.update({k: str(getattr(meta, k)) for k in (*_INT_FIELDS, *_OPTIONAL_INT_FIELDS)})
    if meta.per_layer_key_groups:
        md["key_group_sizes"] = json.dumps(list(meta.key_group_sizes))
    data = save(tensors, metadata=md)  # safetensors' save_file would create the file 0600
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:  # open() creates 0666 & ~umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _fail(path: str, why: str) -> RotationsFileError:
    return RotationsFileError(f"oscar rotations file {path}: {why}")


def _parse_meta(path: str, md: dict | None) -> RotationsMeta:
    if not md or md.get("format") != FORMAT:
        raise _fail(path, f"not an OSCAR rotations file (metadata 'format' is not '{FORMAT}')")
    if md.get("version") not in SUPPORTED_VERSIONS:
        raise _fail(path, f"unsupported format version {md.get('version')!r} "
                          f"(this oscar-sglang reads {', '.join(SUPPORTED_VERSIONS)})")
    missing = [k for k in ("architecture", "recipe", "scale_dtype", *_INT_FIELDS) if k not in md]
    if missing:
        raise _fail(path, f"metadata lacks {', '.join(missing)}")
    ints = {}
    for k in (*_INT_FIELDS, *(k for k in _OPTIONAL_INT_FIELDS if k in md)):
        try:
            ints[k] = int(md[k])
        except ValueError:
            raise _fail(path, f"metadata {k}={md[k]!r} is not an integer") from None
    try:
        detail = json.loads(md.get("recipe_detail") or "{}")
    except json.JSONDecodeError:
        raise _fail(path, "metadata recipe_detail is not valid JSON") from None
    layer_ids = _parse_layers(path, md, ints["num_layers"])
    return RotationsMeta(layer_ids=layer_ids, key_group_sizes=_parse_key_group_sizes(path, md), architecture=md["architecture"], model_name=md.get("model_name", ""),
                         recipe=md["recipe"], recipe_detail=detail,
                         calib_data=md.get("calib_data", ""), scale_dtype=md["scale_dtype"],
                         created=md.get("created", ""), version=md["version"], **ints)


def _json_int_list(path: str, md: dict, field: str, what: str) -> list[int]:
    """Metadata ``field`` as a JSON list of ints; anything else is refused in one line."""
    try:
        values = json.loads(md[field])
    except json.JSONDecodeError:
        values = None
    if not isinstance(values, list) or not all(type(x) is int for x in values):
        raise _fail(path, f"metadata {field}={md[field]!r} is not a JSON list of {what}")
    return values


def _parse_key_group_sizes(path: str, md: dict) -> tuple[int, ...] | None:
    """The ``key_group_sizes`` field of a version-4 file (None otherwise; its length and sizes
    are checked with the tensors, :func:`_validate`); a bad one is refused in one line."""
    if md["version"] != PER_LAYER_GROUPS_VERSION:
        if "key_group_sizes" in md:
            raise _fail(path, f"metadata key_group_sizes in a version {md['version']} file "
                              f"(per-layer key groups are version {PER_LAYER_GROUPS_VERSION})")
        return None
    if "key_group_sizes" not in md:
        raise _fail(path, f"version {PER_LAYER_GROUPS_VERSION} file without the metadata 'key_group_sizes' field")
    return tuple(_json_int_list(path, md, "key_group_sizes", "integers"))


def _parse_layers(path: str, md: dict, num_layers: int) -> tuple[int, ...] | None:
    """The ``layers`` field (None when absent: every layer); a bad one is refused in one line."""
    if "layers" not in md:
        if md["version"] not in ("1", ALL_LAYERS_VERSION):
            raise _fail(path, f"version {md['version']} file without the metadata 'layers' field")
        return None
    layers = _json_int_list(path, md, "layers", "layer numbers")
    _check_layer_ids(path, layers, num_layers)
    if md["version"] == ALL_LAYERS_VERSION and layers != list(range(num_layers)):
        raise _fail(path, f"version {ALL_LAYERS_VERSION} file covering only layers {format_layers(layers)} "
                          f"of {num_layers} (such a file is version {VERSION})")
    return tuple(layers)


def _check_layer_ids(path: str, layers, num_layers: int) -> None:
    if not layers:
        raise _fail(path, "metadata layers is empty: the file covers no layer")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise _fail(path, f"metadata layers {format_layers(layers)} is not ascending without repeats")
    out = [l for l in layers if not 0 <= l < num_layers]
    if out:
        raise _fail(path, f"metadata layers names {format_layers(out)}, outside the model's "
                          f"{num_layers} layers (0..{num_layers - 1})")


def orthogonality_error(r: torch.Tensor) -> float:
    """max |R R^T - I| over the last two axes (any leading batch axes)."""
    r = r.double()
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return float((r @ r.transpose(-1, -2) - eye).abs().amax())


def _validate(rot: Rotations, path: str) -> None:
    m = rot.meta
    if m.bits != 2:
        raise _fail(path, f"bits={m.bits}, only 2-bit files are served")
    if m.recipe not in RECIPES:
        raise _fail(path, f"unknown recipe {m.recipe!r} (expected one of {', '.join(RECIPES)})")
    if m.scale_dtype not in SCALE_DTYPES:
        raise _fail(path, f"unknown scale_dtype {m.scale_dtype!r}")
    if min(m.num_layers, m.num_kv_heads, m.head_dim, m.num_q_heads) < 1 or m.head_dim % 4:
        raise _fail(path, "num_layers/num_kv_heads/num_q_heads must be >= 1 and head_dim a multiple of 4")
    for name in ("group_size", "value_group_size"):
        g = getattr(m, name)
        why = group_size_problem(m.head_dim, g)
        if why:
            raise _fail(path, f"{name} {g} {why}")
    _check_layer_ids(path, list(m.layer_ids), m.num_layers)
    if len(m.key_group_sizes) != len(m.layer_ids):
        raise _fail(path, f"key_group_sizes names {len(m.key_group_sizes)} layers, the file covers {len(m.layer_ids)}")
    for l, g in zip(m.layer_ids, m.key_group_sizes):
        why = group_size_problem(m.head_dim, g)
        if why:
            raise _fail(path, f"key group size {g} of layer {l} {why}")
    if len(rot.layers) != len(m.layer_ids):
        raise _fail(path, f"holds {len(rot.layers)} layers, metadata says {len(m.layer_ids)} "
                          f"(layers {format_layers(m.layer_ids)})")
    h, d = m.num_kv_heads, m.head_dim
    for l, lr in zip(m.layer_ids, rot.layers):
        for kind in _TENSOR_KINDS:
            t = getattr(lr, kind)
            want = (h, d, d) if kind.endswith("rot") else (h, d)
            if tuple(t.shape) != want:
                raise _fail(path, f"{kind}.{l} has shape {tuple(t.shape)}, expected {want}")
            if torch.isnan(t).any():
                raise _fail(path, f"{kind}.{l} contains NaN")
            if kind in ("k_rot", "v_rot", "k_shift") and not torch.isfinite(t).all():
                raise _fail(path, f"{kind}.{l} contains Inf")
        for kind in ("k_rot", "v_rot"):
            err = orthogonality_error(getattr(lr, kind))
            if not err <= ORTHOGONALITY_TOL:
                raise _fail(path, f"{kind}.{l} is not orthogonal (max |R R^T - I| = {err:.2e} "
                                  f"> {ORTHOGONALITY_TOL:g})")
        for x in ("k", "v"):
            lo, hi = getattr(lr, f"{x}_clip_min"), getattr(lr, f"{x}_clip_max")
            if not (lo < hi).all():
                raise _fail(path, f"{x}_clip_min.{l} is not below {x}_clip_max.{l} everywhere")


def check_matches_model(meta: RotationsMeta, shape: ModelShape, path: str = "") -> None:
    """Refuse a file made for another model (one line naming the first mismatch), or one whose
    covered layers are not the model's full-attention layers."""
    for name in ("architecture", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
        have, want = getattr(meta, name), getattr(shape, name)
        if have != want:
            raise _fail(path, f"made for {name}={have} ({meta.model_name or 'unknown model'}), "
                              f"but the served model has {name}={want}")
    if tuple(meta.layer_ids) != tuple(shape.attention_layers):
        raise _fail(path, f"covers layers {format_layers(meta.layer_ids)} but the model's full-attention "
                          f"layers are {format_layers(shape.attention_layers)}")


def _tensor_set_mismatch(lack: list[str], extra: list[str]) -> str:
    def names(xs):
        return ", ".join(xs[:3]) + (f" and {len(xs) - 3} more" if len(xs) > 3 else "")
    parts = ([f"missing {names(lack)}"] if lack else []) + ([f"unexpected {names(extra)}"] if extra else [])
    return "tensor set does not match metadata: " + "; ".join(parts)


def _open_for_reading(path: str) -> bytes:
    """The file's first bytes; a permission problem is reported as one (safetensors would
    call it a missing file)."""
    try:
        with open(path, "rb") as f:
            return f.read(9)
    except PermissionError:
        st = os.stat(path)
        raise _fail(path, f"permission denied: uid {os.getuid()} cannot read it (mode "
                          f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}); make it readable, "
                          f"e.g. chmod a+r {path}") from None
    except OSError as e:
        raise _fail(path, f"cannot be read ({e.strerror})") from None


def _not_safetensors(path: str, head: bytes) -> str | None:
    """Why the file is not safetensors at all, or None when it starts like one (8-byte
    little-endian header length, then a JSON object): a pickle / torch.save file, or other bytes."""
    header_len = int.from_bytes(head[:8], "little")
    if len(head) == 9 and header_len <= os.path.getsize(path) - 8 and head[8:9] == b"{":
        return None
    if head[:1] == pickle.PROTO or zipfile.is_zipfile(path):
        return ("not a safetensors file but a pickle (torch.save) file: pickles are refused (loading one "
                "can run code); convert upstream OSCAR {k,v}_rotation_<layer>.pt files with "
                "`oscar-calibrate import-oscar-zoo`")
    return "not a safetensors file (no valid safetensors header)"


def load_rotations(path: str, expect: ModelShape | None = None) -> Rotations:
    """Load and validate a rotations file; with ``expect`` also check it fits that model."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise _fail(path, "no such file")
    why = _not_safetensors(path, _open_for_reading(path))
    if why:
        raise _fail(path, why)
    try:
        with safe_open(path, framework="pt") as f:
            meta = _parse_meta(path, f.metadata())
            keys = set(f.keys())
            kinds = _V1_TENSOR_KINDS if meta.version == "1" else _TENSOR_KINDS
            want = {f"{k}.{l}" for k in kinds for l in meta.layer_ids}
            if keys != want:
                raise _fail(path, _tensor_set_mismatch(sorted(want - keys), sorted(keys - want)))
            layers = [LayerRotation(**{k: f.get_tensor(f"{k}.{l}").to(torch.float32) for k in kinds})
                      for l in meta.layer_ids]
    except RotationsFileError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _fail(path, f"not a readable safetensors file (truncated or corrupt?): {first}") from None
    rot = Rotations(meta, layers)
    _validate(rot, path)
    if expect is not None:
        check_matches_model(meta, expect, path)
    return rot


def no_clip(num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(clip_min, clip_max) that clip nothing."""
    return (torch.full((num_kv_heads, head_dim), -math.inf), torch.full((num_kv_heads, head_dim), math.inf))
