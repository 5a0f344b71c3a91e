""".ci/run runs exactly README.md's test-command block and fails unless tests really ran."""
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / ".ci" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


blocks = _load("readme_blocks")
report = _load("check_pytest_report")


def test_readme_test_command_is_one_venv_install_and_pytest():
    cmd = blocks.marked_block((ROOT / "README.md").read_text(), "test-command")
    assert cmd.count("\n") == 1, "one line, so that a reader can copy it"
    steps = [s.strip() for s in cmd.strip().split("&&")]
    assert steps[0] == "python3 -m venv .venv"
    assert steps[1].startswith(".venv/bin/pip install -e ") and "test" in steps[1]
    assert steps[-1].startswith(".venv/bin/python -m pytest")


def test_readme_main_command_fetches_calibrates_and_checks_the_example_model():
    """Nothing outside the checkout: the example model is fetched, calibrated on the CPU with the
    base install plus the `example` extra (no CUDA wheels of `serve`), and oscar-eval compares it."""
    cmd = blocks.marked_block((ROOT / "README.md").read_text(), "main-command")
    steps = [shlex.split(s) for s in cmd.replace("\\\n", " ").strip().split("&&")]
    assert steps[0] == ["python3", "-m", "venv", ".venv"]
    assert steps[1] == [".venv/bin/pip", "install", "-e", ".[example]"]
    assert steps[2][:2] == [".venv/bin/oscar-calibrate", "example-model"]
    model = steps[2][2]
    calib, ev = dict(zip(steps[3][1::2], steps[3][2::2])), dict(zip(steps[4][1::2], steps[4][2::2]))
    assert steps[3][0] == ".venv/bin/oscar-calibrate" and calib["--model"] == model and calib["--device"] == "cpu"
    assert steps[4][0] == ".venv/bin/oscar-eval" and ev["--model"] == model and ev["--device"] == "cpu"
    assert ev["--method"] == f"oscar={calib['--out']}" and "--out" in ev
    assert not any(a.startswith("..") for step in steps for a in step)


@pytest.mark.parametrize("text, why", [
    ("no markers at all", "exactly one"),
    ("<!-- BEGIN x -->\n```bash\na\n```\n<!-- END x -->\n<!-- BEGIN x -->", "exactly one"),
    ("<!-- END x -->\n```bash\na\n```\n<!-- BEGIN x -->", "comes before"),
    ("<!-- BEGIN x -->\njust text\n<!-- END x -->", "found 0"),
    ("<!-- BEGIN x -->\n```\na\n```\n```\nb\n```\n<!-- END x -->", "found 2"),
    ("<!-- BEGIN x -->\n```bash\n\n```\n<!-- END x -->", "empty"),
])
def test_bad_markers_are_refused(text, why):
    with pytest.raises(blocks.ReadmeBlockError, match=why):
        blocks.marked_block(text, "x")


def test_block_body_is_returned_verbatim():
    text = "intro\n<!-- BEGIN x -->\n````bash\necho 'a && b'\nls\n````\n<!-- END x -->\nrest"
    assert blocks.marked_block(text, "x") == "echo 'a && b'\nls\n"


@pytest.mark.parametrize("counts, ok", [
    (dict(tests=5, failures=0, errors=0, skipped=1), True),
    (dict(tests=0, failures=0, errors=0, skipped=0), False),
    (dict(tests=3, failures=0, errors=0, skipped=3), False),
    (dict(tests=3, failures=1, errors=0, skipped=0), False),
    (dict(tests=3, failures=0, errors=1, skipped=0), False),
])
def test_report_verdict(counts, ok):
    assert (report.verdict(report.PytestCounts(**counts)) is None) == ok


def _fake_checkout(tmp_path: Path, test_body: str) -> Path:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    for f in ("run", "readme_blocks.py", "check_pytest_report.py"):
        shutil.copy2(ROOT / ".ci" / f, repo / ".ci" / f)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_x.py").write_text(test_body)
    cmd = f"{shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider tests"
    (repo / "README.md").write_text(f"# x\n<!-- BEGIN test-command -->\n```bash\n{cmd}\n```\n<!-- END test-command -->\n")
    return repo


def _ci(repo: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run(["bash", str(repo / ".ci" / "run")], cwd=tmp_cwd(repo), env=env,
                          capture_output=True, text=True, timeout=300)


def tmp_cwd(repo: Path) -> str:
    return str(repo.parent)  # .ci/run must not depend on the caller's directory


def test_ci_run_passes_when_tests_pass(tmp_path):
    r = _ci(_fake_checkout(tmp_path, "def test_a():\n    assert 1 + 1 == 2\n"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pytest report OK" in r.stdout and r.stdout.rstrip().endswith("CI: 1 passed, 0 failed, 0 skipped")


def test_ci_run_fails_when_a_test_fails(tmp_path):
    r = _ci(_fake_checkout(tmp_path, "def test_a():\n    assert False\n"))
    assert r.returncode != 0


def test_ci_run_fails_when_everything_is_skipped(tmp_path):
    r = _ci(_fake_checkout(tmp_path, "import pytest\n\n@pytest.mark.skip(reason='x')\ndef test_a():\n    pass\n"))
    assert r.returncode == 1 and "nothing was actually tested" in r.stderr


def test_ci_run_fails_when_no_test_is_collected(tmp_path):
    r = _ci(_fake_checkout(tmp_path, "X = 1\n"))
    assert r.returncode == 5 and "collected no tests" in r.stderr


def test_ci_run_fails_when_the_command_runs_no_pytest(tmp_path):
    repo = _fake_checkout(tmp_path, "")
    (repo / "README.md").write_text("<!-- BEGIN test-command -->\n```bash\necho hi\n```\n<!-- END test-command -->\n")
    r = _ci(repo)
    assert r.returncode == 1 and "did not run pytest" in r.stderr
