"""patches/*.diff against sglang 0.5.17 and `oscar-sglang patch` (CPU, temp copies only).

The pristine files come from the installed sglang: copied as they are when the install is
unpatched, or reverted in the copy when it is patched; the installed package is never
written.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_ext import patching
from sglang_ext.launcher import main as launcher_main
from sglang_ext.patching import APPLIED, DRIFTED, NOT_APPLIED, PatchError

ROOT = Path(__file__).resolve().parents[1]


def _installed_root() -> Path:
    try:
        return patching.installed_sglang_dir()
    except PatchError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def patches():
    return patching.load_patches()


def _targets(patches) -> list[str]:
    return sorted({fp.path for p in patches for fp in p.files})


@pytest.fixture
def pristine(tmp_path, patches) -> Path:
    """A copy of the installed sglang's patched files (+ _version.py), unpatched."""
    src = _installed_root()
    dst = tmp_path / "sglang"
    for rel in _targets(patches) + ["_version.py"]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dst / rel)
    for p in patches:
        state, details = patching.patch_state(p, dst)
        assert state in (APPLIED, NOT_APPLIED), f"installed sglang drifted from {p.name}: {details}"
        if state == APPLIED:
            patching.revert_patch(p, dst)
    return dst


def _snapshot(root: Path, patches) -> dict:
    return {rel: (root / rel).read_bytes() for rel in _targets(patches)}


def test_patches_are_found_in_the_checkout_and_parse(patches):
    assert patching.patches_dir() == ROOT / "patches"
    assert [p.name for p in patches] == sorted(p.name for p in (ROOT / "patches").glob("*.diff"))
    assert all(fp.hunks for p in patches for fp in p.files)


def test_apply_check_revert_round_trip(pristine, patches, capsys):
    before = _snapshot(pristine, patches)
    args = ["--sglang-dir", str(pristine)]
    assert patching.main(["--check", *args]) == 0
    assert "not applied" in capsys.readouterr().out
    assert patching.main(["--apply", *args]) == 0
    after = _snapshot(pristine, patches)
    assert after != before
    assert all(patching.patch_state(p, pristine)[0] == APPLIED for p in patches)
    text = (pristine / "srt/server_args.py").read_text()
    for field in ("oscar_rotations", "oscar_sink_tokens", "oscar_recent_window", "oscar_sink_slots",
                  "oscar_extend_prefix"):
        assert f"    {field}: A[" in text
    assert '"oscar_int2",' in text
    assert patching.main(["--check", *args]) == 0
    assert ": applied" in capsys.readouterr().out
    assert patching.main(["--apply", *args]) == 0  # idempotent
    assert "already applied" in capsys.readouterr().out
    assert _snapshot(pristine, patches) == after
    assert patching.main(["--revert", *args]) == 0
    assert _snapshot(pristine, patches) == before  # byte-identical
    assert patching.main(["--revert", *args]) == 0
    assert "already not applied" in capsys.readouterr().out


def test_patched_file_is_valid_python(pristine, patches):
    for p in patches:
        patching.apply_patch(p, pristine)
    for rel in _targets(patches):
        compile((pristine / rel).read_text(), rel, "exec")


def _first_removed_or_context_line(patches) -> tuple[str, str]:
    fp = patches[0].files[0]
    h = fp.hunks[0]
    line = next(x for x in h.old if x.strip())
    return fp.path, line


@pytest.mark.parametrize("applied_first", [False, True])
def test_drift_is_detected_and_nothing_is_written(pristine, patches, applied_first, capsys):
    if applied_first:
        for p in patches:
            patching.apply_patch(p, pristine)
    rel, line = _first_removed_or_context_line(patches)
    target = pristine / rel
    text = target.read_text()
    assert line in text
    target.write_text(text.replace(line, line + "  # local edit", 1))
    drifted = _snapshot(pristine, patches)
    args = ["--sglang-dir", str(pristine)]
    assert patching.main(["--check", *args]) == 1
    out = capsys.readouterr().out
    assert DRIFTED in out and "hunk does not match" in out
    for action in ("--apply", "--revert"):
        assert patching.main([action, *args]) == 1
        assert "refusing" in capsys.readouterr().out
        assert _snapshot(pristine, patches) == drifted


def test_partly_applied_is_drift(tmp_path):
    text = "a\nb\nc\nd\ne\nf\ng\nh\ni\nj\nk\nl\n"
    diff = ("--- a/f.py\n+++ b/f.py\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
            "@@ -10,3 +10,3 @@\n j\n-k\n+K\n l\n")
    patch = patching.parse_diff(diff, "two.diff")
    (tmp_path / "f.py").write_text(text.replace("b\n", "B\n"))
    state, details = patching.patch_state(patch, tmp_path)
    assert state == DRIFTED and "partly applied" in details[0]
    (tmp_path / "f.py").write_text(text)
    patching.apply_patch(patch, tmp_path)
    assert (tmp_path / "f.py").read_text() == text.replace("b\n", "B\n").replace("k\n", "K\n")
    patching.revert_patch(patch, tmp_path)
    assert (tmp_path / "f.py").read_text() == text


def test_other_sglang_version_refused(pristine, capsys):
    vfile = pristine / "_version.py"
    vfile.write_text(vfile.read_text().replace("'0.5.17'", "'0.5.18'"))
    assert patching.main(["--check", "--sglang-dir", str(pristine)]) == 2
    err = capsys.readouterr().err
    assert "sglang 0.5.18" in err and "0.5.17 only" in err and "\n" not in err.strip()


def test_not_an_sglang_dir_refused(tmp_path, capsys):
    assert patching.main(["--check", "--sglang-dir", str(tmp_path)]) == 2
    assert "no _version.py" in capsys.readouterr().err


@pytest.mark.parametrize("text,match", [
    ("nothing here\n", "no hunks"),
    ("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n-b\n", "truncated hunk"),
    ("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n a\n?b\n", "unexpected line"),
])
def test_malformed_diffs_refused(text, match):
    with pytest.raises(PatchError, match=match):
        patching.parse_diff(text, "bad.diff")


def test_diffs_are_standard_for_the_patch_program(pristine, patches):
    exe = shutil.which("patch")
    if exe is None:
        pytest.skip("the `patch` program is not installed")
    for p in sorted((ROOT / "patches").glob("*.diff")):
        r = subprocess.run([exe, "-p1", "--dry-run", "--force", "-d", str(pristine), "-i", str(p)],
                           capture_output=True, text=True)
        assert r.returncode == 0 and "FAILED" not in r.stdout and "fuzz" not in r.stdout, r.stdout + r.stderr


def test_launcher_dispatches_patch_subcommand(pristine, capsys):
    assert launcher_main(["patch", "--check", "--sglang-dir", str(pristine)]) == 0
    assert "not applied" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        launcher_main(["patch"])  # one of --check/--apply/--revert is required
