"""Every user error of the console scripts ends with one line on stderr and a non-zero exit,
never a traceback; each CLI runs in a subprocess, as a user would run it."""
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calibration.calibrate import CalibrationConfig, calibrate
from oscar_kernels.contract.rotations_file import load_rotations, save_rotations
from calibration_helpers import save_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534  # a uid that owns nothing here


def _run(module: str, *args, prefix=(), timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*prefix, sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess, prefix: str) -> str:
    """The error line: the last of stderr, the only one with the prefix, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and lines, r.stderr[-3000:]
    errors = [l for l in lines if l.startswith(prefix)]
    assert errors == [lines[-1]], r.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def tiny_rot(tiny_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rot") / "hadamard.safetensors")
    save_rotations(path, calibrate(tiny_dir, CalibrationConfig(recipe="hadamard", device="cpu"),
                                   progress=False, log=lambda m: None))
    return path


def _subject_to_file_modes() -> list[str]:
    """Command prefix under which file modes apply: root passes them by CAP_DAC_OVERRIDE /
    CAP_DAC_READ_SEARCH, so a root run drops both from its capability bounding set."""
    if os.getuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without util-linux setpriv: file modes cannot be made to apply")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


def _not_mine(path: Path) -> None:
    """Give a file to another user where that is possible (root), so that its mode's
    'other' bits decide who reads it."""
    if os.getuid() == 0:
        os.chown(path, NOBODY, NOBODY)


# ---------------------------------------------------------------- oscar-sglang

@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_serve_without_a_gpu_is_refused_before_sglang_starts():
    r = _run("sglang_ext.launcher", "serve", "some/model", "--kv-cache-dtype", "oscar_int2")
    line = one_line_error(r, "oscar-sglang: ")
    assert "no CUDA GPU is available to torch" in line and "CUDA GPUs only" in line
    assert "sglang" not in r.stderr.lower().replace("oscar-sglang", "")  # SGLang never started


def test_serve_on_another_device_is_refused():
    r = _run("sglang_ext.launcher", "--model-path", "some/model", "--device", "cpu")
    line = one_line_error(r, "oscar-sglang: ")
    assert line.startswith("oscar-sglang: --device cpu is not supported: oscar-sglang serves on CUDA GPUs only")


def test_serve_checks_the_rotations_file_before_anything_else(tmp_path):
    bad = tmp_path / "r.safetensors"
    bad.write_bytes(b"not a tensor file at all" * 100)
    r = _run("sglang_ext.launcher", "--model-path", "some/model", "--kv-cache-dtype", "oscar_int2",
             "--oscar-rotations", bad)
    assert one_line_error(r, "oscar-sglang: ") == (
        f"oscar-sglang: --oscar-rotations: oscar rotations file {bad}: not a safetensors file (no valid "
        "safetensors header)")


def test_help_lists_the_oscar_flags_without_loading_sglang():
    from sglang_ext.settings import FLAGS

    code = ("import sys; from sglang_ext.launcher import main; rc = main(['--help']); "
            "print('loaded:', sorted(m for m in ('sglang', 'torch') if m in sys.modules)); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    out = r.stdout
    assert out.startswith("usage: oscar-sglang") and out.rstrip().endswith("loaded: []")
    assert "--kv-cache-dtype {oscar_int2}" in out and all(f.cli in out for f in FLAGS)
    assert "`oscar-sglang --help-all`" in out and len(out.splitlines()) < 60


def test_serve_without_arguments_says_how_to_list_them():
    r = _run("sglang_ext.launcher")
    line = one_line_error(r, "oscar-sglang: ")
    assert "no model given" in line and "`oscar-sglang --help`" in line
    assert "listed below" not in r.stdout and "usage: oscar-sglang" in r.stdout


# ---------------------------------------------------------------- oscar-calibrate --out

def test_calibrate_out_in_a_missing_folder_fails_before_any_work(tmp_path):
    out = tmp_path / "no" / "r.safetensors"
    r = _run("calibration.cli", "--model", tmp_path / "no-model", "--out", out)
    line = one_line_error(r, "oscar-calibrate: error: ")
    assert line == f"oscar-calibrate: error: --out {out}: folder {out.parent} does not exist"


def test_calibrate_out_that_is_a_folder_leaves_nothing_behind(tmp_path):
    r = _run("calibration.cli", "--model", tmp_path / "no-model", "--out", tmp_path)
    line = one_line_error(r, "oscar-calibrate: error: ")
    assert line.startswith(f"oscar-calibrate: error: --out {tmp_path} is a folder: name the file to write")
    assert list(tmp_path.iterdir()) == []


def test_calibrate_out_in_an_unwritable_folder(tmp_path, tiny_dir):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        r = _run("calibration.cli", "--model", tiny_dir, "--out", folder / "r.safetensors", "--recipe", "naive",
                 prefix=_subject_to_file_modes())
    finally:
        folder.chmod(0o755)
    line = one_line_error(r, "oscar-calibrate: error: ")
    assert line == (f"oscar-calibrate: error: --out {folder / 'r.safetensors'}: cannot write in folder "
                    f"{folder} (Permission denied)")
    assert list(folder.iterdir()) == []


def test_rotations_file_is_readable_by_others_and_a_permission_error_says_so(tmp_path, tiny_dir):
    """What the Docker image's uid 10001 meets on a host-made file: readable under the usual
    umask, and a permission error named as one when it is not."""
    path = tmp_path / "r.safetensors"
    old = os.umask(0o022)
    try:
        r = _run("calibration.cli", "--model", tiny_dir, "--out", path, "--recipe", "naive")
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr[-2000:]
    assert path.stat().st_mode & 0o777 == 0o644
    _not_mine(path)
    prefix = _subject_to_file_modes()
    check = "import sys; from oscar_kernels.contract.rotations_file import load_rotations; load_rotations(sys.argv[1])"
    ok = subprocess.run([*prefix, sys.executable, "-c", check, str(path)], cwd=ROOT, capture_output=True,
                        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ok.returncode == 0, ok.stderr[-2000:]
    path.chmod(0o600 if os.getuid() == 0 else 0o000)
    r = _run("calibration.cli", "proxy", "--model", tiny_dir, "--rotations", path, prefix=prefix)
    st = path.stat()
    line = one_line_error(r, "oscar-calibrate: error: ")
    assert line == (f"oscar-calibrate: error: oscar rotations file {path}: permission denied: uid {os.getuid()} "
                    f"cannot read it (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}); make it "
                    f"readable, e.g. chmod a+r {path}")
    assert "No such file" not in r.stderr


def test_eval_with_a_bad_rotations_file_is_one_line(tmp_path, tiny_dir):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a tensor file at all" * 100)
    r = _run("calibration.fidelity.cli", "--model", tmp_path / "no-model", "--method", f"oscar={bad}",
             "--out", tmp_path / "e.json")
    assert one_line_error(r, "oscar-eval: error: ") == (
        f"oscar-eval: error: oscar rotations file {bad}: not a safetensors file (no valid safetensors header)")
    assert not (tmp_path / "e.json").exists()


def test_eval_of_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    r = _run("calibration.fidelity.cli", "--model", tmp_path / "nope", "--device", "cpu")
    assert one_line_error(r, "oscar-eval: error: ") == (
        f"oscar-eval: error: {tmp_path / 'nope'}: not a model folder (no config.json)")


def test_eval_with_a_rotations_file_of_another_model_is_one_line(tmp_path, tiny_dir):
    other = save_tiny_model_dir(tmp_path / "other", "qwen3", kv_heads=2, head_dim=16)
    rot = str(tmp_path / "other.safetensors")
    save_rotations(rot, calibrate(other, CalibrationConfig(recipe="naive", device="cpu"), progress=False,
                                  log=lambda m: None))
    r = _run("calibration.fidelity.cli", "--model", tiny_dir, "--method", f"naive={rot}", "--device", "cpu",
             "--out", tmp_path / "e.json")
    assert one_line_error(r, "oscar-eval: error: ") == (
        f"oscar-eval: error: oscar rotations file {rot}: made for head_dim=16 (other), "
        f"but the served model has head_dim=32")


def test_tensor_set_mismatch_names_only_what_is_wrong(tmp_path, tiny_rot):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(tiny_rot, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "v_rot.1"}
        meta = f.metadata()
    bad = tmp_path / "m.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    r = _run("calibration.cli", "proxy", "--model", tmp_path / "no-model", "--rotations", bad)
    assert one_line_error(r, "oscar-calibrate: error: ") == (
        f"oscar-calibrate: error: oscar rotations file {bad}: tensor set does not match metadata: missing v_rot.1")


@pytest.mark.parametrize("kind", ["random", "torch.save"])
def test_not_a_safetensors_file_says_so(tmp_path, kind):
    bad = tmp_path / "r.safetensors"
    if kind == "random":
        bad.write_bytes(torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(1),
                                      dtype=torch.uint8).numpy().tobytes())
        want = "not a safetensors file (no valid safetensors header)"
    else:
        torch.save(torch.eye(8), bad)
        want = ("not a safetensors file but a pickle (torch.save) file: pickles are refused (loading one can run "
                "code); convert upstream OSCAR {k,v}_rotation_<layer>.pt files with "
                "`oscar-calibrate import-oscar-zoo`")
    r = _run("calibration.cli", "proxy", "--model", tmp_path / "no-model", "--rotations", bad)
    assert one_line_error(r, "oscar-calibrate: error: ") == f"oscar-calibrate: error: oscar rotations file {bad}: {want}"


# ---------------------------------------------------------------- too little calibration text

def test_too_little_calibration_text_is_refused(tmp_path, tiny_dir):
    data = tmp_path / "short.txt"
    data.write_text("def f(x):\n    return x + 1\n")
    out = tmp_path / "r.safetensors"
    r = _run("calibration.cli", "--model", tiny_dir, "--out", out, "--data", data, "--seq-len", "8", "--quiet")
    line = one_line_error(r, "oscar-calibrate: error: ")
    m = re.fullmatch(r"oscar-calibrate: error: too little calibration text: (\d+) tokens in whole windows of 8 "
                     r"\(a shorter rest is dropped\), but the head_dim 32 statistics need at least 256 "
                     r"\(8 x head_dim\): give more text with --data", line)
    assert m and 0 < int(m.group(1)) < 256 and int(m.group(1)) % 8 == 0, line
    assert list(tmp_path.iterdir()) == [data]


def test_too_small_token_budget_is_refused_before_the_model_loads(tmp_path, tiny_dir):
    r = _run("calibration.cli", "--model", tiny_dir, "--out", tmp_path / "r.safetensors", "--tokens", "300",
             "--seq-len", "200")
    assert one_line_error(r, "oscar-calibrate: error: ") == (
        "oscar-calibrate: error: --tokens 300 (whole windows of --seq-len 200 hold 200) is too few: the head_dim "
        "32 statistics need at least 256 tokens (8 x head_dim)")
    assert "on cpu/" not in r.stderr  # the model was never loaded


@pytest.mark.parametrize("kind", ["empty folder", "binary file", "jsonl without text"])
def test_calibration_text_without_text_is_refused_before_the_model_loads(tmp_path, tiny_dir, kind):
    data = {"empty folder": tmp_path / "texts", "binary file": tmp_path / "data.txt",
            "jsonl without text": tmp_path / "d.jsonl"}[kind]
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: not read
    (tmp_path / "data.txt").write_bytes(b"text\x00and bytes")
    (tmp_path / "d.jsonl").write_text('{"text": ""}\n')
    r = _run("calibration.cli", "--model", tiny_dir, "--out", tmp_path / "r.safetensors", "--data", data)
    line = one_line_error(r, "oscar-calibrate: error: ")
    assert line == f"oscar-calibrate: error: --data {data}: " + {
        "empty folder": "the folder holds no text files (.py, .pyi, .txt, .md, ... or .jsonl)",
        "binary file": "not calibration text: binary (it holds NUL bytes)",
        "jsonl without text": "not calibration text: no record with a non-empty 'text'"}[kind]
    assert "on cpu/" not in r.stderr  # the model was never loaded


@pytest.mark.parametrize("cmd, flag", [((), "--tokens"), ((), "--seq-len"), (("proxy",), "--tokens"),
                                       (("proxy",), "--seq-len")])
def test_counts_below_one_name_their_flag(tmp_path, tiny_dir, tiny_rot, cmd, flag):
    out = ["--rotations", tiny_rot] if cmd else ["--out", tmp_path / "r.safetensors", "--device", "cpu"]
    r = _run("calibration.cli", *cmd, "--model", tiny_dir, *out, flag, "0")
    assert one_line_error(r, "oscar-calibrate: error: ") == f"oscar-calibrate: error: {flag} must be >= 1 (got 0)"


def test_calibration_text_below_the_budget_warns_and_records_the_real_count(tmp_path, tiny_dir):
    data = tmp_path / "some.txt"
    data.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(60)))
    out = tmp_path / "r.safetensors"
    r = _run("calibration.cli", "--model", tiny_dir, "--out", out, "--data", data, "--tokens", "8192",
             "--seq-len", "64", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    warn = [l for l in r.stderr.splitlines() if "warning" in l]
    assert len(warn) == 1 and warn[0].startswith("oscar-calibrate: warning: the calibration text ran out after ")
    found = int(warn[0].split("ran out after ")[1].split()[0])
    assert 256 <= found < 8192 and found % 64 == 0
    meta = load_rotations(str(out)).meta
    assert meta.calib_tokens == found == meta.recipe_detail["tokens"]


# ---------------------------------------------------------------- examples/openai_client.py

def test_openai_client_without_a_server_names_the_url():
    with socket.socket() as s:  # a port that was free a moment ago and has no listener now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_client.py"), "--base-url", url],
                       capture_output=True, text=True, timeout=120, env=env)
    line = one_line_error(r, "openai_client.py: ")
    assert line.startswith(f"openai_client.py: no server answered at {url} (")
